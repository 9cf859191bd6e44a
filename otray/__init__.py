"""otray: reinforcement learning for LLM agents, everything a Ray actor."""
