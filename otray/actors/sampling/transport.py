"""How new weights travel from a learner to its rollout workers (``rollout.weight_sync``).

- ``object_store``: the learner returns its tensors in a :class:`~otray.types.WeightUpdate`; Ray pickles
  them into the object store and every worker reads a copy (works across nodes).
- ``shm``: the learner writes every tensor once into one file in shared memory (``/dev/shm``) and sends
  only a :class:`~otray.types.SharedTensors` handle (names, dtypes, shapes, offsets); each worker on the
  same node maps the file and copies straight from it into its model. No pickling, no object-store
  copy; the file is replaced by the next version's (the learner keeps the latest two).
- ``cuda_ipc`` and ``broadcast``: device to device (``device_transport.py``).
- ``auto``: ``cuda_ipc`` when the learner and every rollout worker run on one node and the learner's
  GPU is every worker's; else ``shm`` on one node; else ``object_store``. (``broadcast`` is chosen by
  name: for workers on other nodes or GPUs.)

Learner side: :class:`Publisher` (every transport; a full update in the workers' dtype, each with its
checksum); worker side: :class:`Receiver`. ``tests/actors/sampling/test_transport.py`` checks that
``shm`` and ``broadcast`` deliver the object store's tensors bit for bit; ``benchmarks/weight_sync.py``
times them between two Ray actors.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from otray.placement import current_node_id
from otray.types import ConfigError, DeviceTensors, SharedTensors, WeightUpdate

# device_transport (torch) is imported inside Publisher and Receiver, by the learner and worker that use them,
# not by every process that only holds a worker's handle (a game's coordinator)

TRANSPORTS = ("auto", "object_store", "shm", "cuda_ipc", "broadcast")
ALIGN = 64  # every tensor starts on a 64-byte boundary of the shared file
SHM_DIR = Path(os.environ.get("OTRAY_SHM_DIR", "/dev/shm"))


def choose(setting: str, learner_node: str | None, worker_nodes: list[str | None], learner_device: str = "cpu",
           worker_devices: list[str] | None = None) -> str:
    """The transport a policy uses: ``setting`` unless ``auto`` (see the module docstring). Devices are
    ``device_transport.device_id``'s (``cpu`` or ``cuda:<uuid>``)."""
    if setting not in TRANSPORTS:
        raise ConfigError(f"rollout.weight_sync={setting!r}: choose one of {', '.join(TRANSPORTS)}")
    if setting != "auto":
        return setting
    same = learner_node is not None and bool(worker_nodes) and all(n == learner_node for n in worker_nodes)
    if same and learner_device.startswith("cuda") and all(d == learner_device for d in worker_devices or ["cpu"]):
        return "cuda_ipc"
    return "shm" if same and shm_free_bytes() > MIN_FREE else "object_store"


MIN_FREE = 1 << 30  # auto picks shm only with at least this much shared memory free (a container's may be 64 MiB)


def shm_free_bytes() -> int:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def to_shared(tensors: dict[str, Any], tag: str) -> SharedTensors:
    """Write ``tensors`` (on any device) into one shared-memory file named by ``tag``; its handle."""
    import torch

    layout, offset = [], 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        layout.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset, nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    path = SHM_DIR / f"otray-weights-{tag}.bin"
    tmp = path.with_suffix(".partial")
    with open(tmp, "wb") as f:
        f.truncate(max(offset, 1))
    buf = torch.from_file(str(tmp), shared=True, size=max(offset, 1), dtype=torch.uint8)
    for (name, _, _, start, nbytes), t in zip(layout, tensors.values()):
        if nbytes:
            buf[start:start + nbytes].view(t.dtype).view(t.shape).copy_(t.detach())
    del buf
    os.replace(tmp, path)  # a reader never sees a half-written file
    return SharedTensors(str(path), current_node_id(), tuple(layout), offset)


def from_shared(ref: SharedTensors) -> dict[str, Any]:
    """The tensors of a :func:`to_shared` file, as views of its mapping (copy them before it is replaced)."""
    import torch

    if ref.node_id is not None and current_node_id() is not None and ref.node_id != current_node_id():
        raise ConfigError(f"weights in shared memory on node {ref.node_id} reached a worker on node "
                          f"{current_node_id()}: shared memory works on one node; set rollout.weight_sync: "
                          "object_store (or auto)")
    if not Path(ref.path).exists():
        raise FileNotFoundError(f"the shared weights file {ref.path} is gone (the learner replaced it, or died)")
    buf = torch.from_file(ref.path, shared=False, size=max(ref.size, 1), dtype=torch.uint8)
    out = {}
    for name, dtype, shape, start, nbytes in ref.layout:
        out[name] = buf[start:start + nbytes].view(getattr(torch, dtype)).view(shape)
    return out


def sweep_dead_files() -> int:
    """Remove the shared weight files of learners no longer running on this node (their files are named by
    their process id: a learner killed, or ended without closing its :class:`SharedFiles`, left them in
    shared memory, which is RAM); returns how many. Run when a learner starts its files."""
    removed = 0
    for path in SHM_DIR.glob("otray-weights-*-v*"):
        pid = path.name.removeprefix("otray-weights-").split("-v", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # alive (or another user's process, the same pid: kept)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        path.unlink(missing_ok=True)
        removed += 1
    return removed


class SharedFiles:
    """The learner's side: the shared files it wrote, the latest ``keep`` kept, the rest removed; those of
    learners that died on this node are swept when one starts, and its own go when its process exits."""

    def __init__(self, keep: int = 2):
        import atexit

        self.keep, self.paths = keep, []
        sweep_dead_files()
        atexit.register(self.close)

    def publish(self, tensors: dict[str, Any], tag: str) -> SharedTensors:
        """Write ``tensors`` under ``tag`` (a tag sent again, the same version resent, replaces its file
        atomically: a reader of the old one keeps what it mapped); remove files past the latest ``keep``."""
        ref = to_shared(tensors, tag)
        self.paths = [p for p in self.paths if p != ref.path] + [ref.path]
        while len(self.paths) > self.keep:
            Path(self.paths.pop(0)).unlink(missing_ok=True)
        return ref

    def close(self) -> None:
        for p in self.paths:
            Path(p).unlink(missing_ok=True)
        self.paths.clear()

    def __del__(self) -> None:
        self.close()


class Publisher:
    """The learner's side of every transport: shared-memory files and the device buffer."""

    def __init__(self, device: str = "cpu"):
        from otray.actors.sampling.device_transport import DevicePublisher

        self.shared = SharedFiles()
        self.device = DevicePublisher(device)

    def update(self, state: dict[str, Any], version: int, kind: str, lora: dict[str, Any] | None,
               transport: str, dtype: str | None = None) -> WeightUpdate:
        """A learner's ``state`` as a :class:`~otray.types.WeightUpdate` over ``transport``, with its checksum:
        CPU copies for the object store, one shared-memory file, or the device buffer. A full update's
        floating tensors go in ``dtype`` (the workers'; None: as they are); a LoRA adapter keeps its own
        (PEFT keeps adapters in float32 over a bf16 base, and they are small). Shared memory that is full
        sends this update through the object store instead (and says so)."""
        import torch

        from otray.actors.sampling.device_transport import checksum

        target = getattr(torch, dtype) if dtype and kind == "full" else None
        tensors = {k: v.detach().to(target) if target is not None and v.is_floating_point() else v.detach()
                   for k, v in state.items()}
        sums = checksum(tensors)
        if transport in ("cuda_ipc", "broadcast"):
            return WeightUpdate(version, kind, self.device.publish(tensors, transport), lora, sums)
        if transport == "shm":
            try:
                return WeightUpdate(version, kind, self.shared.publish(tensors, f"{os.getpid()}-v{version}"), lora, sums)
            except OSError as e:
                print(f"weight_sync shm failed ({e}); sending version {version} through the object store", flush=True)
        return WeightUpdate(version, kind, {k: v.to("cpu", copy=True) for k, v in tensors.items()}, lora, sums)

    def close(self) -> None:
        self.shared.close()


class Receiver:
    """A worker's side of every transport: an update's tensors, wherever they travelled."""

    def __init__(self, device: str = "cpu"):
        from otray.actors.sampling.device_transport import DeviceReceiver

        self.device = DeviceReceiver(device)

    def tensors(self, update: WeightUpdate) -> dict[str, Any]:
        if isinstance(update.tensors, SharedTensors):
            return from_shared(update.tensors)
        if isinstance(update.tensors, DeviceTensors):
            return self.device.tensors(update.tensors)
        return update.tensors
