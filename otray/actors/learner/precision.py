"""How a learner holds and computes its weights, and how many tokens one micro-batch may take.

``model.dtype`` names the precision the model *computes* in (``auto``: bfloat16 on a GPU, float32 on
the CPU, as ``otray.device`` resolves it). What the learner *stores* depends on what it trains:

- full-parameter training in bf16/fp16: the parameters stay float32 (master weights, and so AdamW's
  state is float32 too) and forward/backward run under ``torch.autocast`` in the low precision. A
  bf16 parameter with a bf16 AdamW loses every update smaller than half its ulp: at |w| ~ 0.02 that
  is ~6e-5, so at learning rates of 1e-6..1e-5 most updates round away and the model does not
  learn (``tests/actors/learner/test_precision.py`` shows both). Chosen over a separate fp32 copy
  beside bf16 parameters: one copy of the weights, no copy-back step, and the same code under FSDP2.
- LoRA: the frozen base is stored in the low precision (half the memory); PEFT keeps the adapters in
  float32, so their updates are exact.
- float32: stored and computed in float32.

:func:`micro_batch_token_budget` derives ``algo.micro_batch_tokens: 0`` (auto) from the memory left
on the device and the model's shape.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, ContextManager

from otray.device import resolve_dtype

CPU_TOKEN_BUDGET = 8192  # algo.micro_batch_tokens: 0 on the CPU (memory is rarely the limit there)


@dataclass(frozen=True)
class Precision:
    """``storage``: the parameters' dtype; ``compute``: the autocast dtype of forward/backward (None:
    compute in the storage dtype)."""

    storage: str
    compute: str | None = None

    def autocast(self, device: str) -> ContextManager[Any]:
        """The context forward and backward passes run in."""
        if self.compute is None:
            return nullcontext()
        import torch

        return torch.autocast(device_type="cuda" if device.startswith("cuda") else "cpu",
                              dtype=getattr(torch, self.compute))

    @property
    def master_weights(self) -> bool:
        return self.compute is not None and self.storage == "float32"


def learner_precision(dtype: str, device: str, lora: bool) -> Precision:
    """What a learner of ``model.dtype = dtype`` on ``device`` stores and computes in (module docstring)."""
    resolved = resolve_dtype(dtype, device)
    if resolved == "float32" or lora:
        return Precision(resolved)
    return Precision("float32", resolved)


def activation_bytes_per_token(*, hidden: int, layers: int, vocab: int, intermediate: int,
                               value_bytes: int = 2, checkpointing: bool = False) -> int:
    """An estimate of the bytes one token of a micro-batch holds for the backward pass of a decoder.

    Per layer (values kept for backward): attention ~ 10 x hidden (norm, q/k/v, attention output,
    o-projection, residual), SwiGLU MLP ~ 4 x intermediate (gate, up, activation, product) + 2 x
    hidden; with gradient checkpointing only each layer's input (hidden) is kept, plus one layer
    recomputed in full. The loss adds the fp32 logits, their log-softmax and its gradient (3 x vocab
    x 4 bytes) and the low-precision logits (vocab x value_bytes)."""
    per_layer = (12 * hidden + 4 * intermediate) * value_bytes
    kept = layers * hidden * value_bytes + per_layer if checkpointing else layers * per_layer
    return kept + vocab * (12 + value_bytes)


def micro_batch_token_budget(free_bytes: int, *, hidden: int, layers: int, vocab: int, intermediate: int,
                             value_bytes: int = 2, checkpointing: bool = False, headroom: float = 0.7,
                             lowest: int = 256, highest: int = 1 << 20) -> int:
    """Tokens (rows x longest row, as ``micro_batches`` counts them) one micro-batch may take so its
    activations fit in ``headroom`` of ``free_bytes``; a multiple of 64 in ``[lowest, highest]``."""
    per_token = activation_bytes_per_token(hidden=hidden, layers=layers, vocab=vocab, intermediate=intermediate,
                                           value_bytes=value_bytes, checkpointing=checkpointing)
    tokens = int(max(free_bytes, 0) * headroom) // per_token
    return max(lowest, min(highest, tokens // 64 * 64))


def budget_for(model: Any, device: str, precision: Precision, checkpointing: bool) -> int:
    """``algo.micro_batch_tokens: 0`` on this learner: from the device's free memory on a GPU (the
    model and its optimizer state already on it), :data:`CPU_TOKEN_BUDGET` on the CPU."""
    if not device.startswith("cuda"):
        return CPU_TOKEN_BUDGET
    import torch

    free, _ = torch.cuda.mem_get_info()
    cfg = model.config.get_text_config()  # a vision-language model: its language model's
    return micro_batch_token_budget(
        free, hidden=cfg.hidden_size, layers=cfg.num_hidden_layers, vocab=cfg.vocab_size,
        intermediate=getattr(cfg, "intermediate_size", 4 * cfg.hidden_size),
        value_bytes=2 if (precision.compute or precision.storage) != "float32" else 4, checkpointing=checkpointing)
