"""A Tinker-compatible training and sampling service (``otray tinker``): the official ``tinker``
SDK points at it with ``base_url`` and trains LoRA adapters of otray's base models.
See docs/architecture.md, "The Tinker API"."""
