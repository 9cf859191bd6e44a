"""One job, as its JobDriver runs it: ``run`` -> TrainJob | InferenceJob.

``train_job`` (composition), ``runtime`` (a trained policy's actors), ``step`` (the RL step:
``rl_step``), ``env_source`` / ``game_source`` (where groups come from), ``sft`` (warm-up and SFT
jobs), ``episodes`` (rewards, splits, the episode log), ``inference`` (``job.kind: infer``).
"""
