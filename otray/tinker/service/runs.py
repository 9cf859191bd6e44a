"""The Tinker API's JSON shapes for runs, checkpoints and model info, and the small checks the
service makes on names and sampling requests.

Runs in the TinkerService actor."""

from __future__ import annotations

import datetime as dt
import math
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from otray.tinker.service.store import Checkpoint, Run
from otray.tinker.wire.images import chunk_image, image_tokens
from otray.tinker.learner.prompt_scores import parse_scoring
from otray.tinker.wire.sampling import sampling_params
from otray.tinker.errors import UserError
from otray.tinker.wire.requests import ASample
from otray.vision import ImageError

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def cause(e: BaseException) -> str:
    """The last line of what failed in an actor (Ray wraps it), for an error message."""
    inner = getattr(e, "cause", None) or e
    text = str(inner).strip().splitlines() or [type(inner).__name__]
    return f"{type(inner).__name__}: {text[-1]}"[:2000]


def check_name(name: Optional[str]) -> None:
    if not name or not _NAME.fullmatch(name):
        raise UserError(f"checkpoint name {name!r}: use 1-128 letters, digits, '.', '_' or '-', starting with a "
                        "letter or digit")


def _iso(t: Optional[float]) -> Optional[str]:
    return None if t is None else dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat()


def checkpoint_json(c: Checkpoint) -> dict[str, Any]:
    return {"checkpoint_id": c.checkpoint_id, "checkpoint_type": c.kind, "time": _iso(c.created),
            "tinker_path": c.tinker_path, "size_bytes": c.size, "public": c.public,
            "user_metadata": c.user_metadata, "expires_at": _iso(c.expires)}


def run_json(run: Run, checkpoints: list[Checkpoint]) -> dict[str, Any]:
    def last(kind: str) -> Optional[dict[str, Any]]:
        found = [c for c in checkpoints if c.kind == kind and not c.name.startswith("ephemeral-")]
        return checkpoint_json(found[-1]) if found else None

    meta = {str(k): str(v) for k, v in (run.user_metadata or {}).items()} or None
    return {"training_run_id": run.model_id, "base_model": run.base_model, "model_owner": run.owner,
            "is_lora": True, "corrupted": False, "lora_rank": run.spec["rank"],
            "last_request_time": _iso(run.last_request), "last_checkpoint": last("training"),
            "last_sampler_checkpoint": last("sampler"), "user_metadata": meta}


def info(run: Run, model_dir: str) -> dict[str, Any]:
    """``get_info``: the SDK's ``get_tokenizer`` loads ``tokenizer_id`` with transformers, so it is the
    base model's directory (or hub id) as this service loaded it."""
    return {"type": "get_info", "model_id": run.model_id, "is_lora": True, "lora_rank": run.spec["rank"],
            "model_name": run.base_model,
            "model_data": {"arch": "causal_lm", "model_name": run.base_model, "tokenizer_id": model_dir}}


def weights_info(run: Run) -> dict[str, Any]:
    return {"base_model": run.base_model, "is_lora": True, "lora_rank": run.spec["rank"],
            "train_unembed": run.spec["train_unembed"], "train_mlp": run.spec["train_mlp"],
            "train_attn": run.spec["train_attn"]}


def remove_dir(path: str) -> None:
    shutil.rmtree(Path(path), ignore_errors=True)


@dataclass(frozen=True)
class ModelLimits:
    """What a base model accepts: token ids in ``[0, vocab)``, prompt plus new tokens within ``context``;
    ``vision``: its image inputs (``otray.vlm.VisionInputs``), None for a text-only model."""

    vocab: int
    context: int
    vision: Any = None

    @classmethod
    def of(cls, path: str, max_context_length: Optional[int] = None) -> ModelLimits:
        """The limits of the model directory ``path`` (context: ``max_context_length``, else the model's)."""
        from transformers import AutoConfig

        from otray.models import is_vision_config
        from otray.vlm import VisionInputs

        config = AutoConfig.from_pretrained(path)
        text = config.get_text_config()
        vision = VisionInputs.load(path, config) if is_vision_config(config) else None
        return cls(int(text.vocab_size), int(max_context_length or text.max_position_embeddings), vision)


class LimitsBook:
    """Each base model's :class:`ModelLimits`, read once (``paths``: name -> directory; ``models``: name
    -> its config, for ``max_context_length``)."""

    def __init__(self, paths: dict[str, str], models: dict[str, Any]):
        self.paths, self.models, self.known = paths, models, {}

    def of(self, base: str) -> ModelLimits:
        if base not in self.known:
            self.known[base] = ModelLimits.of(self.paths[base], self.models[base].max_context_length)
        return self.known[base]


def sample_wait(req: ASample, key: str, adapter: Optional[str], cfg: Any, cls: type,
                limits: ModelLimits) -> Any:
    """A checked ``asample`` body as the service's wait record (``cls``). Everything a sampler could
    fail on is checked here, against the model the request targets (``limits``): a request that
    reached a batch shared with other users' requests and failed there would fail theirs too."""
    chunks = (req.prompt or {}).get("chunks", [])  # field types: checked at the route (REQUEST_FIELDS)
    if not isinstance(chunks, list):
        raise UserError("asample: prompt must be a ModelInput, {\"chunks\": [{\"tokens\": [...]}, ...]}")
    prompt: list[int] = []
    images: list[Any] = []
    for chunk in chunks:
        if isinstance(chunk, dict) and chunk.get("type") in ("image", "image_asset_pointer"):
            try:
                images.append(chunk_image(chunk, getattr(cfg, "fetch_image_urls", False)))
                prompt.extend(image_tokens(images[-1], chunk.get("format"), chunk.get("expected_tokens"), limits.vision))
            except ImageError as e:
                raise UserError(f"asample: the prompt's image {len(images)}: {e}") from None
        else:
            prompt.extend(_chunk_tokens(chunk))
    if not prompt:
        raise UserError("asample: the prompt has no tokens")
    n = req.num_samples
    if not 1 <= n <= cfg.max_samples:
        raise UserError(f"num_samples={n}: send 1 to {cfg.max_samples}")
    params = sampling_params(req.sampling_params or {})
    if params.max_tokens > cfg.max_tokens:
        raise UserError(f"max_tokens={params.max_tokens} is over this service's limit of {cfg.max_tokens}")
    _check_ids(prompt, limits.vocab, "the prompt")
    _check_ids(list(params.stop_token_ids), limits.vocab, "sampling_params.stop")
    if len(prompt) + params.max_tokens > limits.context:
        raise UserError(f"asample: a prompt of {len(prompt)} tokens plus max_tokens={params.max_tokens} is over the "
                        f"model's context of {limits.context} tokens; shorten the prompt or lower max_tokens")
    scoring, targets = parse_scoring(req, len(prompt), limits.vocab, cfg.max_topk)
    last_n = req.prompt_logprobs_last_n
    if last_n is not None and not 1 <= last_n <= len(prompt) - 1:
        raise UserError(f"prompt_logprobs_last_n={last_n}: send 1 to len(prompt) - 1 = {len(prompt) - 1}")
    return cls(f"sample:{key}", adapter, prompt, params, n, scoring, last_n, images=tuple(images), targets=targets)


def _check_ids(ids: list[int], vocab: int, what: str) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise UserError(f"asample: {what} holds token id {bad}, outside the model's vocabulary [0, {vocab})")


def _chunk_tokens(chunk: dict[str, Any]) -> list[int]:
    if (not isinstance(chunk, dict) or chunk.get("type", "encoded_text") != "encoded_text"
            or not isinstance(chunk.get("tokens"), list)):
        raise UserError("asample: a prompt chunk is neither tokens nor an image; this service samples from token "
                        "and image chunks")
    if any(isinstance(t, bool) or not isinstance(t, int) for t in chunk["tokens"]):
        raise UserError("asample: a prompt chunk's tokens must be integers (token ids)")
    return chunk["tokens"]


def last_n(logprobs: Optional[list[Optional[float]]], n: Optional[int]) -> Optional[list[Optional[float]]]:
    """Prompt logprobs with all but the last ``n`` blanked (None), as ``prompt_logprobs_last_n`` asks."""
    if logprobs is None or n is None:
        return logprobs
    cut = len(logprobs) - n
    return [None if i < cut or (v is not None and math.isnan(v)) else v for i, v in enumerate(logprobs)]
