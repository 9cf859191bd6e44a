"""The ResourceManager's store of checkpoints: packed blobs (``otray.checkpoints``) unpacked under
``<registry dir>/checkpoints/<job id>/step-N`` on its node, so that no node needs another node's disk.
Bigger models than a few GiB want an external store (S3, a shared file system) behind the same interface.
"""

from __future__ import annotations

from pathlib import Path

from otray.checkpoints import pack_dir, unpack_dir
from otray.types import ModelLoadError


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
