"""Checkpoints that reach any node through Ray, not through a shared path.

A job writes a checkpoint directory on its own node (``<job dir>/checkpoints/step-N``:
learner state + exported model). The job driver then packs it into one ``bytes``
blob (an uncompressed tar) and hands it to the ResourceManager, which unpacks it
into its :class:`CheckpointStore` and registers the stored copy. Whoever needs the
checkpoint later (a resumed job on another node, the Serve app) asks the
ResourceManager for the blob, which travels through Ray's object store.

A checkpoint is named by ``JOB_ID:STEP`` (or ``JOB_ID`` for the job's latest).
The blob passes through the object store in one piece, so this suits checkpoints
up to a few GiB; bigger models want an external store (noted in NOTES.md).
"""

from __future__ import annotations

import io
import re
import shutil
import tarfile
from pathlib import Path

from otray.types import ModelLoadError

_JOB_REF = re.compile(r"(?P<job>\d{8}-\d{6}-[0-9a-f]{6})(?::(?P<step>\d+))?")


def parse_ref(ref: str) -> tuple[str, int | None] | None:
    """``JOB_ID[:STEP]`` -> (job id, step or None); anything else (a path) -> None."""
    m = _JOB_REF.fullmatch(ref.strip())
    if m is None:
        return None
    return m["job"], int(m["step"]) if m["step"] is not None else None


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


class CheckpointStore:
    """Checkpoint copies under ``root/<job id>/step-NNNNNN`` on the ResourceManager's node."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def put(self, job_id: str, step: int, blob: bytes) -> str:
        return str(unpack_dir(blob, self.root / job_id / f"step-{step:06d}"))

    def get(self, path: str) -> bytes:
        if not Path(path).is_dir():
            raise ModelLoadError(f"the stored checkpoint {path!r} is gone from the ResourceManager's node; "
                                 "it was registered but its files were removed")
        return pack_dir(path)
