"""Weights from learner to rollout workers without a host round trip (``rollout.weight_sync``), and the
checksum that proves an update was loaded.

Runs on both ends: :class:`DevicePublisher` in the learner actor, :class:`DeviceReceiver` in each
rollout worker actor. Every update is first written, in the dtype the workers sample in, into one flat
buffer on the learner's device that lives as long as the learner (:class:`FlatWeights`); then:

- ``cuda_ipc`` (learner and workers on one node, the learner on a GPU): the buffer's CUDA IPC handle is
  exported once; each update is a few hundred bytes (the layout), and a worker copies straight from the
  learner's buffer into its own weights on the device (no host copy, no serialisation).
- ``broadcast``: a ``torch.distributed`` group of the learner (rank 0) and its workers (NCCL on GPUs,
  gloo on CPUs; its own process group object, never the default one), made once by
  ``open_broadcast`` / ``join_broadcast``; each update is one broadcast of the buffer, for workers on
  other nodes or GPUs. (NCCL refuses two ranks on one GPU: a worker sharing the learner's card takes
  ``cuda_ipc``.)

Every update (over any transport, ``transport.py``'s too) carries a :class:`~otray.types.WeightChecksum`
of a few of its tensors as the learner sent them; the worker sums the same tensors as they arrived
(:func:`verify`) and as its sampler holds them after loading, in the sampler's dtype (:func:`verify_held`),
and refuses a mismatch; the fleet refuses a worker that reports another version: a sync that did not
apply fails the step instead of sampling stale weights.
"""

from __future__ import annotations

import pickle
import socket
from datetime import timedelta

import torch

from otray.placement import current_node_id
from otray.types import ConfigError, DeviceTensors, WeightChecksum, WeightSyncError

ALIGN = 256  # bytes: every tensor of the flat buffer starts on this boundary
SAMPLE = 1 << 16  # elements of each checked tensor that the checksum reads (strided over the whole tensor)
Layout = tuple[tuple[str, str, tuple[int, ...], int, int], ...]


# ---------------------------------------------------------------- checksums


def checked_names(names: list[str]) -> tuple[str, ...]:
    """The tensors a checksum reads: the first, the middle and the last (by name order)."""
    ordered = sorted(names)
    return tuple(dict.fromkeys([ordered[0], ordered[len(ordered) // 2], ordered[-1]])) if ordered else ()


def tensor_sum(t: torch.Tensor) -> float:
    """A position-weighted float64 sum of up to ``SAMPLE`` elements of ``t`` spread over all of it."""
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return 0.0
    step = max(1, flat.numel() // SAMPLE)
    picked = flat[::step].double()
    weights = torch.arange(picked.numel(), device=picked.device, dtype=torch.float64).remainder_(13).add_(1)
    return float((picked * weights).sum())


def checksum(tensors: dict[str, torch.Tensor]) -> WeightChecksum:
    names = checked_names(list(tensors))
    return WeightChecksum(names, tuple(tensor_sum(tensors[n]) for n in names))


def verify(expected: WeightChecksum | None, received: dict[str, torch.Tensor], who: str, version: int) -> None:
    """Raise :class:`WeightSyncError` naming ``who`` unless ``received`` (the update's tensors as they
    arrived) sums to ``expected`` (what the learner sent for ``version``)."""
    if expected is None:
        return
    missing = [n for n in expected.names if n not in received]
    if missing:
        raise WeightSyncError(f"{who} did not receive version {version} whole: it has no tensor {missing[0]!r}")
    for name, want in zip(expected.names, expected.sums):
        _same(tensor_sum(received[name]), want, name, who, version, "the update was corrupted on its way")


def verify_held(received: dict[str, torch.Tensor], held: dict[str, torch.Tensor], who: str, version: int) -> None:
    """Raise :class:`WeightSyncError` unless the sampler's tensors ``held`` now are ``received``, each as
    the sampler stores it (an update sent in float32 to a bf16 sampler is held rounded to bf16)."""
    for name, t in received.items():
        if name not in held:
            raise WeightSyncError(f"{who} did not load version {version}: it holds no tensor {name!r}")
        _same(tensor_sum(held[name]), tensor_sum(t.to(held[name].dtype)), name, who, version,
              "the update was not applied")


def _same(got: float, want: float, name: str, who: str, version: int, why: str) -> None:
    if abs(got - want) > 1e-6 * max(1.0, abs(want)):
        raise WeightSyncError(f"{who} loaded version {version} but its {name!r} differs from the learner's "
                              f"(checksum {got!r} != {want!r}): {why}")


# ---------------------------------------------------------------- the flat buffer


def layout_of(tensors: dict[str, torch.Tensor]) -> tuple[Layout, int]:
    out, offset = [], 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        out.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset, nbytes))
        offset += -(-nbytes // ALIGN) * ALIGN
    return tuple(out), max(offset, 1)


def views(buffer: torch.Tensor, layout: Layout) -> dict[str, torch.Tensor]:
    """Each tensor of ``layout`` as a view of the flat uint8 ``buffer``."""
    return {name: buffer[start:start + nbytes].view(getattr(torch, dtype)).view(shape)
            for name, dtype, shape, start, nbytes in layout}


class FlatWeights:
    """The learner's flat buffer: allocated at the first update (again only if the layout changes,
    which bumps ``generation``), then written in place."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        self.layout: Layout = ()
        self.size = 0
        self.generation = 0

    @torch.no_grad()
    def write(self, tensors: dict[str, torch.Tensor], device: str) -> None:
        layout, size = layout_of(tensors)
        if layout != self.layout or self.buffer is None:
            self.buffer = torch.zeros(size, dtype=torch.uint8, device=device)
            self.layout, self.size = layout, size
            self.generation += 1
        for (name, t), view in zip(tensors.items(), views(self.buffer, self.layout).values()):
            view.copy_(t.detach())


def device_id(device: str) -> str:
    """``cpu`` or ``cuda:<uuid>``: the same card has the same id in every process of its node (device
    indices differ between processes that were shown different GPUs)."""
    if not device.startswith("cuda"):
        return "cpu"
    index = torch.device(device).index or 0
    return f"cuda:{torch.cuda.get_device_properties(index).uuid}"


# ---------------------------------------------------------------- the broadcast group


def free_address() -> str:
    import ray

    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
    return f"{host}:{port}"


class BroadcastGroup:
    """A process group of its own (not ``torch.distributed``'s default one, which a sharded learner may
    hold): rank 0 is the learner. Every member constructs it at once (the constructor meets the others)."""

    def __init__(self, address: str, rank: int, world: int, device: str, timeout_s: float = 120.0):
        import torch.distributed as dist

        host, port = address.rsplit(":", 1)
        timeout = timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(host, int(port), world, is_master=rank == 0, timeout=timeout,
                                   wait_for_workers=False)
        if device.startswith("cuda"):
            self.group = dist.ProcessGroupNCCL(self.store, rank, world, dist.ProcessGroupNCCL.Options())
        else:
            self.group = dist.ProcessGroupGloo(self.store, rank, world, timeout)
        self.rank, self.world = rank, world

    def broadcast(self, tensor: torch.Tensor) -> None:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.group.broadcast([tensor], opts).wait()


# ---------------------------------------------------------------- learner side


class DevicePublisher:
    """The learner's half: the flat buffer, its IPC handle and the broadcast group."""

    def __init__(self, device: str):
        self.device = device
        self.flat = FlatWeights()
        self.handle: tuple[int, bytes] | None = None  # (generation, pickled IPC handle) of the buffer
        self.group: BroadcastGroup | None = None

    def publish(self, tensors: dict[str, torch.Tensor], transport: str) -> DeviceTensors:
        if transport == "cuda_ipc" and not self.device.startswith("cuda"):
            raise ConfigError("rollout.weight_sync=cuda_ipc needs the learner on a GPU (this one runs on the CPU): "
                              "set rollout.weight_sync to shm or auto")
        if transport == "broadcast" and self.group is None:
            raise ConfigError("rollout.weight_sync=broadcast: the learner has not joined a broadcast group "
                              "(PolicyRuntime opens one when the job starts)")
        self.flat.write(tensors, self.device)
        handle = None
        if transport == "cuda_ipc":
            if self.handle is None or self.handle[0] != self.flat.generation:
                from torch.multiprocessing.reductions import reduce_tensor

                self.handle = (self.flat.generation, pickle.dumps(reduce_tensor(self.flat.buffer)))
            handle = self.handle[1]
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()  # the buffer is whole before any worker reads it
        return DeviceTensors(transport, self.flat.layout, self.flat.size, current_node_id(), device_id(self.device),
                             self.flat.generation, handle)

    def open_broadcast(self) -> str:
        return free_address()

    def join_broadcast(self, address: str, world: int) -> int:
        self.group = BroadcastGroup(address, 0, world, self.device)
        return 0

    def send(self) -> None:
        """Broadcast the buffer written by the last ``publish`` (the workers receive it meanwhile)."""
        if self.group is None or self.flat.buffer is None:
            raise RuntimeError("send_weights before a broadcast update was published")
        self.group.broadcast(self.flat.buffer)


# ---------------------------------------------------------------- worker side


class DeviceReceiver:
    """A worker's half: its end of the broadcast group, its receive buffer, the learner's buffer opened
    by IPC handle (kept while its generation lasts)."""

    def __init__(self, device: str):
        self.device = device
        self.group: BroadcastGroup | None = None
        self.buffer: torch.Tensor | None = None
        self.opened: tuple[int, torch.Tensor] | None = None

    def join_broadcast(self, address: str, rank: int, world: int) -> int:
        self.group = BroadcastGroup(address, rank, world, self.device)
        return rank

    def tensors(self, ref: DeviceTensors) -> dict[str, torch.Tensor]:
        """Views of the update's tensors, valid until the next update (the loader copies them)."""
        if ref.transport == "broadcast":
            if self.group is None:
                raise WeightSyncError("a broadcast weight update reached a worker outside the broadcast group")
            if self.buffer is None or self.buffer.numel() != ref.size:
                self.buffer = torch.empty(ref.size, dtype=torch.uint8, device=self.device)
            self.group.broadcast(self.buffer)
            return views(self.buffer, ref.layout)
        if ref.transport != "cuda_ipc":
            raise ValueError(f"unknown device transport {ref.transport!r}")
        if ref.node_id is not None and current_node_id() is not None and ref.node_id != current_node_id():
            raise ConfigError(f"a CUDA IPC weight handle from node {ref.node_id} reached a worker on node "
                              f"{current_node_id()}: cuda_ipc works on one node; set rollout.weight_sync to "
                              "broadcast or auto")
        if self.opened is None or self.opened[0] != ref.generation:
            rebuild, args = pickle.loads(ref.handle)
            args = list(args)
            args[6] = self._local_index(ref.device)  # the storage's device, as this process numbers it
            self.opened = (ref.generation, rebuild(*args))
        return views(self.opened[1], ref.layout)

    def _local_index(self, device: str) -> int:
        for i in range(torch.cuda.device_count()):
            if device_id(f"cuda:{i}") == device:
                return i
        raise ConfigError(f"the learner's weights are on GPU {device}, which this worker does not see: "
                          "cuda_ipc needs the learner's card visible to the worker; set rollout.weight_sync "
                          "to broadcast or auto")
