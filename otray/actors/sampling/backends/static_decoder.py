"""A causal LM's forward pass over a KV cache of fixed shape, for the compiled sampler (``compiled.py``).

Runs in whichever process samples: a rollout worker, or a learner that samples (``rollout.colocate``).
It calls the model's own modules (embeddings, norms, projections, MLPs, rotary embedding, head), so
a PEFT-wrapped projection applies its adapter and weights loaded in place are seen at once; only the
attention and the cache are its own: one key and value tensor per layer of ``(rows, kv_heads, length,
head_dim)``, allocated once at a fixed address (what CUDA graphs need).

Each row keeps its tokens from cache slot 0: a row's prompt fills slots ``0..len-1`` and its n-th new
token slot ``len+n`` (its rotary position too), so rows of different lengths each get the whole
``length`` (``max_model_len``), as a left-padded eager ``generate`` gives them, and a row attends to
exactly its own slots ``<= slot``.

Decoder-only families laid out as Llama (``model.layers[i].self_attn.{q,k,v,o}_proj``, ``mlp``,
``input_layernorm``, ``post_attention_layernorm``, ``model.norm``, ``lm_head``), Qwen3's per-head
query/key norms included; sliding-window attention is not (``unsupported``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

FAMILIES = ("qwen2", "qwen3", "llama")


def language_model(model: Any) -> Any:
    """The causal LM under a PEFT wrapper (its projections still carry their adapters), or ``model``."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def unsupported(model: Any) -> str | None:
    """Why :class:`StaticDecoder` cannot run ``model`` (None: it can)."""
    lm = language_model(model)
    cfg = lm.config
    kind = getattr(cfg, "model_type", "?")
    if kind not in FAMILIES:
        return f"model type {kind!r} (the compiled sampler runs {', '.join(FAMILIES)})"
    if getattr(cfg, "use_sliding_window", False) or "sliding_attention" in (getattr(cfg, "layer_types", None) or ()):
        return f"{kind} with sliding-window attention"
    if not hasattr(lm, "model") or not hasattr(lm.model, "rotary_emb"):
        return f"{type(lm).__name__} is not laid out as a Llama-style causal LM"
    return None


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class StaticDecoder:
    """``model``'s forward pass over a cache of ``rows`` x ``length`` slots in ``dtype``."""

    def __init__(self, model: Any, rows: int, length: int, dtype: torch.dtype, device: torch.device | str):
        why = unsupported(model)
        if why is not None:
            raise ValueError(f"the compiled sampler cannot run {why}")
        self.lm = language_model(model)
        self.body = self.lm.model
        cfg = self.lm.config.get_text_config()
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.rows, self.length, self.dtype = rows, length, dtype
        shape = (rows, self.kv_heads, length, self.head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.body.layers]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.body.layers]
        for t in (*self.keys, *self.values):
            torch._dynamo.mark_static_address(t)
        self.slots = torch.arange(length, device=device)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def prefill(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Run ``ids`` (``(B, W)``, right-padded; row b's tokens are its first ``lengths[b]``) into slots
        ``0..W-1``; the float32 logits after each row's last prompt token, ``(B, vocab)``."""
        b, w = ids.shape
        pos = self.slots[:w].unsqueeze(0).expand(b, w)
        allowed = (self.slots[:w].view(1, w) <= self.slots[:w].view(w, 1)).view(1, 1, w, w).expand(b, 1, w, w)
        hidden = self._layers(ids, pos, allowed, write=lambda cache, t: cache[:b, :, :w].copy_(t),
                              read=lambda cache: cache[:b, :, :w])
        last = hidden[torch.arange(b, device=ids.device), lengths - 1]
        return self._logits(last)

    def decode(self, ids: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """One new token per row: ``ids`` ``(B,)`` go into slots ``slot`` ``(B,)`` (their positions too);
        the float32 logits of the next token, ``(B, vocab)``. The step ``compiled.py`` compiles."""
        b = ids.shape[0]
        allowed = (self.slots.view(1, -1) <= slot.view(b, 1)).view(b, 1, 1, self.length)
        index = slot.view(b, 1, 1, 1).expand(b, self.kv_heads, 1, self.head_dim)
        hidden = self._layers(ids.view(b, 1), slot.view(b, 1), allowed,
                              write=lambda cache, t: cache[:b].scatter_(2, index, t), read=lambda cache: cache[:b])
        return self._logits(hidden[:, -1])

    def _layers(self, ids: torch.Tensor, pos: torch.Tensor, allowed: torch.Tensor, write: Any, read: Any) -> torch.Tensor:
        x = self.body.embed_tokens(ids)
        cos, sin = self.body.rotary_emb(x, pos)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        b, t = ids.shape
        for i, layer in enumerate(self.body.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(b, t, self.heads, self.head_dim)
            k = attn.k_proj(h).view(b, t, self.kv_heads, self.head_dim)
            v = attn.v_proj(h).view(b, t, self.kv_heads, self.head_dim)
            if hasattr(attn, "q_norm"):  # Qwen3: RMS norm per head before the rotation
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            write(self.keys[i], k.to(self.dtype))
            write(self.values[i], v.to(self.dtype))
            keys, values = read(self.keys[i]), read(self.values[i])
            out = F.scaled_dot_product_attention(q.to(self.dtype), keys, values, attn_mask=allowed,
                                                 enable_gqa=self.kv_heads != self.heads)
            x = x + attn.o_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim).to(h.dtype))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x

    def _logits(self, last: torch.Tensor) -> torch.Tensor:
        return self.lm.lm_head(self.body.norm(last)).float()
