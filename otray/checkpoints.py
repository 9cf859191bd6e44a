"""Checkpoint directories as blobs, and the checkpoints a config names.

A job writes a checkpoint directory on its own node (``<job dir>/checkpoints/step-N``:
learner state + exported model). The job driver packs it into one ``bytes`` blob (an
uncompressed tar, :func:`pack_dir`) and hands it to the ResourceManager, whose
:class:`~otray.actors.control.checkpoint_store.CheckpointStore` keeps it; whoever needs it later (a
resumed job on another node, the Serve app, a user's download) gets the blob through Ray and
:func:`unpack_dir`s it. A registered checkpoint is named ``JOB_ID:STEP`` (or ``JOB_ID`` for the
job's latest): :func:`registered_refs` finds those a config names, :func:`pin_refs` pins them.
The blob passes through the object store in one piece, so this suits checkpoints up to a few GiB.
"""

from __future__ import annotations

import io
import shutil
import tarfile
from pathlib import Path
from typing import Any

from otray.names import parse_ref
from otray.types import ModelLoadError

def registered_refs(cfg: Any) -> list[str]:
    """The ``JOB_ID[:STEP]`` checkpoints a config names: ``checkpoint.resume_from``, ``frozen:`` policies
    and an inference job's ``infer.checkpoint``."""
    from otray.config import frozen_policies

    refs = [cfg.checkpoint.resume_from or ""] + [spec.arg for spec in frozen_policies(cfg)]
    if cfg.job.kind == "infer":
        refs.append(cfg.infer.checkpoint or "")
    return list(dict.fromkeys(r for r in refs if r and parse_ref(r) is not None))


def pin_refs(cfg: Any, pinned: dict[str, str]) -> None:
    """Rewrite the config's checkpoint refs (``JOB_ID`` -> ``JOB_ID:STEP``) in place."""
    if cfg.checkpoint.resume_from in pinned:
        cfg.checkpoint.resume_from = pinned[cfg.checkpoint.resume_from]
    if cfg.infer.checkpoint in pinned:
        cfg.infer.checkpoint = pinned[cfg.infer.checkpoint]
    if cfg.game is not None:
        from otray.policies import PolicySpec

        def pin(text: str) -> str:
            spec = PolicySpec.parse(text)
            return f"frozen:{pinned[spec.arg]}" if spec.kind == "frozen" and spec.arg in pinned else text

        cfg.game.policies = {a: pin(p) for a, p in cfg.game.policies.items()}
        cfg.game.eval_opponents = [pin(p) for p in cfg.game.eval_opponents]


def fetched_dir(job_dir: str | Path, ref: str) -> Path:
    """Where a job keeps a registered checkpoint it fetched: ``<job dir>/fetched/<JOB_ID>-step-N``."""
    src, step = parse_ref(ref)
    return Path(job_dir) / "fetched" / f"{src}-step-{step:06d}"


def frozen_model_dir(ref: str, job_dir: str | Path) -> str:
    """The model directory of a ``frozen:REF`` policy: a fetched registered checkpoint, a checkpoint
    directory (its ``model/``), or a model directory (has ``config.json``)."""
    if parse_ref(ref) is not None:
        if parse_ref(ref)[1] is None or not fetched_dir(job_dir, ref).exists():
            raise ModelLoadError(f"frozen:{ref} names a registered checkpoint, which only a job submitted to the "
                                 "ResourceManager (otray train, client.submit) can fetch; give a directory instead")
        ref = str(fetched_dir(job_dir, ref))
    path = Path(ref)
    for candidate in (path / "model", path):
        if (candidate / "adapter_config.json").exists():
            raise ModelLoadError(f"frozen:{ref} is a LoRA adapter; frozen policies need full weights for now "
                                 "(train the opponent with model.lora.rank=0, or serve the adapter with otray serve)")
        if (candidate / "config.json").exists():
            return str(candidate)
    raise ModelLoadError(f"frozen:{ref}: no model there (looked for {path}/model/config.json and "
                         f"{path}/config.json); give a checkpoint directory like <job dir>/checkpoints/step-000010")


def pack_dir(path: str | Path) -> bytes:
    """A directory tree as one uncompressed tar blob (names relative to ``path``)."""
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"checkpoint directory {str(path)!r} does not exist")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for item in sorted(path.rglob("*")):
            tar.add(item, arcname=str(item.relative_to(path)), recursive=False)
    return buf.getvalue()


def unpack_dir(blob: bytes, dest: str | Path) -> Path:
    """Write a :func:`pack_dir` blob into ``dest`` (replaced if it exists); refuses paths outside it."""
    dest = Path(dest)
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r") as tar:
        tar.extractall(tmp, filter="data")  # "data" rejects absolute paths, .. and links outside
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest
