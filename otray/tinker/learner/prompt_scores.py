"""What a sample request may ask beyond its samples, computed from the model's next-token distributions.

Tinker's ``SampleRequest`` (SDK 0.38) can ask, besides ``prompt_logprobs``:

- ``topk_prompt_logprobs=K``: the K most likely tokens and their logprobs at every prompt position (the
  distribution over prompt token i given the tokens before it); position 0 has no context and gets the
  SDK's sentinel row (token 0, logprob -99999.0), as do the positions before ``prompt_logprobs_last_n``.
  The cookbook's self-distillation (``distillation/sdft.py``) reads a teacher's top-K this way.
- ``target_prompt_logprobs``: the logprobs of chosen token ids, an int64 ``[len(prompt) - 1, K]`` tensor
  whose cell ``[i, j]`` is scored at prompt position ``i + 1``; ``-1`` asks nothing (answered 0.0); a
  sparse CSR tensor asks only its listed cells and is answered in the same layout.
- ``prompt_alt_tokens_k=k``: k draws, with replacement, at the request's temperature (temperature 0: the
  most likely token), from the distribution at every prompt position after the first, with the model's
  logprobs of the draws (``[len(prompt) - 1, k]`` each). A request's ``seed`` makes the draws repeatable.
- ``topk_sample_logprobs=K``: the K most likely tokens at each sampled token's step.

All logprobs are the model's own (untempered log-softmax of its logits; a vision-language model's vision
tokens are never candidates: their logits are masked as everywhere else). otray computes them on the
learner, from one forward pass over the prompt (and one over prompt + sample per sample for the sampled
top-K): requests that ask for any of them are served by the learner, not the vLLM samplers.

Runs in the SharedLearner actor (the scores) and the TinkerService actor (parsing a request, filling its answer)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from otray.tinker.errors import UserError
from otray.tinker.wire.requests import ASample

SENTINEL_LOGPROB = -99999.0  # the SDK's "no entry" in a top-K row (with token id 0)


@dataclass(frozen=True)
class Scoring:
    """The prompt and sample scores a request asks for (hashable: requests are batched by it)."""

    prompt_logprobs: bool = False
    topk: int = 0  # topk_prompt_logprobs
    sample_topk: int = 0  # topk_sample_logprobs
    alt_k: int = 0  # prompt_alt_tokens_k

    def needs_learner(self) -> bool:
        """Whether only the learner can serve it (everything but plain prompt logprobs)."""
        return bool(self.topk or self.sample_topk or self.alt_k)


@dataclass
class Targets:
    """A request's ``target_prompt_logprobs``: ``ids`` ``(len(prompt) - 1, K)`` int64, -1 where nothing is
    asked; ``crow``/``col`` the request's CSR layout when it was sparse (the answer uses it too)."""

    ids: np.ndarray
    crow: Optional[list[int]] = None
    col: Optional[list[int]] = None


@dataclass
class PromptScores:
    """One prompt's answers (numpy arrays; None where not asked)."""

    logprobs: Optional[list[Optional[float]]] = None
    topk: Optional[tuple[np.ndarray, np.ndarray]] = None  # (len(prompt), K): int32 ids, float32 logprobs
    targets: Optional[np.ndarray] = None  # float32, the shape of Targets.ids
    alt: Optional[tuple[np.ndarray, np.ndarray]] = None  # (len(prompt) - 1, k): int64 ids, float32 logprobs
    sample_topk: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)  # per sample: (its length, K)


# --------------------------------------------------------------------------- the request (the service)


def parse_scoring(req: ASample, prompt_len: int, vocab: int, max_k: int) -> tuple[Scoring, Optional[Targets]]:
    """The scores ``req`` (an ``asample`` body) asks for, checked against the model (``vocab``) and the
    service's limit on K; a bad value is a UserError naming the field."""
    ks = {}
    for name in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
        k = getattr(req, name) or 0
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= min(max_k, vocab):
            raise UserError(f"{name}={k!r}: send an integer from 0 to {min(max_k, vocab)}")
        ks[name] = k
    scoring = Scoring(bool(req.prompt_logprobs), ks["topk_prompt_logprobs"], ks["topk_sample_logprobs"],
                      ks["prompt_alt_tokens_k"])
    raw = req.target_prompt_logprobs
    return scoring, (None if raw is None else parse_targets(raw, prompt_len, vocab, max_k))


def parse_targets(raw: Any, prompt_len: int, vocab: int, max_k: int) -> Targets:
    """``target_prompt_logprobs`` (the SDK's TensorData as JSON, dense or CSR) as :class:`Targets`."""
    what = "target_prompt_logprobs"
    if not isinstance(raw, dict) or raw.get("dtype") != "int64":
        raise UserError(f"{what} must be an int64 TensorData of token ids, [len(prompt) - 1, K]")
    shape, data = raw.get("shape"), raw.get("data")
    if (not isinstance(shape, list) or len(shape) != 2 or not all(_int(s) for s in shape)
            or shape[0] != prompt_len - 1 or not 1 <= shape[1] <= max_k):
        raise UserError(f"{what} has shape {shape}; send [len(prompt) - 1, K] = [{prompt_len - 1}, K] with "
                        f"1 <= K <= {max_k}")
    if not isinstance(data, list) or not all(_int(v) for v in data):
        raise UserError(f"{what}: its data must be a list of token ids")
    crow, col = raw.get("sparse_crow_indices"), raw.get("sparse_col_indices")
    ids = np.full(shape, -1, dtype=np.int64)
    if crow is None and col is None:
        if len(data) != shape[0] * shape[1]:
            raise UserError(f"{what}: {len(data)} values for shape {shape}")
        ids[:] = np.asarray(data, dtype=np.int64).reshape(shape)
    else:
        if (not isinstance(crow, list) or not isinstance(col, list) or len(crow) != shape[0] + 1 or crow[0] != 0
                or crow[-1] != len(col) or len(col) != len(data) or any(b < a for a, b in zip(crow, crow[1:]))
                or not all(_int(c) and 0 <= c < shape[1] for c in col)):
            raise UserError(f"{what}: a malformed sparse CSR tensor (crow_indices, col_indices and data must "
                            "agree with its shape); send it with the tinker SDK's TensorData")
        for row in range(shape[0]):
            ids[row, col[crow[row]:crow[row + 1]]] = data[crow[row]:crow[row + 1]]
    bad = ids[(ids < -1) | (ids >= vocab)]
    if bad.size:
        raise UserError(f"{what} holds token id {int(bad[0])}, outside the model's vocabulary [0, {vocab}) (-1: none)")
    return Targets(ids, crow, col)


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# --------------------------------------------------------------------------- the answers (the learner)


def score(position_logprobs: Any, prompt: list[int], scoring: Scoring, targets: Optional[Targets], temperature: float,
          seed: Optional[int], samples: list[list[int]]) -> PromptScores:
    """``prompt``'s scores. ``position_logprobs(tokens)`` is the model's ``(len(tokens) - 1, vocab)`` log-softmax
    over each next token (a torch tensor; the prompt's images are the caller's business)."""
    import torch

    out = PromptScores()
    if len(prompt) < 2:
        lp = torch.zeros(0, 1)
    else:
        lp = position_logprobs(prompt)
    if scoring.prompt_logprobs:
        got = lp.gather(-1, torch.tensor(prompt[1:], dtype=torch.long, device=lp.device)[:, None])[:, 0] if len(prompt) > 1 else lp[:0, 0]
        out.logprobs = [None, *got.tolist()] if prompt else []
    if scoring.topk:
        ids = np.zeros((len(prompt), scoring.topk), dtype=np.int32)
        vals = np.full((len(prompt), scoring.topk), SENTINEL_LOGPROB, dtype=np.float32)
        if len(prompt) > 1:
            top = lp.topk(scoring.topk, dim=-1)
            ids[1:], vals[1:] = top.indices.cpu().numpy(), top.values.cpu().numpy()
        out.topk = (ids, vals)
    if targets is not None:
        asked = torch.from_numpy(targets.ids).to(lp.device)
        got = lp.gather(-1, asked.clamp(min=0))
        out.targets = torch.where(asked >= 0, got, torch.zeros_like(got)).cpu().numpy().astype(np.float32)
    if scoring.alt_k and len(prompt) > 1:
        if temperature <= 0:
            draws = lp.argmax(-1, keepdim=True).expand(-1, scoring.alt_k)
        else:
            gen = torch.Generator(device=lp.device.type)
            gen.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ()).item()))
            draws = torch.multinomial(torch.softmax(lp / temperature, -1), scoring.alt_k, replacement=True,
                                      generator=gen)
        out.alt = (draws.cpu().numpy().astype(np.int64), lp.gather(-1, draws).cpu().numpy().astype(np.float32))
    elif scoring.alt_k:
        out.alt = (np.zeros((0, scoring.alt_k), np.int64), np.zeros((0, scoring.alt_k), np.float32))
    for sample in samples if scoring.sample_topk else []:
        rows = position_logprobs(prompt + list(sample))[len(prompt) - 1:] if sample else lp[:0]
        top = rows.topk(scoring.sample_topk, dim=-1) if sample else None
        out.sample_topk.append((top.indices.cpu().numpy().astype(np.int32), top.values.cpu().numpy()) if top is not None
                               else (np.zeros((0, scoring.sample_topk), np.int32), np.zeros((0, scoring.sample_topk), np.float32)))
    return out


def cut_before(scores: PromptScores, last_n: Optional[int]) -> PromptScores:
    """``prompt_logprobs_last_n``: the top-K rows before the last ``n`` prompt positions become sentinels."""
    if last_n is not None and scores.topk is not None:
        ids, vals = scores.topk[0].copy(), scores.topk[1].copy()
        cut = len(ids) - last_n
        ids[:cut], vals[:cut] = 0, SENTINEL_LOGPROB
        scores.topk = (ids, vals)
    return scores


# --------------------------------------------------------------------------- the protobuf answer


def fill_response(p: Any, out: Any, scores: PromptScores, targets: Optional[Targets]) -> None:
    """Write ``scores`` into ``out`` (a ``SampleResponse`` protobuf of module ``p``)."""
    if scores.topk is not None:
        _topk(out.topk_prompt_logprobs, *scores.topk)
    for seq, (ids, vals) in zip(out.sequences, scores.sample_topk):
        _topk(seq.topk_sampled_logprobs, ids, vals)
    if scores.targets is not None and targets is not None:
        t = out.target_prompt_logprobs
        t.dtype = p.DTYPE_FLOAT32
        t.shape.extend(targets.ids.shape)
        if targets.crow is None:
            t.dense = scores.targets.astype(np.float32).tobytes()
        else:
            rows = np.repeat(np.arange(len(targets.crow) - 1), np.diff(targets.crow))
            t.sparse_csr.crow_indices = np.asarray(targets.crow, np.int64).tobytes()
            t.sparse_csr.col_indices = np.asarray(targets.col, np.int64).tobytes()
            t.sparse_csr.values = scores.targets[rows, np.asarray(targets.col, np.int64)].astype(np.float32).tobytes()
    if scores.alt is not None:
        for msg, arr, dtype in ((out.prompt_alt_tokens.tokens, scores.alt[0], p.DTYPE_INT64),
                                (out.prompt_alt_tokens.logprobs, scores.alt[1], p.DTYPE_FLOAT32)):
            msg.dtype, msg.dense = dtype, arr.tobytes()
            msg.shape.extend(arr.shape)


def _topk(msg: Any, ids: np.ndarray, vals: np.ndarray) -> None:
    msg.length, msg.k = ids.shape
    msg.token_ids, msg.logprobs = ids.astype(np.int32).tobytes(), vals.astype(np.float32).tobytes()
