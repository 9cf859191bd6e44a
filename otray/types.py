"""Data that crosses module and actor boundaries.

Everything here is a small, picklable dataclass (tests round-trip each one through
``pickle``). Token ids are plain ``list[int]`` and log-probabilities plain
``list[float]`` so that a value can travel through Ray's object store without
dragging torch along; tensors appear only in :class:`WeightUpdate`.

The exception hierarchy lives here too, because errors cross actor boundaries as
well: every otray error derives from :class:`OtrayError` *and* from the builtin it
resembles, so ``except ValueError`` keeps working for callers that do not know otray.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

# --------------------------------------------------------------------------- errors


class OtrayError(Exception):
    """Root of every error otray raises on purpose. Messages say what to do."""


class ConfigError(OtrayError, ValueError):
    """A config file or override is invalid (unknown key, wrong type, bad value)."""


class QuotaError(OtrayError, PermissionError):
    """A request would take its user past a quota an admin set; the message names the quota."""


class ModelLoadError(OtrayError, FileNotFoundError):
    """A model or tokenizer could not be loaded from the given path or hub id."""


class EnvCheckError(OtrayError, AssertionError):
    """``check_env`` found an environment that breaks the env protocol."""


class EnvStateError(OtrayError, RuntimeError):
    """An env method was called in the wrong state (e.g. ``step`` before ``reset``)."""


class DatasetError(OtrayError, ValueError):
    """A task source is empty, unreadable or lacks required fields."""


class RolloutError(OtrayError, RuntimeError):
    """Generation failed on every rollout worker (names the failing workers)."""


class WorkersLostError(RolloutError):
    """Every rollout worker of a policy died (their actors or processes; each named with why): a failure a
    restart can heal (``job.max_failures``), unlike rollouts that fail in their environment."""


class WeightSyncError(OtrayError, RuntimeError):
    """A weight update that a rollout worker did not apply as sent (checksum or version mismatch)."""


class PromptTooLongError(OtrayError, ValueError):
    """A prompt does not fit the model context; carries the lengths involved."""


# --------------------------------------------------------------------------- sampling


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one completion. ``temperature == 0`` means greedy.

    ``max_tokens`` bounds the new tokens of one call (one turn). ``stop_token_ids``
    default to the tokenizer's end-of-turn ids, filled in by the backend, unless
    ``ignore_eos`` asks for exactly ``max_tokens`` tokens. ``stop`` strings end a sample
    as soon as its decoded text contains one (e.g. ``</tool_call>``); the sample keeps
    every token up to the one that completed the string (finish reason ``stop_string``).
    """

    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    # > 0: after temperature (before top-k / top-p, as vLLM), rule out every token less likely than min_p
    # times the likeliest one (min-p sampling): a temperature above 1 then spreads the choice among the tokens
    # the model weighs, not over the tail
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # generate exactly max_tokens (benchmarks); no stop ids apply
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ConfigError(f"stop strings must be non-empty strings, got {list(self.stop)}")
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ConfigError(f"min_p must be in [0, 1], got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class FinishReason(str, enum.Enum):
    STOP = "stop"  # an end-of-turn / stop token was sampled (and is included)
    LENGTH = "length"  # max_tokens or the context limit was reached
    STOP_STRING = "stop_string"  # the text reached a stop string; every sampled token is kept


@dataclass
class Sample:
    """One completion: sampled ids, the sampler's logprob of each, why it ended.

    Logprobs are of the unmodified (temperature 1) distribution, which is what the
    learner computes, so importance ratios compare like with like.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    # prompt tokens the engine found in its prefix cache (vLLM's num_cached_tokens; 0 where the engine has
    # no prefix cache, as HF generate): the same on every sample of one prompt
    cached_prompt_tokens: int = 0

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError("token_ids and logprobs must have equal length")


@dataclass
class GenerateResult:
    """``n`` samples for one prompt, plus the policy version that produced them."""

    samples: list[Sample]
    policy_version: int


# --------------------------------------------------------------------------- weights


@dataclass
class WeightUpdate:
    """New policy weights, sent from the learner to rollout workers.

    ``kind == "full"``: ``tensors`` are the full model's parameters under Hugging
    Face names. ``kind == "lora"``: ``tensors`` are a PEFT adapter's weights and
    ``lora_config`` the adapter config as a dict. Passed by Ray object reference,
    so it reaches workers on other nodes through the object store; with
    ``rollout.weight_sync: shm`` ``tensors`` is a :class:`SharedTensors` handle instead
    (``otray.actors.sampling.transport``).
    """

    version: int
    kind: str  # "full" | "lora"
    tensors: dict[str, Any] | SharedTensors | DeviceTensors
    lora_config: dict[str, Any] | None = None
    checksum: WeightChecksum | None = None  # of a few tensors as sent; the worker checks what it loaded


@dataclass(frozen=True)
class WeightChecksum:
    """Position-weighted sums of a few tensors of an update (``device_transport.checksum``)."""

    names: tuple[str, ...]
    sums: tuple[float, ...]


@dataclass(frozen=True)
class DeviceTensors:
    """An update's tensors in the learner's flat device buffer (``device_transport``): ``transport`` is
    ``cuda_ipc`` (``handle``: the buffer's pickled CUDA IPC handle) or ``broadcast`` (the buffer follows
    over the broadcast group); ``layout`` as :class:`SharedTensors`'; ``device``: the learner's
    (``cpu`` or ``cuda:<uuid>``); ``generation`` changes when the buffer is reallocated."""

    transport: str
    layout: tuple[tuple[str, str, tuple[int, ...], int, int], ...]
    size: int
    node_id: str | None
    device: str
    generation: int
    handle: bytes | None = None


@dataclass(frozen=True)
class SharedTensors:
    """Tensors written once into a shared-memory file on one node: where, and each one's
    ``(name, dtype, shape, byte offset, bytes)`` in it."""

    path: str
    node_id: str | None
    layout: tuple[tuple[str, str, tuple[int, ...], int, int], ...]
    size: int


@dataclass(frozen=True)
class WorkerInfo:
    """What a rollout worker (or a learner that samples, ``rollout.colocate``) tells its job:
    the backend it runs, the longest sequence it takes, its end-of-turn ids, the policy
    version of its weights and the Ray node it runs on."""

    backend: str | None
    max_model_len: int
    stop_token_ids: tuple[int, ...] = ()
    policy_version: int = 0
    node_id: str | None = None
    sampler: str = "eager"  # the HF backend's: eager | compiled (rollout.sampler); vLLM's own otherwise
    dtype: str = "float32"  # what it samples in: the learner sends its weights in this dtype
    device: str = "cpu"  # cpu | cuda:<uuid> (device_transport.device_id)
    compile_s: float = 0.0  # seconds the compiled sampler's warm-up took when the worker started


@dataclass(frozen=True)
class LearnerInfo:
    """What a PolicyLearner tells its job: optimizer steps taken, policy version, LoRA rank, node."""

    step: int
    policy_version: int
    lora_rank: int
    node_id: str | None = None
    device: str = "cpu"  # cpu | cuda:<uuid> (device_transport.device_id)


@dataclass(frozen=True)
class LossNormalizer:
    """What an aggregated loss divides by, when the datums of one ``forward_backward`` call are part
    of a larger batch (groups left out because they carry no gradient): the whole batch's masked
    target tokens (``token_mean``) and sequences (``seq_mean_token_mean``)."""

    tokens: float
    sequences: float


# --------------------------------------------------------------------------- tasks, episodes


@dataclass
class Task:
    """One prompt source item: a dataset row or a generated problem."""

    id: str
    env: str
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class ErrorRecord:
    """What went wrong in one rollout, recorded instead of raised."""

    kind: str  # "env_exception" | "prompt_too_long" | "rollout_failed" | ...
    message: str
    turn: int = 0


@dataclass
class Trajectory:
    """One episode as the policy saw it, token by token.

    ``token_ids`` is append-only: prompt, then each sampled turn exactly as sampled,
    then each observation as new tokens. ``loss_mask[i] == 1`` exactly where token
    ``i`` was sampled by the policy; ``logprobs[i]`` is the sampler's logprob there
    (0.0 elsewhere). ``turn_rewards`` has one entry per env step (None: the env gave no reward
    signal that turn). ``finished``: the env ended the episode and called it finished (an env may
    end one unfinished); ``truncated``: a limit (turns, tokens, context) ended it.
    """

    task: Task
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    prompt_len: int = 0
    turn_rewards: list[float | None] = field(default_factory=list)
    reward: float = 0.0
    finished: bool = False
    truncated: bool = False
    num_turns: int = 0
    policy_version: int = 0
    agent_id: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    error: ErrorRecord | None = None
    messages: list[dict[str, str]] = field(default_factory=list)
    # the images of the observations, in the order their tokens appear (``otray.vision.Image``: encoded
    # bytes); each image's tokens in ``token_ids`` are its model's expanded image tokens (``otray.vlm``)
    images: list[Any] = field(default_factory=list)

    def append(self, ids: list[int], *, sampled: bool, logprobs: list[float] | None = None) -> None:
        """Append tokens; sampled tokens carry the sampler's logprobs and mask 1."""
        if sampled and (logprobs is None or len(logprobs) != len(ids)):
            raise ValueError("sampled tokens need one logprob each")
        self.token_ids.extend(ids)
        self.loss_mask.extend([1 if sampled else 0] * len(ids))
        self.logprobs.extend(logprobs if sampled else [0.0] * len(ids))

    @property
    def num_sampled(self) -> int:
        return sum(self.loss_mask)


@dataclass
class TrajectoryGroup:
    """The trajectories whose rewards are compared with each other: one GRPO group.

    For an env, the ``num_rollouts`` episodes of one task (``key`` = ``(env, task id)``); for a
    game, one role's trajectories in the games of one seed and seating (``key`` =
    ``(seed, seating index, role)``), several per game with ``game.context: turn``.
    ``max_failing`` is how many errored trajectories the group may hold and still be trained
    on (the env's ``max_failing_rollouts``; a game's ``game.max_failing_rollouts``).
    """

    task: Task
    trajectories: list[Trajectory]
    key: tuple[Any, ...] = ()
    max_failing: int = 0
    # rollouts that failed (after their retries) and were taken out of the group: kept for the
    # metrics and the episode log, never trained on; they count toward ``max_failing``
    failed: list[Trajectory] = field(default_factory=list)

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]

    @property
    def num_failed(self) -> int:
        return len(self.failed) + sum(t.error is not None for t in self.trajectories)

    @property
    def all_trajectories(self) -> list[Trajectory]:
        """The group's trajectories and its failed rollouts."""
        return [*self.trajectories, *self.failed]


@dataclass
class Datum:
    """One learner sequence, all fields of equal length (targets-aligned).

    ``input_ids = seq[:-1]``, ``target_ids = seq[1:]``; ``mask``, ``advantages``,
    ``sampler_logprobs`` and ``weights`` describe the *target* token at each position.
    ``ratio_mask``: the sampled tokens a gspo / stable_reinforce loss takes its ratio over (None:
    ``mask``); ``clip_low`` / ``clip_high``: per-token clip thresholds (NaN or None: the loss
    config's). See :mod:`otray.algos.losses`. ``target_k`` / ``weights_k``: K targets per position with
    a weight each (top-K distillation's cross-entropy; Tinker's (N, K) ``target_tokens`` / ``weights``).
    ``images``: the sequence's images in order (``otray.vision.Image``), whose expanded image tokens
    ``input_ids`` holds; the learner passes their pixels with the ids (``otray.vlm``).
    ``custom_inputs``: the arrays a Tinker custom loss reads besides the logprobs, in its declared
    order (``otray.tinker.learner.loss_graph``).
    """

    input_ids: list[int]
    target_ids: list[int]
    mask: list[float]
    advantages: list[float]
    sampler_logprobs: list[float]
    weights: list[float] | None = None
    ratio_mask: list[float] | None = None
    clip_low: list[float] | None = None
    clip_high: list[float] | None = None
    target_k: list[list[int]] | None = None
    weights_k: list[list[float]] | None = None
    images: tuple[Any, ...] = ()
    custom_inputs: tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        lengths = [len(self.target_ids), len(self.mask), len(self.advantages), len(self.sampler_logprobs)]
        lengths += [len(x) for x in (self.weights, self.ratio_mask, self.clip_low, self.clip_high, self.target_k,
                                     self.weights_k) if x is not None]
        if any(m != n for m in lengths):
            raise ValueError(f"Datum fields must have equal length, got {[n, *lengths]}")

    def __len__(self) -> int:
        return len(self.input_ids)
