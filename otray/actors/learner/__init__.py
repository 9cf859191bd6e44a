"""Learners: the model being trained, its optimizer and Tinker-style primitives.

``core`` (micro-batching, padding, loss sums, the normalizer, the optimizer: shared by every
learner, the Tinker service's included), ``policy_learner`` (PolicyLearner), ``state`` (checkpoints),
``group`` (LearnerGroup: N ranks behind the PolicyLearner interface), ``rank`` (LearnerRank: FSDP2).
"""
