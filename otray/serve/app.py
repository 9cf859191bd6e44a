"""The Serve app "otray": OpenAI-compatible ``/v1`` over base models and trained checkpoints.

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``
(``stream: true`` gives server-sent events ending in ``data: [DONE]``), ``GET /health``.
The ``Gateway`` deployment (FastAPI ingress) checks the Bearer key against the
ResourceManager's registry when auth is on, validates the request
(:mod:`otray.serve.openai_api`), tokenizes it, resolves the model name and generates.

Two layouts (``layout`` in the serve config). ``split``: the Gateway calls the base
model's ``ModelServer`` deployment, with the checkpoint as Serve's multiplexed model id
(checkpoint requests are routed to the replica that holds it). ``single``: the Gateway
replica holds the one base model's ``ModelServer`` itself and generates in process, with
its own least-recently-used checkpoint cache; one actor hop less per request, which on a
small CPU machine is CPU that generation gets back (``benchmarks/serve.py``). ``auto``
(the default): ``single`` when one base model is configured.

Every client mistake is a 4xx with OpenAI's error body; a request that takes longer
than ``request_timeout_s`` gets a 504 instead of hanging.

Model names: a base model's ``name`` from the serve config, ``job-<id>`` (the job's
latest checkpoint) or ``job-<id>:<step>``; a caller sees only their own jobs (admins all).
"""

from __future__ import annotations

import asyncio
import collections
import json
import re
import time
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from ray import serve

from otray.config import to_dict
from otray.placement import threads_env
from otray.serve.config import ServeConfig
from otray.serve.dashboard import DashboardRoutes
from otray.serve.http import api, rm_handle
from otray.serve.openai_api import APIError, GenerationRequest, Limits, chunk_body, new_id, parse_request, response_body, sse, usage
from otray.types import SamplingParams
from otray.vision import Image, ImageError, fetch_image

if TYPE_CHECKING:
    from otray.serve.model_server import ReplicaInfo

APP_NAME = "otray"
_JOB_MODEL = re.compile(r"job-(?P<job>\d{8}-\d{6}-[0-9a-f]{6})(?::(?P<step>\d+))?")


# Helpers the Gateway's methods call are defined before it: Serve pickles the class by value when
# the decorator runs, with the module's globals as they are at that point.
def _no_manager() -> APIError:
    return APIError(503, "no ResourceManager answers on this cluster, so this server cannot check keys or "
                    "find checkpoints: start one (any `otray` command does; it restarts itself after a crash), or "
                    "set auth: off in the serve config for a cluster without users",
                    type="server_error", code="service_unavailable")


def _unwrap(e: BaseException) -> APIError:
    """An APIError raised in a replica (Ray wraps it), else a 500 that says what failed."""
    cause = e
    while cause is not None and not isinstance(cause, APIError):
        cause = getattr(cause, "cause", None) or cause.__cause__
    if isinstance(cause, APIError):
        return cause
    first = (str(e).strip().splitlines() or [type(e).__name__])[-1]
    return APIError(500, f"the model server failed: {first[:500]}", type="server_error")


def encode_prompt(tok: Any, req: GenerationRequest, images: tuple[Image, ...]) -> list[int]:
    """A request's prompt ids: the chat template's (each image widened to its model's image tokens) or the
    completion prompt's; an image for a text-only model is a 400."""
    from otray.models import chat_prompt_ids
    from otray.vlm import vision_inputs_at

    try:
        vision = vision_inputs_at(str(tok.name_or_path)) if images else None  # an ImageError for a text model
        ids = chat_prompt_ids(tok, req.messages) if req.chat else tok.encode(req.prompt, add_special_tokens=False)
        return vision.expand(ids, list(images)) if vision else ids
    except ImageError as e:
        raise APIError(400, f"model {req.model!r}: {e}", param="messages") from None


async def request_images(req: GenerationRequest, fetch: bool, max_bytes: int) -> tuple[Image, ...]:
    """A chat request's images; remote URLs fetched where ``fetch`` (the admin's ``fetch_image_urls``)
    allows, else a 400 that asks for a data URL."""
    out = []
    for im in req.images:
        if isinstance(im, str):
            if not fetch:
                raise APIError(400, f"image URL {im[:80]!r} is remote and this server does not fetch images: send "
                                    "it inline as data:image/png;base64,... (an admin may set fetch_image_urls)",
                               param="messages")
            try:
                im = await asyncio.to_thread(fetch_image, im, max_bytes)
            except ImageError as e:
                raise APIError(400, str(e), param="messages") from None
        out.append(im)
    return tuple(out)


@serve.deployment(name="Gateway", num_replicas=1, ray_actor_options={"num_cpus": 0})
@serve.ingress(api)
class Gateway(DashboardRoutes):
    """``otray serve``'s ingress deployment (a Ray Serve replica): the OpenAI-compatible ``/v1`` routes,
    the ``/api`` and dashboard routes; it authenticates against the ResourceManager, tokenizes, and
    generates in its own process (``layout: single``) or through ModelServer replicas (``split``), with an
    LRU of job checkpoints it is allowed to load."""

    def __init__(self, cfg: dict[str, Any], servers: dict[str, Any], ray_dashboard: str | None = None):
        # imports here: Serve ships this class by value
        from otray.models import load_tokenizer, resolve_model_path
        from otray.serve.config import load_serve
        from otray.serve.model_server import ModelServer

        self.cfg: ServeConfig = load_serve(cfg)
        self.servers = servers  # base model name -> DeploymentHandle, or None: served in this replica
        self.local = {m.name: ModelServer(m, self.cfg.cache_dir, self.cfg.stream_chunk_tokens)
                      for m in self.cfg.models if servers.get(m.name, 0) is None}
        self.checkpoints: dict[str, collections.OrderedDict[str, asyncio.Task]] = {
            name: collections.OrderedDict() for name in self.local}  # in-process layout: least recently used first
        self.limits = Limits(self.cfg.max_tokens, self.cfg.max_n, self.cfg.max_prompt_tokens)
        self.models = {m.name: m for m in self.cfg.models}
        self.paths = {m.name: resolve_model_path(m.path, self.cfg.cache_dir) for m in self.cfg.models}
        self.tokenizers = {name: load_tokenizer(path) for name, path in self.paths.items()}
        self.context = {}  # base model name -> max_model_len, asked of a replica on first use
        self.token_chars: dict[str, int] = {}  # base model name -> characters of its longest token
        self.started = int(time.time())
        self.auth_cache = (False, 0.0)  # (auth on?, expiry): the RM's setting, asked every 10 s
        self.ray_dashboard = ray_dashboard  # linked from /dashboard

    # ------------------------------------------------------------------ auth and model names

    async def _auth_on(self) -> bool:
        """``auth: on|off`` as configured; ``auto``: as the cluster's ResourceManager. Without a manager
        ``auto`` fails closed (503): whether keys are needed is the manager's to say."""
        if self.cfg.auth != "auto":
            return self.cfg.auth == "on"
        if self.auth_cache[1] > time.monotonic():
            return self.auth_cache[0]
        rm = rm_handle()
        try:
            on = await rm.auth_required.remote() if rm is not None else None
        except Exception:  # noqa: BLE001 - a dead manager: the same as none
            on = None
        if on is None:
            raise _no_manager()
        self.auth_cache = (on, time.monotonic() + 10.0)
        return on

    async def _caller(self, request: Request) -> str | None:
        """The request's API key (checked on every request when auth is on: a deleted or rotated
        key fails at once; the manager caches verified keys, so this is one actor call)."""
        header = request.headers.get("authorization", "")
        key = header[7:].strip() if header.lower().startswith("bearer ") else None
        if not await self._auth_on():
            return key
        if not key:
            raise APIError(401, "missing API key: send 'Authorization: Bearer <key>' (keys come from `otray users add`)",
                           type="invalid_request_error", code="invalid_api_key")
        try:
            await rm_handle().whoami.remote(key)
        except PermissionError as e:  # AuthError from the registry
            raise APIError(401, str(e).splitlines()[-1].split(": ", 1)[-1] or "wrong API key",
                           type="invalid_request_error", code="invalid_api_key") from None
        except Exception:  # noqa: BLE001 - the manager died or is restarting: fail closed
            raise _no_manager() from None
        return key

    async def _resolve(self, name: str, key: str | None) -> tuple[str, str]:
        """A request's model name -> (base model name, multiplexed id or '')."""
        if name in self.servers:
            return name, ""
        m = _JOB_MODEL.fullmatch(name)
        rm = rm_handle()
        if m is None or rm is None:
            raise APIError(404, f"the model {name!r} does not exist; GET /v1/models lists what is served",
                           param="model", code="model_not_found")
        try:
            step, grant, model_path = await rm.serve_grant.remote(m["job"], int(m["step"]) if m["step"] else None, key)
        except (PermissionError, KeyError, LookupError):  # unknown job or step, or another user's: one answer
            raise APIError(404, f"the model {name!r} does not exist or you do not have access to it",
                           param="model", code="model_not_found") from None
        except Exception:  # noqa: BLE001 - the manager is gone
            raise _no_manager() from None
        return self._base_for(model_path), f"job-{m['job']}:{step}:{grant}"  # the grant loads it in a replica

    def _base_for(self, model_path: str) -> str:
        from otray.models import resolve_model_path

        try:
            wanted = resolve_model_path(model_path, self.cfg.cache_dir)
        except Exception:  # noqa: BLE001 - the job's path may not exist here: full checkpoints still load
            wanted = None
        return next((n for n, p in self.paths.items() if p == wanted), next(iter(self.servers)))

    # ------------------------------------------------------------------ routes

    @api.get("/health")
    async def health(self) -> dict[str, str]:
        return {"status": "ok"}

    @api.get("/v1/models")
    async def list_models(self, request: Request) -> dict[str, Any]:
        key = await self._caller(request)
        data = [{"id": n, "object": "model", "created": self.started, "owned_by": "otray"} for n in self.servers]
        rm = rm_handle()
        for job in (await rm.servable.remote(key)) if rm is not None else []:
            created = int(job.created or 0)
            data.append({"id": f"job-{job.id}", "object": "model", "created": created, "owned_by": "otray",
                         "root": self._base_for(job.model_path)})
            data += [{"id": f"job-{job.id}:{s}", "object": "model", "created": created, "owned_by": "otray",
                      "root": self._base_for(job.model_path)} for s in job.steps]
        return {"object": "list", "data": data}

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Any:
        return await self._generate(request, chat=False)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Any:
        return await self._generate(request, chat=True)

    async def _body(self, request: Request) -> Any:
        raw = await request.body()
        if len(raw) > self.cfg.max_body_bytes:
            raise APIError(413, f"request body is {len(raw)} bytes; the limit is {self.cfg.max_body_bytes}")
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}") from None
        except (ValueError, RecursionError) as e:  # an integer past 4,300 digits; nesting past the recursion limit
            raise APIError(400, f"the request body is JSON this server does not take ({type(e).__name__}: "
                                f"{str(e)[:200]}); send plain numbers and shallow objects") from None

    async def _prompt_ids(self, req: GenerationRequest, base: str, images: tuple[Image, ...] = ()) -> list[int]:
        tok = self.tokenizers[base]
        chars = sum(len(str(m.get("content") or "")) for m in req.messages) if req.chat else len(req.prompt)
        bound = self.cfg.max_prompt_tokens * self._longest_token(base)
        if chars > bound:  # surely past the limit: refused without tokenizing (a tokenizer pass on ~1 MB takes s)
            raise APIError(400, f"the prompt has {chars} characters, more than {self.cfg.max_prompt_tokens} tokens "
                                f"can hold (at most {bound} characters with this tokenizer): shorten it",
                           param="messages" if req.chat else "prompt", code="context_length_exceeded")
        ids = encode_prompt(tok, req, images)
        if not ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        if base not in self.context:
            self.context[base] = (await self.model_info(base)).max_model_len
        room = self.context[base]
        if len(ids) > self.cfg.max_prompt_tokens or len(ids) + req.max_tokens > room:
            raise APIError(400, f"the prompt has {len(ids)} tokens and asks for max_tokens={req.max_tokens}, but "
                                f"{'the limit is ' + str(self.cfg.max_prompt_tokens) + ' prompt tokens' if len(ids) > self.cfg.max_prompt_tokens else 'the model context is ' + str(room) + ' tokens'}: "
                                "shorten the prompt or lower max_tokens", param="messages" if req.chat else "prompt",
                           code="context_length_exceeded")
        return ids

    def _longest_token(self, base: str) -> int:
        """Characters in the base model's longest token (computed once): a prompt longer than
        ``max_prompt_tokens`` times this cannot fit, whatever the tokenizer does with it."""
        if base not in self.token_chars:
            tok = self.tokenizers[base]
            self.token_chars[base] = max(1, max(len(tok.convert_tokens_to_string([t])) for t in tok.get_vocab()))
        return self.token_chars[base]

    async def _generate(self, request: Request, chat: bool) -> Any:
        from otray.serve.model_server import Job

        key = await self._caller(request)
        req = parse_request(await self._body(request), chat=chat, limits=self.limits)
        base, mux = await self._resolve(req.model, key)
        images = await request_images(req, self.cfg.fetch_image_urls, self.cfg.max_body_bytes)
        ids = await self._prompt_ids(req, base, images)
        params = SamplingParams(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p, seed=req.seed)
        job = Job(ids, params, req.n, req.stop, images)
        if req.stream:
            return StreamingResponse(self._stream(self._token_stream(base, mux, job), req, job),
                                     media_type="text/event-stream")
        try:
            choices = await asyncio.wait_for(self._complete(base, mux, job), self.cfg.request_timeout_s)
        except asyncio.TimeoutError:
            raise APIError(504, f"no answer within request_timeout_s={self.cfg.request_timeout_s}", type="timeout") from None
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001 - a replica's APIError arrives wrapped
            raise _unwrap(e) from None
        return response_body(req, choices, len(ids))

    # ------------------------------------------------------------------ generation, in either layout

    async def model_info(self, base: str) -> "ReplicaInfo":
        """What the base model's replica reports (``ModelServer.info``), in either layout; for
        benchmarks and operators through a deployment handle, not an HTTP route."""
        return self.local[base].info() if base in self.local else await self.servers[base].info.remote()

    def _handle(self, base: str, mux: str) -> Any:
        return self.servers[base].options(multiplexed_model_id=mux) if mux else self.servers[base]

    async def _checkpoint(self, base: str, mux: str) -> Any:
        """In-process layout: the base model, or checkpoint ``mux`` (loaded once, least recently used dropped)."""
        server, cache = self.local[base], self.checkpoints[base]
        if not mux:
            return server.base
        task = cache.pop(mux, None)
        if task is None:
            task = asyncio.ensure_future(asyncio.to_thread(server.load_checkpoint, mux))
        cache[mux] = task
        while len(cache) > server.spec.max_loaded_checkpoints:
            cache.popitem(last=False)  # requests still using it hold it; its files go when they finish
        try:
            return await asyncio.shield(task)
        except BaseException:
            if cache.get(mux) is task and task.done():
                del cache[mux]  # a failed load is not cached
            raise

    async def _complete(self, base: str, mux: str, job: Any) -> Any:
        if base in self.local:
            server = self.local[base]
            return await server.in_thread(server.complete, await self._checkpoint(base, mux), job)
        return await self._handle(base, mux).generate.remote(job)

    async def _token_stream(self, base: str, mux: str, job: Any):
        if base in self.local:
            server = self.local[base]
            async for item in server.stream(await self._checkpoint(base, mux), job):
                yield item
        else:
            async for item in self._handle(base, mux).options(stream=True).generate_stream.remote(job):
                yield item

    async def _stream(self, gen: Any, req: GenerationRequest, job: Any):
        rid, created, first = new_id(req.chat), int(time.time()), set()
        tokens: dict[int, int] = {}
        try:
            while True:
                try:
                    index, text, finish, count = await asyncio.wait_for(gen.__anext__(), self.cfg.request_timeout_s)
                except StopAsyncIteration:
                    break
                tokens[index] = count
                yield sse(chunk_body(req, rid, created, index, text, finish, first=index not in first))
                first.add(index)
        except asyncio.TimeoutError:
            yield sse(APIError(504, f"no tokens within request_timeout_s={self.cfg.request_timeout_s}",
                               type="timeout").body())
        except Exception as e:  # noqa: BLE001 - the status line is sent already: report in the stream
            yield sse(_unwrap(e).body())
        if req.include_usage:
            yield sse({"id": rid, "object": "chat.completion.chunk" if req.chat else "text_completion",
                       "created": created, "model": req.model, "choices": [],
                       "usage": usage(len(job.prompt_ids), sum(tokens.values()))})
        yield sse("[DONE]")


def single_layout(cfg: ServeConfig) -> bool:
    return cfg.layout == "single" or (cfg.layout == "auto" and len(cfg.models) == 1)


def _replica_options(m: Any) -> dict[str, Any]:
    """Resources, threads and replica count of a deployment that holds base model ``m``."""
    scaling = ({"autoscaling_config": dict(m.autoscaling)} if m.autoscaling else {"num_replicas": m.num_replicas})
    threads = m.num_threads or max(1, int(m.replica_cpus))
    return {"ray_actor_options": {"num_cpus": m.replica_cpus, "num_gpus": m.replica_gpus,
                                  **threads_env(threads, m.replica_cpus)}, **scaling}


def build(cfg: ServeConfig, ray_dashboard: str | None = None) -> Any:
    """The bound application: the Gateway, and in the split layout one ModelServer deployment
    per base model behind it; in the single layout the Gateway holds the model itself."""
    from otray.serve.model_server import serve_class

    if single_layout(cfg):
        m = cfg.models[0]
        return Gateway.options(max_ongoing_requests=cfg.max_ongoing_requests, **_replica_options(m)).bind(
            to_dict(cfg), {m.name: None}, ray_dashboard)
    servers = {}
    for m in cfg.models:
        dep = serve.deployment(serve_class(m.max_loaded_checkpoints), name=f"model-{m.name}")
        servers[m.name] = dep.options(max_ongoing_requests=m.max_ongoing_requests, **_replica_options(m)).bind(
            m, cfg.cache_dir, cfg.stream_chunk_tokens)
    return Gateway.options(max_ongoing_requests=cfg.max_ongoing_requests).bind(to_dict(cfg), servers, ray_dashboard)


def run(cfg: ServeConfig, *, blocking: bool = False) -> Any:
    """Start Serve on the connected Ray cluster at ``cfg.host:cfg.port`` and deploy the app."""
    try:
        from ray._private.worker import get_dashboard_url  # not public API: only for the link

        url = get_dashboard_url() or None
    except Exception:  # noqa: BLE001 - no dashboard, or the private API moved
        url = None
    serve.start(http_options={"host": cfg.host, "port": cfg.port})
    return serve.run(build(cfg, url and (url if url.startswith("http") else f"http://{url}")), name=APP_NAME,
                     route_prefix="/", blocking=blocking)
