"""OpenAI-compatible inference over the Tinker service's models and ``tinker://`` checkpoints.

Tinker offers ``<service>/oai/api/v1`` with ``/completions`` and ``/chat/completions`` (and ``/models``):
point any OpenAI client there with a Tinker API key, and set ``model`` to a base model's name, a
sampler checkpoint's path (``tinker://<run>/sampler_weights/<name>``, sampled on the base it was
trained on) or ``<base>;<path>``. It is meant for poking at a model while it trains.

Here it is a thin front over what the SDK's sampling already uses: the request is parsed and checked by
``otray serve``'s own OpenAI code (:mod:`otray.serve.openai_api`: the same fields, limits and error
bodies), the prompt is the base model's chat template (or the completion text) tokenized here, and the
tokens go to the service's ``asample`` as one Tinker sample request: the same owner checks, batching
with other users' requests, learner or vLLM samplers, quotas. Stop strings cut the text as in
``otray serve``. ``stream: true`` is answered as one chunk per choice (the sampler returns whole
sequences). Images are refused (use the SDK's ``ImageChunk``).

Runs in its own Ray Serve replica (the ``TinkerOpenAI`` deployment)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve

from otray.serve.openai_api import APIError, Choice, GenerationRequest, Limits, apply_stop, chunk_body, new_id
from otray.serve.openai_api import parse_request, response_body, sse
from otray.tinker.gateway.callers import Callers
from otray.tinker.errors import unwrap
from otray.tinker.wire.messages import pb
from otray.tinker.errors import UserError
from otray.tinker.wire.requests import ASample

OAI_PREFIX = "/oai/api/v1"
oai_api = FastAPI(title="otray tinker (OpenAI-compatible)")


@oai_api.exception_handler(APIError)
async def _api_error(_: Request, e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def api_error(e: BaseException) -> APIError:
    """A service error as OpenAI's error body (a UserError keeps its status)."""
    inner = unwrap(e)
    if isinstance(inner, APIError):
        return inner
    if isinstance(inner, UserError):
        return APIError(inner.status, str(inner), type="invalid_request_error" if inner.status < 500 else "server_error")
    return APIError(500, f"the Tinker service failed: {str(inner).strip().splitlines()[-1][:300]}", type="server_error")


def split_model(model: str, bases: list[str]) -> tuple[str | None, str | None]:
    """``model`` as (base name or None, checkpoint path or None): a base, a ``tinker://`` path or ``base;path``."""
    base, _, path = model.partition(";") if ";" in model else ("", "", model)
    if not path.startswith("tinker://"):
        base, path = path, ""
    if base and base not in bases:
        raise APIError(404, f"model {base!r} is not offered here; GET {OAI_PREFIX}/models lists the base models "
                            "(or send a tinker://.../sampler_weights/... path)", param="model", code="model_not_found")
    if path and "/sampler_weights/" not in path:
        raise APIError(400, f"{path!r}: send a sampler checkpoint's path (tinker://<run>/sampler_weights/<name>, "
                            "from save_weights_for_sampler)", param="model")
    return base or None, path or None


def _weights_info(path: str) -> Any:
    from otray.tinker.service.catalog import WeightsInfoView

    return WeightsInfoView(path)


async def _stream(req: GenerationRequest, choices: list[Choice], prompt_tokens: int):
    rid, created = new_id(req.chat), int(time.time())
    for i, c in enumerate(choices):
        yield sse(chunk_body(req, rid, created, i, c.text, None, first=True))
        yield sse(chunk_body(req, rid, created, i, None, c.finish_reason))
        await asyncio.sleep(0)
    if req.include_usage:
        from otray.serve.openai_api import usage

        yield sse({"id": rid, "object": "chat.completion.chunk" if req.chat else "text_completion", "created": created,
                   "model": req.model, "choices": [], "usage": usage(prompt_tokens, sum(c.completion_tokens for c in choices))})
    yield sse("[DONE]")


@serve.deployment(name="TinkerOpenAI", num_replicas=1, max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0})
@serve.ingress(oai_api)
class TinkerOpenAI:
    def __init__(self, cfg: dict[str, Any]):
        from otray.models import resolve_model_path
        from otray.tinker.config import load_tinker

        self.cfg = load_tinker(cfg)
        self.paths = {m.name: resolve_model_path(m.path, self.cfg.cache_dir) for m in self.cfg.models}
        self.limits = Limits(max_tokens=self.cfg.max_tokens, max_n=self.cfg.max_samples)
        self.tokenizers: dict[str, Any] = {}
        self._service: Any = None
        self._callers: Any = None  # one Callers: its auth answer and JWT secret are cached

    @property
    def service(self) -> Any:
        import ray

        from otray.tinker.service.tinker_service import NAME, NAMESPACE

        if self._service is None:  # the TinkerGateway makes it; this app only finds it
            self._service = ray.get_actor(NAME, namespace=NAMESPACE)
        return self._service

    async def _owner(self, request: Request) -> str:
        auth = request.headers.get("authorization") or ""
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else request.headers.get("x-api-key") or ""
        if self._callers is None:
            self._callers = Callers(self.cfg, self.service)
        try:
            return await self._callers.owner(key)
        except Exception as e:  # noqa: BLE001 - a wrong key is a 401 in OpenAI's shape
            raise api_error(e) from None

    def _tokenizer(self, base: str) -> Any:
        from otray.models import load_tokenizer

        if base not in self.tokenizers:
            self.tokenizers[base] = load_tokenizer(self.paths[base])
        return self.tokenizers[base]

    @oai_api.get("/models")
    async def models(self, request: Request) -> dict[str, Any]:
        await self._owner(request)
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "otray"}
                                           for name in self.paths]}

    @oai_api.post("/completions")
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    @oai_api.post("/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, chat: bool) -> Response:
        owner = await self._owner(request)
        try:
            body = await request.json()
        except ValueError:
            raise APIError(400, "the request body is not JSON") from None
        req = parse_request(body, chat=chat, limits=self.limits)
        if req.images:
            raise APIError(400, "images are not taken here; send them with the tinker SDK (ImageChunk)", param="messages")
        base, path = split_model(req.model, list(self.paths))
        if base is None:
            try:
                base = (await self.service.rest.remote(owner, _weights_info(path)))["base_model"]
            except Exception as e:  # noqa: BLE001
                raise api_error(e) from None
        tok = self._tokenizer(base)
        from otray.models import chat_prompt_ids

        ids = chat_prompt_ids(tok, req.messages) if chat else tok.encode(req.prompt, add_special_tokens=False)
        choices = await self._sample(owner, base, path, ids, req, tok)
        if not req.stream:
            return JSONResponse(response_body(req, choices, len(ids)))
        return StreamingResponse(_stream(req, choices, len(ids)), media_type="text/event-stream")

    async def _sample(self, owner: str, base: str, path: str | None, ids: list[int], req: GenerationRequest,
                      tok: Any) -> list[Choice]:
        """One Tinker sample request for ``req``'s ``n`` completions, waited for; its texts cut at the stops."""
        params = {"max_tokens": req.max_tokens, "temperature": req.temperature, "top_p": req.top_p, "seed": req.seed,
                  **({"stop": req.stop} if req.stop else {})}
        ask = ASample({"chunks": [{"type": "encoded_text", "tokens": ids}]}, params, num_samples=req.n,
                      model_path=path, base_model=None if path else base)
        try:
            rid = (await self.service.asample.remote(owner, ask))["request_id"]
            outcome = None
            while outcome is None:
                outcome = await self.service.retrieve.remote(owner, rid)
        except Exception as e:  # noqa: BLE001
            raise api_error(e) from None
        if outcome.kind == "error":
            status = 400 if outcome.body.get("category") == "user" else 500
            raise APIError(status, outcome.body["error"], type="invalid_request_error" if status == 400 else "server_error")
        p = pb()
        msg = p.SampleResponse()
        msg.ParseFromString(outcome.body)
        out = []
        for seq in msg.sequences:
            tokens = np.frombuffer(seq.tokens, dtype=np.int32).tolist()
            text, stopped = apply_stop(tok.decode(tokens, skip_special_tokens=True), req.stop)
            finish = "stop" if stopped or seq.stop_reason == p.STOP_REASON_STOP else "length"
            out.append(Choice(text, finish, len(tokens)))
        return out
