"""The Tinker-compatible training API (``otray tinker``): many users' LoRA adapters on one base model.

Laid out by the process each part runs in (``tests/test_layout.py`` enforces the rooms and their
imports: gateway -> service -> learner -> wire, and every room may use ``errors`` and ``config``):

- ``gateway/``: the Ray Serve replicas: HTTP routes, who is calling, the OpenAI-compatible route;
- ``service/``: the TinkerService actor and the state it owns: training clients, sessions, futures,
  leases, the catalog and its SQLite store, sampling sessions, merges, external weights;
- ``learner/``: the SharedLearner actor (one per base model): the fair queue, the adapter learner and
  its switching, custom loss graphs and their interpreter, prompt scores; and the LoraSampler actor;
- ``wire/``: the SDK's formats (protobuf and JSON), sampling's, images.

Runs in no process of its own: a package face.
"""
