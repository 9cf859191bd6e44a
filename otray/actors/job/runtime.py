"""PolicyRuntime: one trained policy's actors as the job driver holds them, and how they are made.

A job trains one policy (env jobs, self-play) or several (a game with ``trained:a`` and
``trained:b`` seats). For each, :func:`start_policies` creates a PolicyLearner actor and
its rollout workers in the job's placement group (or lets the learner sample itself,
``rollout.colocate``) without waiting, so the driver loads its tokenizer and data while they
start; :func:`ready_policies` waits for them and returns a :class:`PolicyRuntime`: the handles,
the :class:`~otray.actors.sampling.fleet.RolloutFleet` over the workers, their typed
:class:`~otray.types.WorkerInfo`, and the policy version the driver has counted.

Bundle layout of a job's placement group (``otray.actors.control.lease.bundles_for``): policy k
takes ``N + W`` bundles from ``k * (N + W)`` on (its N learner ranks, ``resources.learner_workers``,
then its W rollout workers; the job driver, a game's coordinator and a sharded policy's
LearnerGroup sit in the first bundle with no CPU of their own), then one bundle per frozen
game policy.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from otray.config import AlgoSection, Config, learner_ranks, policy_bundles, to_dict, trained_policies
from otray.actors.job.replacement import WorkerReplacer
from otray.actors.sampling.fleet import RolloutFleet
from otray.actors.sampling.transport import choose
from otray.algos.clipping import grad_clip, remember
from otray.placement import in_bundle, threads_env
from otray.records import CheckpointMeta
from otray.timing import StepClock
from otray.types import Datum, LossNormalizer, WorkerInfo, WorkersLostError

WORKERS_RNG = "workers_rng.pt"  # a checkpoint's rollout-worker RNG states (under state/)


def actor_name(job_id: str, role: str) -> str:
    """What a job's actor is called in the Ray dashboard's actor list: ``otray:<job id>:<role>``
    (roles: ``learner``, ``learner-rank-1``, ``rollout-0``, ``coordinator``; a second trained policy's
    prefixed with its name, e.g. ``b/learner``)."""
    return f"otray:{job_id}:{role}"


@dataclass
class ActorFactory:
    """Creates a job's actors in its placement group, sized by ``resources``, each named after the
    job and its role (:func:`actor_name`) so a user finds them in the Ray dashboard; ``close`` ends them."""

    cfg: Config
    model_path: str
    placement_group: Any = None
    job_id: str = ""
    made: list[Any] = field(default_factory=list)

    def start(self, actor_class: Any, options: dict[str, Any], role: str, *args: Any, **kwargs: Any) -> Any:
        """``actor_class.options(**options, name=...).remote(*args, **kwargs)``: the actor named for ``role``.
        A name still held (an earlier run of the same job directory in this process, ending) gets a suffix."""
        for attempt in range(20):
            named = {"name": actor_name(self.job_id, role) + (f"~{attempt}" if attempt else "")} if self.job_id else {}
            try:
                handle = actor_class.options(**options, **named).remote(*args, **kwargs)
                break
            except ValueError as e:
                if "already" not in str(e) and "taken" not in str(e):
                    raise
        else:
            raise RuntimeError(f"no free actor name for {actor_name(self.job_id, role)!r}")
        self.made.append(handle)
        return handle

    def close(self) -> None:
        """End every actor this factory started (the job is over; under the ResourceManager its
        placement group goes too, but a job run in-process would leave named actors behind)."""
        import ray

        for handle in self.made:
            try:
                ray.kill(handle)
            except Exception:  # noqa: BLE001 - dead already
                pass
        self.made.clear()

    def learner(self, bundle: int, prefix: str = "") -> Any:
        """The policy's learner from bundle ``bundle`` on: a PolicyLearner, or with
        ``resources.learner_workers: N > 1`` a LearnerGroup over N ranks in bundles ``bundle ..
        bundle + N - 1`` (otray.actors.learner.group)."""
        import ray

        from otray.actors.learner.policy_learner import PolicyLearner

        cfg, res = self.cfg, self.cfg.resources
        kwargs = dict(lora=to_dict(cfg)["model"]["lora"], dtype=cfg.model.dtype, device=cfg.model.device,
                      micro_batch_tokens=cfg.algo.micro_batch_tokens, seed=cfg.job.seed, num_threads=res.learner_threads,
                      gradient_checkpointing=cfg.model.gradient_checkpointing, vision_lr_scale=cfg.model.vision_lr_scale)

        def actor(cls: type) -> Any:
            return ray.remote(num_cpus=res.learner_cpus, num_gpus=res.learner_gpus)(cls)

        def where(index: int) -> dict[str, Any]:
            return {**in_bundle(self.placement_group, index), **threads_env(res.learner_threads, res.learner_cpus)}

        n = res.learner_workers
        if n == 1:
            return self.start(actor(PolicyLearner), where(bundle), prefix + "learner", self.model_path, **kwargs)
        from otray.actors.learner.group import LearnerGroup
        from otray.actors.learner.rank import LearnerRank

        ranks = [self.start(actor(LearnerRank), where(bundle + r), f"{prefix}learner-rank-{r}", self.model_path,
                            rank=r, world_size=n, **kwargs) for r in range(n)]
        return self.start(ray.remote(num_cpus=0)(LearnerGroup), in_bundle(self.placement_group, bundle),
                          prefix + "learner", ranks, cfg.algo.micro_batch_tokens, res.collective_timeout_s)

    def workers(self, first_bundle: int, n: int, model_path: str | None = None, prefix: str = "") -> list[Any]:
        """``n`` RolloutWorkers serving ``model_path`` (default: the job's model) in bundles
        ``first_bundle``, ``first_bundle + 1``, ...; worker i is seeded ``job.seed + i``."""
        return [self.worker(first_bundle, i, model_path, prefix) for i in range(n)]

    def worker(self, first_bundle: int, i: int, model_path: str | None = None, prefix: str = "") -> Any:
        """Rollout worker ``i`` of those from bundle ``first_bundle`` on (also a new one in a dead one's place)."""
        import ray

        from otray.actors.sampling.rollout import RolloutWorker

        cfg, res = self.cfg, self.cfg.resources
        return self.start(ray.remote(num_cpus=res.rollout_cpus, num_gpus=res.rollout_gpus)(RolloutWorker),
            {**in_bundle(self.placement_group, first_bundle + i), **threads_env(res.rollout_threads, res.rollout_cpus)},
            f"{prefix}rollout-{i}", model_path or self.model_path, cfg.rollout.backend, num_threads=res.rollout_threads,
            dtype=cfg.model.dtype, device=cfg.model.device, max_model_len=cfg.rollout.max_model_len,
            seed=cfg.job.seed + i, max_lora_rank=cfg.model.lora.rank, kv_cache_gb=cfg.rollout.kv_cache_gb,
            max_batch=cfg.rollout.max_batch, gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
            enforce_eager=cfg.rollout.enforce_eager, sampler=cfg.rollout.sampler)


@dataclass(frozen=True)
class Objective:
    """What one update minimises: a loss from ``otray.names.LOSS_NAMES``, its config, its aggregation."""

    loss_fn: str
    loss_fn_config: dict[str, float]
    aggregation: str

    @classmethod
    def of(cls, algo: AlgoSection) -> "Objective":
        return cls(algo.loss_fn, dict(algo.loss_fn_config), algo.aggregation)


SUPERVISED = Objective("cross_entropy", {}, "token_mean")


@dataclass
class PolicyRuntime:
    """One trained policy: its learner actor, the fleet that samples from it, and the driver's view of
    both. ``version`` counts the learner's optimizer steps (the policy version the sampled episodes
    carry); ``synced`` is False after updates the fleet has not been sent yet."""

    name: str
    learner: Any  # PolicyLearner actor handle
    fleet: RolloutFleet | None  # None: an SFT job with no envs to evaluate starts no workers
    info: WorkerInfo
    colocated: bool
    version: int = 0
    synced: bool = True
    nodes: dict[str, Any] = field(default_factory=dict)  # Ray node ids of the learner and the workers
    weight_sync: str = "object_store"  # how weights reach the workers (otray.actors.sampling.transport)
    first_bundle: int = 0  # the placement group bundle of its rollout worker 0 (worker i: first_bundle + i)
    prefix: str = ""  # its actors' role prefix (a second trained policy's name)
    reported: int = 0  # the fleet's drops reported so far
    replacer: WorkerReplacer | None = None  # replaces dead rollout workers (:meth:`replace_workers`)
    grad_norms: list[float] = field(default_factory=list)  # recent RL steps' norms (algo.grad_clip_relative)

    @property
    def workers(self) -> tuple[Any, ...]:
        """Handles that sample this policy: the rollout workers, or the learner itself when colocated."""
        return tuple(self.fleet.workers) if self.fleet is not None else ()

    def update(self, datums: list[Datum], objective: Objective, algo: AlgoSection, learning_rate: float,
               normalizer: LossNormalizer | None = None, clock: StepClock | None = None,
               kl_to_start: float = 0.0, rl: bool = False) -> dict[str, float]:
        """forward_backward + optim_step on ``datums`` (nothing when there are none); returns the
        learner's metrics of both calls and marks them on ``clock``. ``kl_to_start``: the weight of the
        KL to the policy RL started from (RL steps: ``algo.kl_coeff``; :meth:`anchor` first). ``rl``: an RL
        step, clipped as ``algo.grad_clip_relative`` says by the recent RL steps' norms, which its own joins, and a
        VLM's vision tower at ``algo.vision_lr_scale``."""
        import ray

        if not datums:
            return {}
        fb = ray.get(self.learner.forward_backward.remote(
            datums, objective.loss_fn, objective.loss_fn_config, objective.aggregation, normalizer, kl_to_start))
        if clock is not None:
            clock.mark("forward_backward")
        clip = grad_clip(self.grad_norms, algo.grad_clip, algo.grad_clip_relative if rl else 0.0)
        opt = ray.get(self.learner.optim_step.remote(learning_rate, tuple(algo.betas), 1e-8, algo.weight_decay, clip,
                                                     algo.vision_lr_scale if rl else None))
        if clock is not None:
            clock.mark("optim_step")
        self.version += 1
        self.synced = False
        if rl:
            remember(self.grad_norms, opt["grad_norm"])
        return {**fb, **opt, **({"grad_clip": clip} if rl and algo.grad_clip_relative else {})}

    def anchor(self, keep: bool = False) -> bool:
        """The learner takes its weights now as the policy RL starts from (``algo.kl_coeff``'s reference;
        ``keep``: unless it holds one from its checkpoint). Returns whether it took them."""
        import ray

        return ray.get(self.learner.set_anchor.remote(keep))

    def sync_weights(self, clock: StepClock | None = None) -> float:
        """Push the learner's weights to the fleet over ``weight_sync`` (full ones in the workers' dtype; colocated:
        nothing to send, the learner samples from the weights it trains); returns the seconds it took."""
        t0 = time.perf_counter()
        if self.fleet is not None and not self.colocated:
            update = self.learner.weights.remote(self.weight_sync, self.info.dtype)
            sender = self.learner.send_weights.remote() if self.weight_sync == "broadcast" else None
            self.fleet.update_weights(update, self.version, sender)
        self.synced = True
        if clock is not None:
            clock.mark("weight_sync")
        return time.perf_counter() - t0

    def replace_workers(self, factory: ActorFactory, limit: int, mid_step: bool) -> None:
        """From now on a dead rollout worker is replaced by a new one in its bundle (``factory``), at most
        ``limit`` times (``job.max_failures``): between steps, and with ``mid_step`` (on-policy jobs, whose
        sampling never overlaps an update) also when a generate call has lost every worker. Not for a colocated
        sampler or a broadcast group (fixed when the job started: a restart from the checkpoint heals it)."""
        if self.fleet is None or self.colocated or self.weight_sync == "broadcast":
            return
        self.replacer = WorkerReplacer(self.name, factory, limit, self.fleet, self.learner, self.first_bundle,
                                       self.prefix, self.weight_sync, self.info.dtype)
        self.fleet.keep_rng = True
        if mid_step:
            self.fleet.refill = self._refill

    @property
    def replaced(self) -> int:
        """Dead rollout workers replaced so far."""
        return self.replacer.replaced if self.replacer is not None else 0

    def take_healed(self) -> list[str]:
        """Why each rollout worker replaced since the last call was replaced (a step's ``recovery/workers``)."""
        return self.replacer.take_healed() if self.replacer is not None else []

    def _refill(self) -> bool:
        """The fleet lost its last worker in a generate call: replace them now (True: one is live again)."""
        self.replacer.pending += self.replacer.replace_dead()
        return bool(self.fleet.live)

    def check_health(self, timeout: float = 30.0) -> list[str]:
        """Ping the fleet's workers between steps; returns a line for each worker lost since the last
        check (the fleet drops it) and for each replaced (:meth:`replace_workers`); raises
        WorkersLostError when none is left."""
        if self.fleet is None:
            return []
        self.fleet.health_check(timeout)
        lines = [f"policy {self.name!r}: rollout worker {i} failed ({why})" for i, why in self.fleet.drops[self.reported:]]
        self.reported = len(self.fleet.drops)
        if self.replacer is not None:
            lines += [*self.replacer.take_pending(), *self.replacer.replace_dead()]
        if not self.fleet.live:
            raise WorkersLostError(f"policy {self.name!r}: every rollout worker failed: " +
                                   "; ".join(f"worker {i}: {why}" for i, why in self.fleet.dead.items()))
        return lines

    def busy_s(self) -> list[float]:
        """Busy seconds so far of the learner, then of each live worker (``otray.timing.BusyClock``)."""
        import ray

        learner = ray.get(self.learner.busy_s.remote())
        return [learner, *(self.fleet.busy_s() if self.fleet is not None else [])]

    def save(self, path: Path, extra_state: dict[str, Any]) -> None:
        """Learner state (``path/state``, with ``extra_state``), the exported model (``path/model``) and the
        rollout workers' RNG states (``path/state/workers_rng.pt``: what their unseeded sampling draws from)."""
        import ray
        import torch

        ray.get(self.learner.save_state.remote(str(path / "state"), {**extra_state, "grad_norms": self.grad_norms}))
        ray.get(self.learner.export.remote(str(path / "model")))
        if self.fleet is not None and not self.colocated:  # (a colocated learner saves its own RNG state)
            states = self.fleet.ask(lambda w: w.rng_state.remote())  # (a worker dead meanwhile: a resume will not sample exactly)
            torch.save(list(states.values()), path / "state" / WORKERS_RNG)

    def load(self, path: Path) -> CheckpointMeta:
        """Load the learner state saved under ``path/state``, push the weights, give the rollout workers
        their saved RNG states (when as many are live as were saved: a resumed job then samples exactly
        what the uninterrupted one did); returns its meta."""
        import ray
        import torch

        meta = ray.get(self.learner.load_state.remote(str(path / "state")))
        self.version = ray.get(self.learner.info.remote()).policy_version
        self.grad_norms = list(meta.extra_state.get("grad_norms", []))
        self.sync_weights()
        saved = path / "state" / WORKERS_RNG
        if self.fleet is not None and not self.colocated and saved.exists():
            states = torch.load(saved, weights_only=False)
            if len(states) == len(self.fleet.live):
                ray.get([self.fleet.workers[i].set_rng_state.remote(st) for i, st in zip(self.fleet.live, states)])
                self.fleet.rng.update(zip(self.fleet.live, states))
        return meta


@dataclass
class StartingPolicy:
    """A trained policy whose actors were created but may still be starting (importing torch, loading
    the model): what :func:`start_policies` hands to :func:`ready_policies`."""

    name: str
    learner: Any
    workers: list[Any]
    first_bundle: int = 0  # its rollout worker 0's bundle
    prefix: str = ""  # its actors' role prefix


def start_policies(cfg: Config, factory: ActorFactory) -> list[StartingPolicy]:
    """Create every policy's learner and rollout workers (``config.trained_policies``; the first is the
    job's own) without waiting for them: a caller loads its tokenizer and data while they start."""
    per, ranks = policy_bundles(cfg), learner_ranks(cfg)
    prefix = [f"{name}/" if k else "" for k, name in enumerate(trained_policies(cfg))]
    return [StartingPolicy(name, factory.learner(k * per, prefix[k]),
                           factory.workers(k * per + ranks, per - ranks, prefix=prefix[k]), k * per + ranks, prefix[k])
            for k, name in enumerate(trained_policies(cfg))]


def ready_policies(cfg: Config, starting: list[StartingPolicy]) -> dict[str, PolicyRuntime]:
    """Every started policy, its learner and rollout workers ready. Policies after the first push their
    weights to their workers once, so every trained policy starts from the same weights as its sampler."""
    import ray

    from otray.actors.sampling.rollout import wait_ready

    colocated = cfg.rollout.colocate and (cfg.job.kind == "rl" or bool(cfg.envs))
    wait_ready([h for p in starting for h in (p.learner, *p.workers)])
    policies = {}
    for k, p in enumerate(starting):
        name, learner, workers = p.name, p.learner, p.workers
        if colocated:
            infos = [ray.get(learner.start_sampler.remote(cfg.rollout.max_model_len, cfg.rollout.max_batch,
                                                          cfg.rollout.sampler))]
        else:
            infos = ray.get([w.info.remote() for w in workers])
        fleet = RolloutFleet([learner] if colocated else workers) if infos else None
        state = ray.get(learner.info.remote())
        nodes = {"learner": state.node_id, "rollout": [i.node_id for i in infos]}
        sync = "none" if colocated else choose(cfg.rollout.weight_sync, nodes["learner"], nodes["rollout"],
                                               state.device, [i.device for i in infos])
        if sync == "broadcast" and workers:
            open_broadcast(learner, workers)
        policy = PolicyRuntime(name, learner, fleet, infos[0] if infos else WorkerInfo(None, cfg.rollout.max_model_len),
                               colocated, version=state.policy_version, nodes=nodes, weight_sync=sync,
                               first_bundle=p.first_bundle, prefix=p.prefix)
        if k > 0:
            policy.sync_weights()
        policies[name] = policy
    return policies


def open_broadcast(learner: Any, workers: list[Any]) -> None:
    """Make the broadcast group of ``learner`` (rank 0) and ``workers`` (``rollout.weight_sync: broadcast``):
    every member joins at once."""
    import ray

    address = ray.get(learner.open_broadcast.remote())
    world = len(workers) + 1
    ray.get([learner.join_broadcast.remote(address, world),
             *[w.join_broadcast.remote(address, k + 1, world) for k, w in enumerate(workers)]])
