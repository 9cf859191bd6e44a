"""Sampling: RolloutWorker (one backend behind one interface), RolloutFleet (routing over workers
and health checks), ``backends/`` (HF with oneDNN-packed CPU kernels, vLLM)."""
