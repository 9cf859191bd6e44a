"""Where a model lives and in what precision: ``model.device`` and ``model.dtype``, resolved inside the
actor that holds the model (Ray makes an actor's GPUs visible to it only when it asked for them:
``resources.learner_gpus`` / ``rollout_gpus``, so the answer differs per actor).

- ``device``: ``auto`` = the first GPU this process sees, else the CPU; ``cpu``; ``cuda`` (an
  error naming the key when the process sees no GPU).
- ``dtype``: ``auto`` = bfloat16 on a GPU, float32 on the CPU; or ``float32`` / ``bfloat16`` / ``float16``.
- The heap (:func:`settle_heap`): once a model's actor has loaded, what is alive then is kept out of
  Python's full garbage collections, so one does not stall a step.
- RNG states (:func:`rng_state`, :func:`set_rng_state`): a process's random generators, which a checkpoint
  keeps for the learner and each rollout worker, so a resumed job samples what the uninterrupted one did.
"""

from __future__ import annotations

from typing import Any

from otray.types import ConfigError

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")


def resolve_device(setting: str = "auto", where: str = "model.device") -> str:
    """``cpu`` or ``cuda`` for this process (see the module docstring)."""
    import torch

    if setting not in DEVICES:
        raise ConfigError(f"{where}={setting!r}: choose one of {', '.join(DEVICES)}")
    has_gpu = torch.cuda.is_available() and torch.cuda.device_count() > 0
    if setting == "cuda" and not has_gpu:
        raise ConfigError(f"{where}=cuda but this process sees no GPU: give the actor one (resources.learner_gpus / "
                          "resources.rollout_gpus > 0; Ray shows an actor only the GPUs it asked for) or set "
                          f"{where}=auto")
    return "cuda" if setting == "cuda" or (setting == "auto" and has_gpu) else "cpu"


def resolve_dtype(setting: str, device: str, where: str = "model.dtype") -> str:
    """The torch dtype name for ``setting`` on ``device``."""
    if setting not in DTYPES:
        raise ConfigError(f"{where}={setting!r}: choose one of {', '.join(DTYPES)}")
    if setting == "auto":
        return "bfloat16" if device == "cuda" else "float32"
    return setting


def rng_state() -> dict[str, Any]:
    """This process's RNG states: torch's CPU generator, Python's, and every visible GPU's."""
    import random

    import torch

    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """This process's RNG states as :func:`rng_state` gave them (GPU states only onto as many GPUs)."""
    import random

    import torch

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def settle_heap() -> None:
    """Collect once, then move every object alive now (the imported libraries, the loaded model) into the
    garbage collector's permanent generation (``gc.freeze``): a full collection then scans only what was made
    since. Called by a model's actor when it has loaded. Without it a full collection in a Tinker learner
    scanned ~470k objects and held one user's slice 0.23 s (her custom loss's budget was spent waiting)."""
    import atexit
    import gc

    gc.collect()
    if not gc.get_freeze_count():  # at exit the heap is collectable again: extensions that count their
        atexit.register(gc.unfreeze)  # objects' release (nanobind) would call the frozen ones leaked
    gc.freeze()
