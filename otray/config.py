"""Job configuration: dataclass schemas and ``load(path, overrides)``.

A config is an OmegaConf YAML file checked against :class:`Config`. Dotted overrides
(``algo.learning_rate=2e-5``) apply on top. An unknown key, or a value of the
wrong type, is a :class:`ConfigError` that names the key and the closest valid one.

Environment sections follow the OpenReward shape, one entry per env under ``envs``::

    envs:
      arithmetic:
        entry: envs.arithmetic:Arithmetic     # import path or registered name
        dataset: {builder: envs.arithmetic:make_dataset, dir: .cache/data/arithmetic}
        splits: {train: {shuffle: true}, eval: {shuffle: false, num_samples: 200}}
        num_rollouts: 8
        temperature: 1.0
        reward_reduction: sum                  # sum | mean | max | min over turns
        nonterminal_reward: 0.0                # added when the episode never finished
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from otray.policies import (PolicySpec, eval_opponents, frozen_policies, league_workers, learner_ranks,  # noqa: F401
                            num_rollout_workers, policy_bundles, seating, trained_policies)  # (re-exported)
from otray.config_checks import check_values
from otray.ranges import check_ranges
from otray.structured import import_object, load_structured, one_of, to_dict  # noqa: F401 (re-exported)
from otray.types import ConfigError


@dataclass
class JobSection:
    name: str = "job"
    kind: str = "rl"  # rl | sft | infer (batch inference: see InferSection)
    seed: int = 0
    output_dir: str = "runs"
    # failures the ResourceManager heals: an actor of the job that dies (a worker, the learner, the driver)
    # restarts the job from its last checkpoint in its placement group; the next failure past these ends it
    # FAILED with every reason (0: never restart; jobs run with `python -m otray.train` are not healed)
    max_failures: int = 3


@dataclass
class LoraSection:
    rank: int = 0  # 0 = full-parameter training
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


@dataclass
class ModelSection:
    path: str = "tiny"  # local HF dir, hub id, or tiny[:SEED] (built by otray)
    # the precision the model computes in: auto (bf16 on a GPU, float32 on the CPU) | float32 | bfloat16 |
    # float16; a full-parameter learner in bf16/fp16 keeps float32 master weights (otray.actors.learner.precision)
    dtype: str = "auto"
    gradient_checkpointing: bool = False  # the learner recomputes activations in backward: less memory, ~1/3 slower
    device: str = "auto"  # auto (the actor's GPU if Ray gave it one, else the CPU) | cpu | cuda
    cache_dir: str = ".cache/models"
    lora: LoraSection = field(default_factory=LoraSection)
    # a vision-language model's vision tower (and projector) trains at this times every step's learning rate,
    # warm-up and RL alike; 0 freezes it, 1 trains it as the language model (otray.vlm.is_vision_param says
    # which parameters). 0.1: at 1 the tiny VLM's warm-up wiped out the colours and places it was asked about
    # (held-out 67% / 27% against 100% / 80% at 0.1; NOTES.md, issue 55). Text-only models: no effect.
    vision_lr_scale: float = 0.1


@dataclass
class RolloutSection:
    backend: str = "auto"  # auto | vllm | hf
    num_workers: int = 1
    max_model_len: int = 512
    kv_cache_gb: int = 1
    max_batch: int = 256
    # Generate inside the learner actor with the model being trained (HF backend): no
    # rollout workers, no weight transfer after each optimizer step, one copy of the
    # weights. Pays off where generation and training cannot run at the same time anyway
    # (a small CPU machine, one GPU); rollout.num_workers is then ignored.
    colocate: bool = False
    # vLLM on a GPU: the share of the card its weights and KV cache may take (null: vLLM's 0.9; set it
    # lower when a learner shares the card), and eager mode (null: eager on the CPU, CUDA graphs on a GPU)
    gpu_memory_utilization: Optional[float] = None
    enforce_eager: Optional[bool] = None
    # how weights reach the rollout workers after each update: auto (cuda_ipc when the learner and every
    # worker share one node and GPU, else shared memory on one node, else the object store) | object_store
    # | shm | cuda_ipc | broadcast (a torch.distributed group: NCCL / gloo) (otray.actors.sampling.transport)
    weight_sync: str = "auto"
    # the HF backend's sampler: eager (transformers' generate) | compiled (a static-cache decode step,
    # torch.compile'd and CUDA-graphed on a GPU, compiled when the worker starts) | auto (compiled on a
    # GPU, eager on the CPU, where it measured faster); vLLM compiles its own (leave auto)
    sampler: str = "auto"


@dataclass
class ResourcesSection:
    learner_cpus: float = 1.0
    rollout_cpus: float = 1.0  # per rollout worker
    learner_gpus: float = 0.0
    rollout_gpus: float = 0.0  # per rollout worker
    # Placement of the job's bundles (0 = learner + job driver, 1+i = rollout worker i):
    # PACK | SPREAD | STRICT_PACK | STRICT_SPREAD, as in Ray placement groups.
    strategy: str = "PACK"
    # torch threads per actor; null = Ray's default (num_cpus). Learner and rollout
    # phases alternate, so each may use every core of a small machine.
    learner_threads: Optional[int] = None
    rollout_threads: Optional[int] = None
    # N > 1: each trained policy is one sharded learner group of N ranks (FSDP2, one bundle of
    # learner_cpus/learner_gpus each; otray.actors.learner.group); 1 = one PolicyLearner.
    learner_workers: int = 1
    collective_timeout_s: float = 300.0  # a rank waiting longer in a collective fails the job


@dataclass
class AlgoSection:
    loss_fn: str = "ppo"
    loss_fn_config: dict[str, float] = field(default_factory=dict)
    advantage: str = "zscore"  # mean | zscore | rloo
    aggregation: str = "token_mean"
    learning_rate: float = 1e-4
    # RL's learning rate over its steps (otray.algos.schedule): constant | linear (to 0 at the last step) |
    # cosine (to 0.1x at the last step), after a linear warm-up over lr_warmup_steps
    lr_schedule: str = "constant"
    lr_warmup_steps: int = 0
    # > 0: adds this times KL(policy || the policy RL started from, i.e. after the SFT warm-up) to every
    # sampled token's loss (k3 estimate; otray.actors.learner.anchor). Keeps what the warm-up learned.
    # Unset: 1.0 on a vision-language model with one learner, else 0 (train_job.resolve_kl_coeff says why)
    kl_coeff: Optional[float] = None
    # a vision-language model's vision tower (and projector) in RL steps trains at this times algo.learning_rate
    # (0: not moved; its gradient still counts in the step's norm). Unset: 0.3x model.vision_lr_scale where that is
    # between 0 and 1 (the default 0.1: RL's tower at 0.03), else model.vision_lr_scale (train_job.
    # resolve_vision_lr_scale has the measurements). Only for a VLM, and a value other than the warm-up's only
    # where that gave the tower a rate of its own (0 < model.vision_lr_scale < 1)
    vision_lr_scale: Optional[float] = None
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # a bound on each step's gradient norm (0: none)
    # k > 0: also bound it by k times the median norm of the last 20 RL steps (from the 4th step on): a spike
    # far above its neighbours is cut to their size (otray.algos.clipping; 0: off). Steps of the usual size pass
    grad_clip_relative: float = 3.0
    steps: int = 20
    batch_size: int = 16  # tasks per step (each rolled out num_rollouts times)
    micro_batch_tokens: int = 8192
    drop_uniform_groups: bool = True
    # 0 = on-policy. 1 = one-step-off-policy: the next batch is generated (with the current
    # weights) while the learner trains on this one, so each batch is trained one update
    # after the weights that sampled it; the loss's ratio to the sampler logprobs corrects it
    max_steps_off_policy: int = 0


@dataclass
class EvalSection:
    every: int = 0  # steps; 0 = only before and after training
    num_samples: int = 200
    greedy: bool = True
    split: str = "eval"


@dataclass
class DatasetSection:
    builder: Optional[str] = None  # "module:fn", called as fn(dir, **kwargs) -> {split: path}
    dir: str = ".cache/data"
    kwargs: dict[str, Any] = field(default_factory=dict)
    # Data-free envs: "module:fn", called as fn(rng, **kwargs) -> row, num_samples rows per split
    # (default 1000), seeded by job.seed and the split name. otray.env:seed_task gives {"seed": int}.
    generator: Optional[str] = None


@dataclass
class SplitSection:
    path: Optional[str] = None  # .jsonl / .parquet; null = from the dataset builder
    shuffle: bool = True
    num_samples: Optional[int] = None  # null = all rows


@dataclass
class SFTSection:
    """Supervised training: a warm-up before RL, or the whole job when ``job.kind == sft``.

    A warm-up (``job.kind: rl``) trains on the env's own tasks: the env's first
    observation as the prompt, ``completion_field`` of the task as the reply.
    An SFT job (``job.kind: sft``) trains on a dataset of chat conversations (rows
    with a ``messages`` list of ``{role, content}``); the loss covers the assistant
    messages only. Its ``eval`` split gives the held-out loss; envs, when
    configured, are evaluated as in RL jobs.
    """

    steps: int = 0
    batch_size: int = 32
    learning_rate: float = 1e-3
    warmup_steps: int = 50  # linear learning-rate warm-up (measured: without it the tiny model stalls)
    # Stop early once greedy accuracy on a fixed sample of *training* tasks reaches
    # this (null = run all steps). When SFT "clicks" varies by seed; this hands RL
    # the same starting competence whatever the seed. Held-out data is not used.
    stop_at_accuracy: Optional[float] = None
    check_every: int = 50
    check_samples: int = 128
    env: Optional[str] = None  # env whose train split and prompts are used
    completion_field: str = "answer"  # task field holding the target reply
    # SFT jobs: chat data, from explicit split paths or a dataset builder ({split: path}).
    dataset: DatasetSection = field(default_factory=DatasetSection)
    splits: dict[str, SplitSection] = field(default_factory=dict)
    messages_field: str = "messages"
    eval_samples: int = 200


@dataclass
class EnvSection:
    entry: str = "???"
    kwargs: dict[str, Any] = field(default_factory=dict)
    dataset: DatasetSection = field(default_factory=DatasetSection)
    splits: dict[str, SplitSection] = field(default_factory=dict)
    num_rollouts: int = 8
    max_failing_rollouts: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    min_p: float = 0.0  # > 0: min-p sampling (otray.types.SamplingParams), applied after temperature
    reward_reduction: str = "sum"  # over the turns' rewards that are not None
    # one more reward value for an episode that did not finish (ended unfinished by the env, or
    # truncated); null: none, so an unfinished episode with no reward counts as a failed rollout
    nonterminal_reward: Optional[float] = 0.0
    weight: float = 1.0
    max_turns: Optional[int] = None  # null = the env's own max_turns
    max_tokens_per_turn: int = 32
    max_tokens_per_episode: int = 256
    ignore_eos: bool = False  # sample exactly max_tokens_per_turn tokens (throughput benchmarks)
    stop: list[str] = field(default_factory=list)  # stop strings, kept in the sampled text (e.g. </tool_call>)
    # env calls (reset/step/close) of the active episodes: this many at once, each within timeout_s,
    # an episode's within episode_timeout_s (null: no limit); a call past its limit is an error record
    max_concurrency: int = 1
    timeout_s: Optional[float] = None
    episode_timeout_s: Optional[float] = None
    # a failed rollout (error, or no reward at all) is rolled out again up to this many times, then
    # taken out of its group (counted toward max_failing_rollouts)
    max_rollout_retries: int = 0
    # an env that scores whole groups (score_group): none | replace (its score is the reward) | add
    group_reward: str = "none"


@dataclass
class LeagueSection:
    """League play (``otray/algos/league.py``): every ``every`` steps each trained policy's checkpoint joins
    its pool of past selves; each step a ``share`` of the seeds is played against the league instead of as
    ``game.policies`` seats them. In a league game every trained agent in turn keeps its seat and each
    other trained seat gets a league opponent for the policy that sits there: with ``fixed_share`` one of
    the ``fixed`` opponents, else the snapshot drawn from that policy's pool this step (by ``priority``;
    before the first snapshot, the current policy: plain self-play)."""

    every: int = 0  # 0: no league
    max_size: int = 8  # snapshots kept per pool: the newest
    priority: str = "hard"  # hard: weight (1 - the policy's score against it) ** 2 | uniform
    share: float = 0.5  # of each step's seeds, the share played against the league
    fixed: list[str] = field(default_factory=list)  # random | scripted:module:fn | frozen:REF
    fixed_share: float = 0.25  # of league opponents, the share drawn from ``fixed``


@dataclass
class GameSection:
    """A multi-agent PettingZoo game (AEC or Parallel) played through the ProtocolCoordinator.

    ``policies`` maps every agent of the game to a policy:

    - ``trained`` or ``trained:NAME``: a policy this job trains. Agents with the same
      name share it (self-play); each distinct name has its own learner and rollout
      workers (``resources`` and ``rollout.num_workers`` are per trained policy), and
      all of them update in the same synchronized step.
    - ``frozen:REF``: a fixed model on its own rollout worker; REF is ``JOB_ID[:STEP]``
      (a checkpoint registered with the ResourceManager), a checkpoint directory, or a
      Hugging Face model directory.
    - ``random`` (a uniformly random legal move) or ``scripted:module:fn``
      (``fn(observation, agent) -> action``).

    Each step plays ``algo.batch_size`` seeds ``num_rollouts`` times (with
    ``rotate_seats``, once per cyclic rotation of the seating as well, so a policy
    trains in every role); advantages are grouped by (seed, seating, role).
    ``text`` is a ``GameText`` or a function of ``kwargs`` returning one.

    ``seatings`` (optional) lists the seatings played in training instead of ``policies`` and its
    rotations, each mapping every agent to a policy, so each seat can have its own sparring partner
    (e.g. a weaker opponent where the trained policy moves second) or a seat can be trained more often
    (list it twice). ``policies`` still names the job's trained and frozen policies and the league's
    base seating; evaluation is unchanged (every trained policy in every role against ``eval_opponents``).
    """

    entry: str = "???"  # "module:factory" of a PettingZoo AEC or Parallel env, e.g. envs.gomoku:env
    kwargs: dict[str, Any] = field(default_factory=dict)
    text: str = "???"  # "module:GameText" (or a function of kwargs), e.g. envs.tictactoe_text:TEXT
    policies: dict[str, str] = field(default_factory=dict)
    rotate_seats: bool = False
    seatings: list[dict[str, str]] = field(default_factory=list)  # training seatings; empty: policies (+ rotations)
    # game: each agent's whole game is one conversation; turn: each decision sees only the current
    # observation (long games in a small context), every decision is a datum carrying the game's reward
    context: str = "game"
    num_rollouts: int = 8
    # errored games (a policy's exception, a failed generate call, a full context) a group of one
    # (seed, seating, role) may hold and still be trained on; a group with more is dropped
    max_failing_rollouts: int = 0
    max_retries: int = 1
    on_exhausted: str = "random"  # random | forfeit
    # subtracted from a trained agent's training reward per unreadable or illegal reply, charged to the
    # trajectory that made it (context: turn = that decision alone); the game's own rewards, win/draw/loss
    # metrics and zero-sum checks are unaffected
    illegal_penalty: float = 0.0
    # context: turn: the decision k of an agent's moves before its last gets discount**k of the game's
    # outcome (1.0: every decision the whole outcome); credit to the moves near the end that decided it
    discount: float = 1.0
    # training games of a seed start after k plies, k drawn per seed from 0..opening_plies: random legal
    # moves (openings: random), or the first k moves of a game of the previous step (openings: played,
    # k < that game's length: positions the policies reach, up to the one before its deciding move); the
    # seed's rollouts share the opening, so their first decision is from one position (the group compares
    # moves from the same state); evaluation games start from the env's reset
    opening_plies: int = 0
    openings: str = "random"  # random | played
    # a training reward per decision from the game itself (reward shaping): "module:fn" or "module:fn(k=v, ...)",
    # called as fn(observation, agent, action) -> float for every legal move a trained policy chose (the
    # observation before the move) and added to that decision's training reward (context: turn; context: game,
    # its game's); the game's own rewards, the win/draw/loss metrics, Elo and evaluation are unaffected.
    # E.g. envs.gomoku:tactics(win_length=3, win=0.5, block=0.5)
    move_reward: str = ""
    temperature: float = 1.0
    max_tokens_per_turn: int = 8
    max_tokens_per_episode: int = 64
    # moves (all agents') after which an unfinished game ends as a timeout (OpenTinker's fourth outcome);
    # None: only the token and context budgets end a game early
    max_turns: Optional[int] = None
    elo_k: float = 16.0  # the Elo table's update size (otray/algos/ratings.py); ``random`` is pinned at 1000
    # whom each trained policy meets in evaluation (in every role): random | scripted:... | frozen:...
    eval_opponents: list[str] = field(default_factory=lambda: ["random"])
    eval_games: int = 100  # per role and opponent
    league: LeagueSection = field(default_factory=LeagueSection)


@dataclass
class LoggingSection:
    wandb: bool = False
    wandb_mode: str = "offline"  # offline | online (online needs WANDB_API_KEY and a network)
    wandb_project: str = "otray"
    ray_metrics: bool = True  # gauges via ray.util.metrics, scraped by Ray's Prometheus endpoint


@dataclass
class CheckpointSection:
    save_every: int = 0  # GRPO steps between checkpoints; 0 = only at the end
    save_at_end: bool = True
    # What to continue from: ``JOB_ID`` or ``JOB_ID:STEP`` (a checkpoint registered with
    # the ResourceManager, fetched through Ray from any node), or a checkpoint
    # directory (``<job dir>/checkpoints/step-000010``) that the job's node can read.
    # Learner state, optimizer, step counter, data position and RNG are restored.
    resume_from: Optional[str] = None


@dataclass
class InferSection:
    """``job.kind: infer`` (what ``otray infer`` submits): run the envs (or the game's evaluation
    games) over a split with a model, leased through the ResourceManager like a training job.
    Bundle 0 (``resources.learner_cpus``) holds the job driver and the agent loop, no learner."""

    checkpoint: Optional[str] = None  # JOB_ID[:STEP] (fetched through Ray), a checkpoint or model dir; null = model.path
    split: str = "eval"
    limit: Optional[int] = None  # at most N tasks per env (games: per role and opponent)
    greedy: Optional[bool] = None  # null = eval.greedy
    out: Optional[str] = None  # JSONL on the driver's node (default: <job dir>/inference.jsonl)


@dataclass
class Config:
    job: JobSection = field(default_factory=JobSection)
    model: ModelSection = field(default_factory=ModelSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    resources: ResourcesSection = field(default_factory=ResourcesSection)
    algo: AlgoSection = field(default_factory=AlgoSection)
    sft: SFTSection = field(default_factory=SFTSection)
    eval: EvalSection = field(default_factory=EvalSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    envs: dict[str, EnvSection] = field(default_factory=dict)
    game: Optional[GameSection] = None
    infer: InferSection = field(default_factory=InferSection)


# --------------------------------------------------------------------------- validation


def load(source: str | Path | dict[str, Any] | Config, overrides: list[str] | None = None) -> Config:
    """Load and validate a config from a YAML path, a dict or a Config, plus dotted overrides."""
    cfg = load_structured(source, overrides, Config)
    check_ranges(cfg)
    check_values(cfg)
    return cfg
