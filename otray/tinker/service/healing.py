"""Live models that outlive their learner: what rebuilds each adapter on a new learner, exactly.

When a base model's :class:`~otray.tinker.learner.shared_learner.SharedLearner` dies, Ray starts it again
with no adapters. For every live model the service keeps a *restore point* (how its adapter began:
made from its spec, whose seed fixes its initial values, or loaded from a checkpoint, linked into the
service's own ``healing/`` directory so the owner deleting it changes nothing) and a *replay log*: the
training calls that changed it since (``forward_backward`` with a gradient, ``optim_step``), in the order
they ran. Healing makes each adapter again from its restore point and runs its log again, so adapter,
optimizer state, step count and any gradient not yet stepped are as they were (float rounding aside);
the request that was on the learner when it died then runs again. No step is lost, and each model's
lease gets a ``recovery`` row (``otray status`` lists it). A log is bounded
(``healing.replay_mb``): past it, the service saves the adapter with its optimizer into ``healing/`` as
the new restore point and empties the log. A model that cannot be rebuilt ends FAILED with the reason.

Runs in the TinkerService actor."""

from __future__ import annotations

import asyncio
import logging
import pickle
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional, Sequence, Union

import ray

from otray.tinker.errors import AdapterGone
from otray.tinker.learner.specs import AdamStep, AdapterSpec
from otray.tinker.learner.loss_graph import LossGraph
from otray.tinker.service.runs import cause
from otray.tinker.service.store import link_tree
from otray.types import Datum

log = logging.getLogger(__name__)
REBUILD_TRIES = 3  # a learner that dies again while its adapters are rebuilt is waited for and used again
UP_WAIT_S = 300.0  # how long a new learner may take to start (it loads the base model)


@dataclass(frozen=True)
class Made:
    """The adapter began as a new one of ``spec`` (its seed set, so its initial values come back)."""
    spec: AdapterSpec


@dataclass(frozen=True)
class Loaded:
    """The adapter began as, or was later loaded from, the checkpoint at ``path`` (the service's own link of
    it), with its optimizer state when ``optimizer``."""
    path: str
    optimizer: bool


@dataclass(frozen=True)
class Pass:
    """A forward_backward that added to the adapter's gradients."""
    datums: list[Datum]
    loss_fn: str
    loss_fn_config: Optional[dict[str, float]]
    graph: Optional[LossGraph]


@dataclass(frozen=True)
class Step:
    """An optim_step."""
    step: AdamStep


@dataclass
class Replay:
    """One live model's restore point and the calls since it."""
    owner: str
    base: str
    start: Union[Made, Loaded]
    calls: list[Union[Pass, Step, Loaded]] = field(default_factory=list)
    bytes: int = 0
    dirs: int = 0  # directories made for it under healing/ (restore points and loaded checkpoints' links)


def actor_died(e: BaseException) -> bool:
    """Whether a learner call failed because its actor died."""
    return isinstance(e, ray.exceptions.RayActorError)


def learner_lost(e: BaseException) -> bool:
    """Whether a learner call failed because the learner died, or restarted without the caller's adapter
    (a call sent after Ray started it again, before its adapters were rebuilt), not because of the request."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        if actor_died(e) or isinstance(e, AdapterGone):
            return True
        seen.add(id(e))
        inner = getattr(e, "cause", None)  # Ray's wrapper of an error raised in the actor
        e = inner if isinstance(inner, BaseException) else e.__cause__
    return False


async def until_up(actor: Any, wait_s: float = UP_WAIT_S) -> bool:
    """Wait until Ray has started ``actor`` again after a death (calls right after one still fail);
    False if it is not up within ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            await actor.ping.remote()
            return True
        except Exception as e:  # noqa: BLE001
            if not actor_died(e) or time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.5)


class Healing:
    """``learners``: each base model's SharedLearner handle (Ray restarts a dead one under the same handle);
    ``root``: the service's store root (restore points under ``root/healing``); ``replay_bytes``: the log
    bound per model (0: no healing, a dead learner's models end FAILED); ``recovered(model_id, why)``:
    records a model's recovery (its lease's row); ``failed(model_id, why)`` ends a model that is lost
    (FAILED); ``live(base)``: the models live on a base."""

    def __init__(self, learners: dict[str, Any], root: Path, replay_bytes: int,
                 recovered: Callable[[str, str], Awaitable[None]], failed: Callable[[str, str], Awaitable[None]],
                 live: Callable[[str], list[str]]):
        self.learners, self.dir, self.replay_bytes = learners, root / "healing", replay_bytes
        self.recovered, self.failed, self.live = recovered, failed, live
        self.replays: dict[str, Replay] = {}
        self.lost: dict[str, str] = {}  # model id -> why it is no longer kept healable
        self.deaths: dict[str, int] = dict.fromkeys(learners, 0)  # per base: learner deaths healed or being healed
        self.current: dict[str, asyncio.Future] = {}  # per base: the latest healing (failures by model id)
        self.healed = 0  # models rebuilt, since the service started

    @property
    def on(self) -> bool:
        return self.replay_bytes > 0

    # ------------------------------------------------------------------ what each live model did

    def made(self, model_id: str, owner: str, base: str, spec: AdapterSpec) -> None:
        if self.on:
            self.replays[model_id] = Replay(owner, base, Made(spec))

    def loaded(self, model_id: str, owner: str, base: str, path: str, optimizer: bool) -> None:
        """A new ``model_id`` made from checkpoint ``path`` (with its optimizer state when ``optimizer``)."""
        if self.on:
            dest = self._dir(model_id, 1)
            link_tree(path, dest)
            self.replays[model_id] = Replay(owner, base, Loaded(str(dest), optimizer), dirs=1)

    def loaded_into(self, model_id: str, path: str, optimizer: bool) -> None:
        """Live ``model_id`` loaded checkpoint ``path`` (``load_weights``): a call of its log, on a link."""
        replay = self.replays.get(model_id)
        if replay is not None:
            replay.dirs += 1
            dest = self._dir(model_id, replay.dirs)
            link_tree(path, dest)
            replay.calls.append(Loaded(str(dest), optimizer))

    @staticmethod
    def size(call: Union[Pass, Step]) -> int:
        """What ``call`` adds to a replay log's size (its pickled bytes)."""
        return len(pickle.dumps(call, protocol=pickle.HIGHEST_PROTOCOL))

    def ran(self, model_id: str, call: Union[Pass, Step], size: Optional[int] = None) -> bool:
        """A training call of ``model_id`` done (``size``: :meth:`size`, when known); True when its log is past the
        bound after an optim_step (the caller then saves a restore point with :meth:`snapshot`: only there, since
        a save keeps no gradient, and between a forward_backward and its step the adapter holds one)."""
        replay = self.replays.get(model_id)
        if replay is None:
            return False
        replay.calls.append(call)
        replay.bytes += self.size(call) if size is None else size
        if replay.bytes > 2 * self.replay_bytes and not isinstance(call, Step):  # no step to save a restore point at
            self.forget(model_id)
            self.lost[model_id] = (f"its training calls since its last optim_step passed twice healing_replay_mb "
                                   f"({self.replay_bytes / 2**20:g} MB) and were not kept")
        return isinstance(call, Step) and replay.bytes > self.replay_bytes

    def due(self, model_id: str, calls: Sequence[tuple[Union[Pass, Step], int]]) -> bool:
        """Whether recording ``calls`` (each with its :meth:`size`, in order) after ``model_id``'s log would save a
        restore point at one of them (:meth:`ran`): a call sent to the learner before that save would be in it."""
        replay = self.replays.get(model_id)
        if replay is None:
            return False
        size = replay.bytes
        for call, n in calls:
            size += n
            if isinstance(call, Step) and size > self.replay_bytes:
                return True
        return False

    async def snapshot(self, model_id: str, save: Callable[[str], Awaitable[Any]]) -> None:
        """``save(dir)`` (the learner's save, optimizer included, in the model's order) is the new restore
        point, and the log starts over."""
        replay = self.replays.get(model_id)
        if replay is None:
            return
        replay.dirs += 1
        dest = self._dir(model_id, replay.dirs)
        await save(str(dest))
        for old in self._model_dir(model_id).iterdir():
            if old != dest:  # the old restore point and the links its log used
                shutil.rmtree(old, ignore_errors=True)
        replay.start, replay.calls, replay.bytes = Loaded(str(dest), True), [], 0

    def forget(self, model_id: str) -> None:
        """The model left its learner: its log and restore points go."""
        self.lost.pop(model_id, None)
        if self.replays.pop(model_id, None) is not None:
            shutil.rmtree(self._model_dir(model_id), ignore_errors=True)

    def _model_dir(self, model_id: str) -> Path:
        return self.dir / model_id.replace(":", "_").replace("/", "_")

    def _dir(self, model_id: str, n: int) -> Path:
        return self._model_dir(model_id) / f"{n:06d}"

    # ------------------------------------------------------------------ healing

    async def ready(self, base: str) -> None:
        """Wait for a healing of ``base`` in progress (a call sent before it ends would find no adapter)."""
        running = self.current.get(base)
        if running is not None and not running.done():
            await asyncio.shield(running)

    async def call(self, base: str, send: Callable[[], Awaitable[Any]], live: Callable[[], bool]) -> Any:
        """``send()``, one call of a live model's learner: if the learner died (or restarted) under it, its
        models are rebuilt (:meth:`heal`) and the call is sent once more; ``live()``: the model is still live."""
        for again in (False, True):
            await self.ready(base)
            seen = self.deaths.get(base, 0)
            try:
                return await send()
            except Exception as e:
                if again or not self.on or not learner_lost(e) or not live():
                    raise
            await self.heal(base, seen)

    async def watch(self, base: str) -> None:
        """Forever: when ``base``'s learner dies (Ray starts a new one, without adapters) its live models are
        rebuilt on the new one; with healing off, they end FAILED at once with the reason, instead of failing
        each client's next request obscurely."""
        while True:
            seen = self.deaths[base]
            try:
                await self.learners[base].until_gone.remote()
            except Exception as e:  # noqa: BLE001 - it died
                if self.on:
                    await self.heal(base, seen)
                else:
                    for model_id in self.live(base):
                        await self.failed(model_id, f"the learner of {base} died ({type(e).__name__}); a new one "
                                                    "was started")
            await asyncio.sleep(1.0)

    async def heal(self, base: str, seen: int) -> None:
        """``base``'s learner died after ``seen`` deaths were known: its live models rebuilt, once per death
        (every caller that saw the same death waits for the same healing; a later one runs after it); those
        that could not be end FAILED with the reason."""
        if self.deaths[base] == seen:
            self.deaths[base] += 1
            self.current[base] = asyncio.ensure_future(self._heal(base, self.current.get(base)))
        for model_id, why in (await asyncio.shield(self.current[base])).items():
            await self.failed(model_id, f"the learner of {base} died and {why}")

    async def _heal(self, base: str, before: Optional[asyncio.Future]) -> dict[str, str]:
        if before is not None:
            await asyncio.wait([before])
        failed: dict[str, str] = {}
        for _ in range(REBUILD_TRIES):  # the new learner died too: all of its models again
            failed, rebuilt = {}, {}
            if not await until_up(self.learners[base]):
                continue
            for model_id in [m for m, r in self.replays.items() if r.base == base]:
                if model_id not in self.replays:  # unloaded meanwhile
                    continue
                try:
                    rebuilt[model_id] = await self._rebuild(model_id, self.replays[model_id])
                except Exception as e:  # noqa: BLE001 - the reason ends the model
                    if actor_died(e):
                        break
                    failed[model_id] = f"it could not be rebuilt on the new learner ({cause(e)})"
            else:
                break
        else:
            return {m: f"its learner died {REBUILD_TRIES} times while it was rebuilt"
                    for m, r in self.replays.items() if r.base == base}
        for model_id in self.live(base):
            if model_id not in self.replays and model_id not in failed:
                failed[model_id] = self.lost.get(model_id, "no restore point was kept for it")
        for model_id, n in rebuilt.items():
            self.healed += 1
            log.warning("the learner of %s died; %s rebuilt (%d calls replayed)", base, model_id, n)
            await self.recovered(model_id, f"the learner of {base} died; the model was rebuilt on a new one "
                                           f"({n} training calls replayed, no step lost)")
        return failed

    async def _rebuild(self, model_id: str, r: Replay) -> int:
        """``model_id``'s adapter again on its (restarted) learner; returns the calls replayed."""
        learner = self.learners[r.base]
        if model_id in await learner.adapters.remote():
            await learner.drop.remote(r.owner, model_id, "it is rebuilt")  # half made by an earlier try
        if isinstance(r.start, Made):
            await learner.create.remote(r.owner, model_id, r.start.spec)
        else:
            await learner.load.remote(r.owner, model_id, r.start.path, r.start.optimizer, True)
        for call in list(r.calls):
            if isinstance(call, Pass):
                await learner.forward_backward.remote(r.owner, model_id, call.datums, call.loss_fn,
                                                      call.loss_fn_config, True, call.graph)
            elif isinstance(call, Loaded):
                await learner.load.remote(r.owner, model_id, call.path, call.optimizer, False)
            else:
                await learner.optim_step.remote(r.owner, model_id, call.step)
        return len(r.calls)

