"""What the benchmarks that run TRL's GRPOTrainer share (``vs_trl.py``, ``gpu.py``): its model loaded as TRL
takes it, with the model's ``generate`` timed (TRL samples through it)."""

from __future__ import annotations

import time
from typing import Any


def model_with_timed_generate(path: str, cuda: bool = False) -> tuple[Any, list[float]]:
    """``path``'s causal LM in float32 (TRL's trainer casts for bf16 itself) and the list that each of its
    ``generate`` calls appends its seconds to (the device synchronized first on CUDA)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    seconds: list[float] = []
    generate = model.generate

    def timed(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return generate(*a, **k)
        finally:
            if cuda:
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - t)

    model.generate = timed
    return model, seconds
