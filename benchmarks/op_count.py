"""Counting the operators that compute: what a small pass costs on a launch-bound GPU, counted on any device.

On a GPU a one-datum pass over a 0.5B model is bound by kernel launches, not by its tokens (session 31's
profile of a Tinker step: ~5,800 launches, most of the step's time). :class:`ComputeOps` counts the ATen
operators that reach a kernel (views, scalar reads and tensors made from host values left out) inside its
``with`` block, on the CPU as on a GPU, so a change that adds or removes launches shows here first.

Runs in whichever process measures (``tinker_shared_passes.py --parts kernels``, tests/tinker/test_mixed_passes.py)."""

from __future__ import annotations

from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

FREE = frozenset({"view", "select", "transpose", "t", "slice", "expand", "unsqueeze", "detach", "as_strided", "alias",
                  "_unsafe_view", "squeeze", "permute", "unbind", "split", "split_with_sizes", "reshape", "lift_fresh",
                  "_local_scalar_dense", "is_same_size"})


class ComputeOps(TorchDispatchMode):
    """``with ComputeOps() as ops: ...``; then ``ops.count`` (and ``ops.by_op``: name -> count)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.by_op: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        name = str(func).split(".")[1] if str(func).startswith("aten.") else str(func)
        if name not in FREE:
            self.count += 1
            self.by_op[name] = self.by_op.get(name, 0) + 1
        return func(*args, **(kwargs or {}))
