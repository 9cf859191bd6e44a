"""The Ray actors of a training cluster, one folder per role.

- ``control/``: the ResourceManager (users, jobs, leases, checkpoints; the only detached actor) and
  the JobDriver it starts in each job's placement group.
- ``job/``: what a JobDriver runs: TrainJob (SFT warm-up, then ``rl_step``), InferenceJob, the group
  sources (env mixture, game) and the policies' runtimes.
- ``rollout/``: the agent loop env jobs use and the ProtocolCoordinator actor of game jobs.
- ``learner/``: PolicyLearner and its sharded form (LearnerGroup over LearnerRanks), over one core.
- ``sampling/``: RolloutWorker (one backend: HF or vLLM) and RolloutFleet (routing over workers).

Imports go down this list (control -> job -> rollout -> sampling; job -> learner -> sampling);
``tests/test_layout.py`` checks it.
"""
