"""The Serve app's config (``otray serve [CONFIG]``): which base models, where, and how.

Loaded like a job config (:mod:`otray.structured`): unknown keys and wrong types are
errors that name the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from otray.ranges import SERVE_RANGES, check_ranges
from otray.structured import load_structured, one_of
from otray.types import ConfigError


@dataclass
class ServeModel:
    """A base model the app serves; checkpoints of jobs trained from it are served on its replicas."""

    name: str = "tiny"  # the ``model`` field that selects it
    path: str = "tiny"  # local dir, hub id, or ``tiny`` (built on first use)
    backend: str = "hf"  # hf | vllm | auto
    dtype: str = "float32"
    max_model_len: Optional[int] = None
    kv_cache_gb: int = 1
    num_threads: Optional[int] = None  # torch threads per replica (default: its CPUs)
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0
    num_replicas: int = 1
    # Ray Serve autoscaling, e.g. {min_replicas: 1, max_replicas: 4, target_ongoing_requests: 4};
    # when given it replaces num_replicas
    autoscaling: Optional[dict[str, Any]] = None
    max_loaded_checkpoints: int = 2  # per replica; least recently used evicted past this
    # vLLM base: LoRA checkpoints up to this rank run as adapters of the base engine (one
    # slot per loaded checkpoint; one engine call may serve several adapters); 0, a higher rank,
    # or the HF backend: the adapter is merged into a copy of the base
    max_lora_rank: int = 0
    max_ongoing_requests: int = 32
    # prompts per generate call: concurrent requests with equal settings share one (a vLLM model: sequences
    # decoding at once, its requests joining the engine between steps: serve/engine_loop.py)
    max_batch: int = 32
    # before a call (vLLM: before the engine starts from idle), wait up to this long until as many prompts are
    # queued as were in the system when recent calls ended (clients whose answers just went out come back; a
    # lone client never waits): without it 8 clients settled into calls of 7 and 1, or 4 and 4 (benchmarks/serve.py)
    batch_wait_ms: float = 50.0


@dataclass
class ServeConfig:
    """``otray serve [CONFIG]``: the OpenAI-compatible app and the dashboard."""

    host: str = "127.0.0.1"
    port: int = 8000
    models: list[ServeModel] = field(default_factory=lambda: [ServeModel()])
    auth: str = "auto"  # auto (as the ResourceManager) | on | off
    request_timeout_s: float = 120.0
    max_tokens: int = 512  # per completion
    max_n: int = 8
    max_prompt_tokens: int = 4096
    max_body_bytes: int = 1_000_000  # a request's JSON (inline images included) and a fetched image
    # fetch chat requests' http(s) image URLs (else a 400 asks for a data URL): an admin's choice, since the
    # server then makes requests where a client points it
    fetch_image_urls: bool = False
    # tokens a streamed answer grows by per step: read from the engine's steps on vLLM (serve/engine_loop.py), a
    # turn from its KV cache on an HF model (serve/streams.py), a backend call over the prompt and the tokens so
    # far with images on HF or on the compiled sampler
    stream_chunk_tokens: int = 4
    max_ongoing_requests: int = 256  # requests the Gateway holds at once (Serve's default, 5, would cap batching)
    cache_dir: str = ".cache/models"
    # split: a Gateway deployment calling one ModelServer deployment per base model; single:
    # the Gateway holds the one base model and generates in process (one hop less per
    # request); auto: single when one base model is configured
    layout: str = "auto"


def load_serve(source: str | Path | dict[str, Any] | ServeConfig | None = None,
               overrides: list[str] | None = None) -> ServeConfig:
    cfg = load_structured(source if source is not None else {}, overrides, ServeConfig)
    check_ranges(cfg, SERVE_RANGES)
    one_of(cfg.auth, ("auto", "on", "off"), "auth")
    one_of(cfg.layout, ("auto", "single", "split"), "layout")
    if not cfg.models:
        raise ConfigError("models is empty: list at least one base model to serve")
    names = [m.name for m in cfg.models]
    if len(set(names)) != len(names) or any(n.startswith("job-") for n in names):
        raise ConfigError(f"model names must be unique and not start with 'job-' (checkpoint names); got {names}")
    if cfg.layout == "single" and len(cfg.models) > 1:
        raise ConfigError(f"layout: single serves one base model in the Gateway; {len(cfg.models)} are configured "
                          f"({', '.join(names)}): use layout: split (or auto)")
    for i, m in enumerate(cfg.models):
        one_of(m.backend, ("auto", "vllm", "hf"), f"models[{i}].backend")
        if m.max_lora_rank and m.backend == "hf":
            raise ConfigError(f"models[{i}]: max_lora_rank serves adapters on a vLLM engine; with backend hf "
                              "LoRA checkpoints are merged into the base: set backend: vllm or drop max_lora_rank")
    return cfg
