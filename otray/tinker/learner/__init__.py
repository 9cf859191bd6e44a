"""What trains and samples the users' adapters: the SharedLearner actor (one per base model: the fair
queue over users, the AdapterLearner and its adapter switching, custom loss graphs and their
interpreter, prompt scores) and the LoraSampler actor (a vLLM engine serving the adapters).

Runs in the SharedLearner and LoraSampler actors.
"""
