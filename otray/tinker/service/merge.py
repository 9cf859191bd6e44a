"""Server-side LoRA merge: a checkpoint's adapter folded into its base model, as a checkpoint of its own.

Tinker has no SDK call for this (its cookbook downloads the adapter and merges on the user's machine:
``tinker_cookbook.weights.build_hf_model``, which works here too). otray does it where the base model
already is: ``POST /api/v1/merge_weights`` with ``{"path": "tinker://<run>/weights/<name>" (or
sampler_weights), "name": ..., "ttl_seconds": null}`` answers a request id; its promise
(``retrieve_future``) gives ``tinker://<run>/external_weights/<name>``: an external-weights checkpoint (the
SDK's word for files to download; its path parser knows no other segment, so a merged model is one) that
holds a full Hugging Face model directory (config, tokenizer, safetensors, ``otray_merged.json``) instead
of an adapter. ``RestClient.get_external_weights_urls`` hands its files out as signed URLs; delete, TTL
and publish work on it as on any checkpoint; ``transformers`` and ``otray serve`` load the download as
they load any local model.
:func:`request_merge` makes the call and waits for it (stdlib HTTP, the SDK's API key).

The merge is plain tensor arithmetic over the base's safetensors files, one shard at a time (the base
is never built as a model, so it runs beside the learner on CPU, whatever device trains):
``W' = W + scale * B @ A`` per LoRA-targeted linear layer, ``scale = lora_alpha / r`` (``/ sqrt(r)`` for
rsLoRA), in float32, written back in the base's dtype. A LoRA on ``lm_head`` of a model that ties it to
the input embedding (the tiny model does; the cookbook's merge refuses that case) gives the merged model an
``lm_head.weight`` of its own and ``tie_word_embeddings: false``, so the embedding stays the base's.
Anything the arithmetic cannot honour (DoRA, per-module rank or alpha patterns, embedding LoRAs, a
targeted layer the base does not have, a base without safetensors) is refused by name before a file is
written; the output appears under its final name only when complete.

Runs in the TinkerService actor."""

from __future__ import annotations

import asyncio
import json
import math
import re
import shutil
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:  # torch is imported by safetensors.torch when a merge runs, not with the service
    import torch

from otray.tinker.service.catalog import Catalog
from otray.tinker.service.futures import Futures, Outcome, settle
from otray.tinker.service.runs import check_name
from otray.tinker.service.storage import PARTIAL, StorageLedger
from otray.tinker.service.store import Checkpoint, Store, files_usage
from otray.tinker.errors import UserError
from otray.tinker.wire.requests import MergeWeights

ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")
_LORA_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<part>[AB])(?:\.[^.]+)?\.weight$")
INDEX = "model.safetensors.index.json"


def lora_deltas(adapter_dir: Path) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], float]:
    """``{module: (A, B)}`` of a PEFT adapter directory and its scale; what the merge cannot honour is a UserError."""
    from safetensors.torch import load_file

    if not all((adapter_dir / f).is_file() for f in ADAPTER_FILES):
        raise UserError(f"the checkpoint has no PEFT adapter ({', '.join(ADAPTER_FILES)}): it cannot be merged")
    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    for key in ("use_dora", "rank_pattern", "alpha_pattern", "fan_in_fan_out"):
        if cfg.get(key):
            raise UserError(f"the adapter sets {key}; the merge folds plain LoRA on torch Linear layers only "
                            "(W + alpha/r * B @ A)")
    r, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in load_file(str(adapter_dir / "adapter_model.safetensors")).items():
        found = _LORA_KEY.match(key)
        if found is None:
            raise UserError(f"adapter tensor {key!r} is not a LoRA A/B weight of a linear layer (embedding LoRAs "
                            "and trained modules_to_save are not merged here)")
        parts.setdefault(found["module"], {})[found["part"]] = value
    broken = sorted(m for m, ab in parts.items() if set(ab) != {"A", "B"})
    if broken:
        raise UserError(f"adapter modules {broken} lack their lora_A or lora_B weight")
    return {m: (ab["A"], ab["B"]) for m, ab in parts.items()}, scale


def _shards(base_dir: Path) -> dict[str, list[str]]:
    """``{shard file: its tensor names}`` of a base model directory's safetensors."""
    from safetensors import safe_open

    files = sorted(p.name for p in base_dir.glob("*.safetensors"))
    if not files:
        raise UserError(f"the base model at {base_dir} has no safetensors weights; the merge reads safetensors only")
    out = {}
    for name in files:
        with safe_open(str(base_dir / name), framework="pt") as f:
            out[name] = list(f.keys())
    return out


def _tied(config: dict[str, Any]) -> bool:
    text = config.get("text_config") or {}
    return bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))


def merge_lora(base_dir: Path, adapter_dir: Path, out: Path) -> dict[str, Any]:
    """Write the base at ``base_dir`` with the adapter at ``adapter_dir`` folded in as a model directory
    ``out`` (made complete under a temporary name, then renamed). Returns what was merged."""
    from safetensors.torch import load_file, save_file

    deltas, scale = lora_deltas(adapter_dir)
    shards, config = _shards(base_dir), json.loads((base_dir / "config.json").read_text())
    where = {name: shard for shard, names in shards.items() for name in names}
    embed = next((n for n in where if n.endswith("embed_tokens.weight")), None)
    # a head tied to the embedding (whether or not the file also holds a copy of it) gets a weight of its own
    untie = [m for m in deltas if m.endswith("lm_head") and _tied(config) and (embed or f"{m}.weight" in where)]
    missing = sorted(m for m in deltas if f"{m}.weight" not in where and m not in untie)
    if missing:
        raise UserError(f"the base model has no weight for the adapter's modules {missing[:4]}: the checkpoint "
                        "was trained on another base")
    tmp = out.with_name(out.name + f"{PARTIAL}{time.time_ns()}")
    tmp.mkdir(parents=True)
    try:
        for shard, names in shards.items():
            tensors = load_file(str(base_dir / shard))
            for module, (a, b) in deltas.items():
                target = f"{module}.weight"
                source = target if target in where else embed
                if where.get(source) != shard:
                    continue
                w = tensors[source]
                tensors[target] = (w.float() + scale * (b.float() @ a.float())).to(w.dtype).contiguous()
                where[target] = shard
            save_file(tensors, str(tmp / shard), metadata={"format": "pt"})
        for path in base_dir.iterdir():  # tokenizer, generation config, chat template, ...
            if path.is_file() and path.suffix not in (".safetensors", ".bin", ".pt", ".pth") and path.name != INDEX:
                shutil.copy2(path, tmp / path.name)
        if untie:
            config["tie_word_embeddings"] = False
            if isinstance(config.get("text_config"), dict):
                config["text_config"]["tie_word_embeddings"] = False
            (tmp / "config.json").write_text(json.dumps(config, indent=2))
        if (base_dir / INDEX).is_file():
            index = json.loads((base_dir / INDEX).read_text())
            index["weight_map"] = dict(sorted(where.items()))
            (tmp / INDEX).write_text(json.dumps(index, indent=2))
        merged = {"modules": len(deltas), "scale": scale, "untied": sorted(untie)}
        (tmp / "otray_merged.json").write_text(json.dumps({**merged, "base": str(base_dir)}))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return merged


class Merges:
    """The service's side of ``merge_weights``: checks a request at once (the caller's own training or sampler
    checkpoint, a fresh name, a TTL in range, storage left), runs the merge in a thread (the service's event
    loop stays free) and keeps the result as an ``external`` checkpoint of the source's run. Its promise
    finishes with ``{"path": tinker://..., "type": "merge_weights"}`` or the error, by category."""

    def __init__(self, store: Store, catalog: Catalog, futures: Futures, paths: dict[str, str], storage: StorageLedger):
        self.store, self.catalog, self.futures, self.paths = store, catalog, futures, paths
        self.storage = storage  # a merge reserves its base model's size until its files are written
        self.tasks: set[asyncio.Task] = set()

    def start(self, owner: str, req: MergeWeights) -> dict[str, str]:
        name, ttl = req.name, req.ttl_seconds
        if not isinstance(req.path, str):
            raise UserError("merge_weights: send the path (tinker://<run>/weights/<name> or sampler_weights/<name>) "
                            "of a checkpoint of yours")
        check_name(name)
        src = self.catalog.checkpoint(owner, req.path, use=True)
        self.catalog.check_ttl(ttl)
        if self.store.checkpoint(src.model_id, "external", name) and not req.overwrite:
            raise UserError(f"external weights {name!r} exist for {src.model_id}; pick another name or pass "
                            "overwrite: true", 409)
        base = self.base_dir(self.store.run(src.model_id).base_model)
        out = self.store.checkpoint_dir(owner, src.model_id, "external", name)
        release = self.storage.reserve(owner, out, files_usage(base))  # the merged model is about the base's size
        request_id = f"{src.model_id}:merge:{uuid.uuid4().hex[:12]}"
        self.futures.new(request_id, owner, "merge_weights")
        task = asyncio.get_running_loop().create_task(self._run(owner, request_id, src, base, name, ttl))
        task.add_done_callback(lambda _: release())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return {"request_id": request_id}

    def base_dir(self, base_model: str) -> Path:
        """The local directory of a base model this service serves (a hub id is looked up in the local cache)."""
        if base_model not in self.paths:
            raise UserError(f"base model {base_model!r} is not served here any more: the merge needs its weights")
        where = Path(self.paths[base_model])
        if where.is_dir():
            return where
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(self.paths[base_model], local_files_only=True))
        except Exception:  # noqa: BLE001 - any failure means the files are not on this machine
            raise UserError(f"the weights of {base_model!r} are not on this service's disk; the merge needs them") \
                from None

    async def _run(self, owner: str, request_id: str, src: Checkpoint, base: Path, name: str,
                   ttl: Optional[float]) -> None:
        self.futures.timeline.running(request_id)
        out = self.store.checkpoint_dir(owner, src.model_id, "external", name)

        async def merged() -> Outcome:
            await asyncio.to_thread(merge_lora, base, Path(src.path), out)
            size = files_usage(out)
            ckpt = Checkpoint(src.model_id, "external", name, str(out), time.time(), size,
                              time.time() + ttl if ttl else None, {"merged_from": src.tinker_path})
            self.store.add_checkpoint(ckpt)
            return Outcome("json", {"path": ckpt.tinker_path, "type": "merge_weights"})

        self.futures.finish(request_id, await settle(merged))


def request_merge(base_url: str, api_key: str, path: str, name: str, *, ttl_seconds: Optional[float] = None,
                  timeout_s: float = 1800.0) -> str:
    """Ask ``otray tinker`` at ``base_url`` to merge the checkpoint at ``path`` into a model named ``name``
    and wait for it; returns the merged checkpoint's ``tinker://`` path. A refusal raises RuntimeError with
    the service's reason."""
    api = base_url.rstrip("/") + "/api/v1"

    def post(route: str, body: dict[str, Any]) -> dict[str, Any]:
        req = urllib.request.Request(f"{api}/{route}", json.dumps(body).encode(), method="POST",
                                     headers={"X-API-Key": api_key, "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"merge_weights: {e.code} {json.loads(e.read() or b'{}').get('detail', '')}") from None

    rid = post("merge_weights", {"path": path, "name": name, "ttl_seconds": ttl_seconds})["request_id"]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = post("retrieve_future", {"request_id": rid})
        if got.get("type") == "try_again":
            continue
        if "error" in got:
            raise RuntimeError(f"merge_weights: {got['error']}")
        return str(got["path"])
    raise TimeoutError(f"merge_weights: no answer for {rid} in {timeout_s:.0f} s; retrieve_future it later")
