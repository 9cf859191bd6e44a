"""The Tinker API over HTTP: a Ray Serve deployment (FastAPI ingress) in front of the
:class:`~otray.tinker.service.tinker_service.TinkerService` actor.

Every route is under ``/api/v1``, as the ``tinker`` SDK calls it. The key arrives as
``X-API-Key``; with auth on it must be a ``tml-`` key from ``otray users add`` (the same secret
as the user's ``otr_`` key) and the caller's user name goes with every service call; with auth
off every caller is ``local``. Bodies are JSON except ``forward_backward`` (protobuf); answers are JSON
except ``retrieve_future``'s training and sampling results, protobuf when ``Accept`` names it (the SDK
does) and their JSON form otherwise (:mod:`otray.tinker.wire.json_answers`). A
request the service cannot use gets a 4xx whose ``detail`` says why; a failure inside a
request the service accepted comes back from ``retrieve_future`` as a failed promise with a
``user`` or ``server`` category. Nothing a client sends gives a 5xx: the SDK would retry it.

Runs in the gateway's Ray Serve replica."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve

from otray.tinker.service import catalog as R
from otray.tinker.service import tokens
from otray.tinker.gateway.callers import Callers
from otray.tinker.errors import unwrap as _unwrap
from otray.tinker.config import client_config
from otray.tinker.wire import requests as Q
from otray.tinker.wire.json_answers import PROTO, proto_as_json, wants_proto
from otray.tinker.wire.messages import check_request_fields
from otray.tinker.errors import UserError

APP_NAME = "otray-tinker"
tinker_api = FastAPI(title="otray tinker", docs_url=None, redoc_url=None)
ROUTE_PREFIX = "/api/v1"  # the routes below are under it; otray serve's app may share the port at "/"


@tinker_api.exception_handler(UserError)
async def _user_error(_: Request, e: UserError) -> JSONResponse:
    # RFC 6750: the SDK answers a 401 marked invalid_token by exchanging its key for a new JWT
    headers = {"WWW-Authenticate": 'Bearer error="invalid_token"'} if isinstance(e, tokens.BadToken) else None
    return JSONResponse({"detail": str(e), "category": "user"}, status_code=e.status, headers=headers)


@tinker_api.exception_handler(404)
async def _no_route(request: Request, e: Exception) -> JSONResponse:
    detail = getattr(e, "detail", None)
    if isinstance(detail, str) and detail != "Not Found":  # a route's own 404 (an HTTPException with a reason)
        return JSONResponse({"detail": detail}, status_code=404)
    return JSONResponse({"detail": f"no route {request.method} {request.url.path} (not served by otray tinker: "
                                   "docs/tinker_compat.md)"}, status_code=404)


@tinker_api.exception_handler(405)
async def _no_method(request: Request, _: Exception) -> JSONResponse:
    return JSONResponse({"detail": f"no route {request.method} {request.url.path} (not served by otray tinker: "
                                   "docs/tinker_compat.md)"}, status_code=405)


async def _json(request: Request, limit: int) -> dict[str, Any]:
    body = await request.body()
    if len(body) > limit:
        raise UserError(f"request body of {len(body)} bytes is over the limit of {limit}", 413)
    try:
        import json

        data = json.loads(body or b"{}")
    except ValueError:
        raise UserError("the request body is not JSON") from None
    except RecursionError:
        raise UserError("the request body nests too deeply; send a flat JSON object") from None
    if not isinstance(data, dict):
        raise UserError("the request body must be a JSON object")
    check_request_fields(data)
    return data


def _page(limit: int, offset: int) -> None:
    if not 1 <= limit <= 1000 or offset < 0:
        raise UserError("limit must be 1 to 1000 and offset >= 0")


def _need(data: dict[str, Any], *keys: str) -> None:
    missing = [k for k in keys if data.get(k) in (None, "")]
    if missing:
        raise UserError(f"missing field(s) {missing}")


async def _served(ref: Any) -> Any:
    """A TinkerService call's answer; its UserError as itself, any other failure as a 500 saying what failed."""
    try:
        return await ref
    except Exception as e:  # noqa: BLE001 - a UserError from the service, or the service failed
        inner = _unwrap(e)
        if isinstance(inner, UserError):
            raise inner from None
        raise UserError(f"the Tinker service failed: {str(inner).strip().splitlines()[-1][:500]}", 500) from None


async def _no_content(call: Any) -> Response:
    """A call's 204 once it is done."""
    await call
    return Response(status_code=204)


def _copy_query(data: dict[str, Any], request: Request) -> R.CopyWeights:
    """A ``copy_weights`` body: into a session's ``model_seq_id`` slot, or a fresh run id."""
    _need(data, "source_path")
    if request.headers.get("x-tinker-weights-access-token"):
        raise UserError("weights access tokens are not used here: ask the checkpoint's owner to publish it "
                        "(RestClient.publish_checkpoint_from_tinker_path), then copy it by its path")
    session = data.get("session_id")
    if session is not None and data.get("model_seq_id") is None:
        raise UserError("copy_weights with a session_id needs its model_seq_id too")
    model_id = f"{session}:train:{data['model_seq_id']}" if session else f"c-{uuid.uuid4().hex[:16]}:train:0"
    return R.CopyWeights(data["source_path"], model_id, session, data.get("ttl_seconds"),
                         data.get("destination_project_id"), request.headers.get("x-idempotency-key"))


@serve.deployment(name="TinkerGateway", num_replicas=1, max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0})
@serve.ingress(tinker_api)
class TinkerGateway:
    """``otray tinker``'s HTTP ingress (a Ray Serve replica, routes under ``/api/v1``): it parses each JSON body
    into its dataclass (``wire.requests``; forward_backward's protobuf goes on as bytes), finds the caller
    (key or JWT), and forwards each call to the TinkerService actor it starts (or finds), answering in the
    SDK's formats."""

    def __init__(self, cfg: dict[str, Any]):
        import ray

        from otray.tinker.config import load_tinker
        from otray.tinker.service.tinker_service import NAME, NAMESPACE, TinkerService

        self.cfg = load_tinker(cfg)
        self.service = ray.remote(TinkerService).options(
            name=NAME, namespace=NAMESPACE, get_if_exists=True, lifetime="detached", num_cpus=0,
            max_concurrency=1000, max_restarts=-1).remote(cfg)
        self.callers = Callers(self.cfg, self.service)

    async def _owner(self, request: Request) -> str:
        return await self.callers.owner(request.headers.get("x-api-key") or "")

    async def _call(self, request: Request, method: Any, *args: Any) -> Any:
        """``method`` (a TinkerService actor method, e.g. ``self.service.heartbeat``) for the caller."""
        return await _served(method.remote(await self._owner(request), *args))

    # ------------------------------------------------------------------ handshake and sessions

    @tinker_api.get("/healthz")
    async def healthz(self) -> dict[str, str]:
        return {"status": "ok"}

    @tinker_api.post("/client/config")
    async def client_config(self, request: Request) -> dict[str, Any]:
        await self._owner(request)
        return client_config(self.cfg, str((await _json(request, self.cfg.max_body_bytes)).get("sdk_version") or ""))

    @tinker_api.post("/auth/token")
    async def auth_token(self, request: Request) -> dict[str, str]:
        """A JWT for the caller's key (a JWT cannot be exchanged for another: send the key)."""
        if not self.cfg.jwt_auth:
            raise UserError("JWT auth is off on this service (jwt_auth: false); send the tml- key itself", 404)
        key = request.headers.get("x-api-key") or ""
        if tokens.looks_like_jwt(key):
            raise UserError("exchange the tml- API key for a JWT, not a JWT", 401)
        return {"jwt": await self.service.mint_token.remote(*await self.callers.minted(key), key)}

    @tinker_api.post("/client/dynamic_config")
    async def dynamic_config(self, request: Request) -> dict[str, Any]:
        await self._owner(request)
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": True}  # abandoned samples: cancel_future

    @tinker_api.post("/telemetry")
    async def telemetry(self) -> dict[str, str]:
        return {"status": "accepted"}

    @tinker_api.post("/create_session")
    async def create_session(self, request: Request) -> dict[str, Any]:
        return {"type": "create_session", "session_id": await self._post(request, self.service.create_session,
                                                                          Q.CreateSession)}

    @tinker_api.post("/session_heartbeat")
    async def heartbeat(self, request: Request) -> dict[str, Any]:
        await self._post(request, self.service.heartbeat, Q.Heartbeat)
        return {"type": "session_heartbeat"}

    @tinker_api.post("/sessions/{session_id}/finish")
    async def finish(self, session_id: str, request: Request) -> Response:
        body = Q.FinishSession.of(await _json(request, self.cfg.max_body_bytes))  # kept as the session's status
        return await _no_content(self._call(request, self.service.finish_session, session_id, body))

    @tinker_api.get("/get_server_capabilities")
    async def capabilities(self, request: Request) -> dict[str, Any]:
        return await self._call(request, self.service.capabilities)

    # ------------------------------------------------------------------ models and training

    async def _post(self, request: Request, method: Any, body: type[Q.Body], extra: tuple = ()) -> Any:
        """``method`` for the caller with the request's JSON parsed into ``body`` (``wire.requests``)."""
        return await self._call(request, method, body.of(await _json(request, self.cfg.max_body_bytes)), *extra)

    @tinker_api.post("/create_model")
    async def create_model(self, request: Request) -> dict[str, Any]:
        return await self._post(request, self.service.create_model, Q.CreateModel,
                                extra=(request.headers.get("x-api-key"),))  # the lease is opened with it

    @tinker_api.post("/create_custom_loss")
    async def create_custom_loss(self, request: Request) -> dict[str, Any]:  # custom_losses.py
        return await self._post(request, self.service.create_custom_loss, Q.CreateCustomLoss)

    @tinker_api.post("/get_info")
    async def get_info(self, request: Request) -> dict[str, Any]:
        return await self._post(request, self.service.get_info, Q.GetInfo)

    @tinker_api.post("/forward_backward")
    async def forward_backward(self, request: Request) -> dict[str, Any]:
        if PROTO not in request.headers.get("content-type", ""):
            raise UserError(f"forward_backward takes a protobuf body (Content-Type: {PROTO}); tinker SDK >= 0.25 sends one", 415)
        body = await request.body()
        if len(body) > self.cfg.max_body_bytes:
            raise UserError(f"request body of {len(body)} bytes is over the limit of {self.cfg.max_body_bytes}", 413)
        return await self._call(request, self.service.forward_backward, body)

    @tinker_api.post("/optim_step")
    async def optim_step(self, request: Request) -> dict[str, Any]:
        return await self._post(request, self.service.optim_step, Q.OptimStep)

    @tinker_api.post("/save_weights")
    async def save_weights(self, request: Request) -> dict[str, Any]:
        return await self._post(request, self.service.save_weights, Q.SaveWeights, extra=("training",))

    @tinker_api.post("/save_weights_for_sampler")
    async def save_weights_for_sampler(self, request: Request) -> dict[str, Any]:
        return await self._post(request, self.service.save_weights, Q.SaveWeights, extra=("sampler",))

    @tinker_api.post("/save_weights_external")
    async def save_weights_external(self, request: Request) -> dict[str, Any]:
        return await self._post(request, self.service.save_weights, Q.SaveWeights, extra=("external",))

    @tinker_api.get("/training_runs/{model_id}/checkpoints/{segment}/{name}/external_weights_urls")
    async def external_weights_urls(self, model_id: str, segment: str, name: str, request: Request) -> dict[str, Any]:
        """One signed URL per file of an export (``<this service>/api/v1/external_weights/<token>``)."""
        got = await self._call(request, self.service.rest, R.ExternalUrls(model_id, f"{segment}/{name}"))
        base = f"{request.url.scheme}://{request.url.netloc}{ROUTE_PREFIX}/external_weights/"
        return {"urls": {f: base + token for f, token in got["files"].items()},
                "expires": dt.datetime.fromtimestamp(got["expires"], dt.timezone.utc).isoformat()}

    @tinker_api.get("/external_weights/{token}")
    async def external_weights_file(self, token: str) -> Response:
        """A signed URL's file: no API key (the token is the grant, for one file, until it expires)."""
        return Response(await _served(self.service.external_file.remote(token)), media_type="application/octet-stream")

    @tinker_api.post("/copy_weights")
    async def copy_weights(self, request: Request) -> dict[str, Any]:
        """A checkpoint copied into a new run of the caller's (Catalog.copy); answered at once, not as a promise."""
        q = _copy_query(await _json(request, self.cfg.max_body_bytes), request)
        return await self._call(request, self.service.copy_weights, q)

    @tinker_api.post("/merge_weights")
    async def merge_weights(self, request: Request) -> dict[str, Any]:  # otray's own (no SDK call): merge.py
        return await self._post(request, self.service.merge_weights, Q.MergeWeights)

    @tinker_api.get("/billing/usage/checkpoints/current")
    async def storage_usage(self, request: Request) -> dict[str, Any]:  # no billing: the caller's bytes, no cost
        return await self._call(request, self.service.rest, R.StorageUsage())

    @tinker_api.post("/load_weights")
    async def load_weights(self, request: Request) -> dict[str, Any]:
        return await self._post(request, self.service.load_weights, Q.LoadWeights, extra=(request.headers.get("x-api-key"),))

    # ------------------------------------------------------------------ sampling

    @tinker_api.post("/create_sampling_session")
    async def create_sampling_session(self, request: Request) -> dict[str, Any]:
        sid = await self._post(request, self.service.create_sampling_session, Q.CreateSamplingSession)
        return {"type": "create_sampling_session", "sampling_session_id": sid}

    @tinker_api.get("/samplers/{sampler_id}")
    async def sampler(self, sampler_id: str, request: Request) -> dict[str, Any]:
        return await self._call(request, self.service.rest, R.SamplerView(sampler_id))

    @tinker_api.post("/join_sampling_session")
    async def join_sampling_session(self, request: Request) -> dict[str, Any]:  # a copied sampling client's number
        data = await _json(request, self.cfg.max_body_bytes)  # a missing id: a 400 from Catalog.answer
        return await self._call(request, self.service.rest, R.JoinSampler(data.get("sampling_session_id")))

    @tinker_api.post("/asample")
    async def asample(self, request: Request) -> dict[str, Any]:
        return await self._post(request, self.service.asample, Q.ASample)

    @tinker_api.post("/retrieve_futures")
    async def retrieve_futures(self, request: Request) -> dict[str, Any]:
        return await self._post(request, self.service.retrieve_futures, Q.RetrieveFutures)

    @tinker_api.post("/cancel_future")
    async def cancel_future(self, request: Request) -> dict[str, Any]:
        return await self._post(request, self.service.cancel_future, Q.CancelFuture)

    @tinker_api.post("/retrieve_future")
    async def retrieve_future(self, request: Request) -> Response:
        data = await _json(request, self.cfg.max_body_bytes)
        _need(data, "request_id")
        outcome = await self._call(request, self.service.retrieve, data["request_id"])
        if outcome is None:
            return JSONResponse({"type": "try_again", "request_id": data["request_id"], "queue_state": "active"})
        if outcome.kind == "proto":  # protobuf when asked for (the SDK), else its JSON form (curl, other clients)
            if wants_proto(request.headers.get("accept", "")):
                return Response(outcome.body, media_type=PROTO)
            return JSONResponse(proto_as_json(outcome.body, outcome.message))
        return JSONResponse(outcome.body)

    # ------------------------------------------------------------------ runs and checkpoints (REST)

    @tinker_api.get("/training_runs")
    async def training_runs(self, request: Request, limit: int = 20, offset: int = 0) -> dict[str, Any]:
        _page(limit, offset)
        return await self._call(request, self.service.rest, R.RunsView(limit, offset))

    @tinker_api.get("/training_runs/{model_id}")
    async def training_run(self, model_id: str, request: Request) -> dict[str, Any]:
        return await self._call(request, self.service.rest, R.RunView(model_id))

    @tinker_api.get("/training_runs/{model_id}/checkpoints")
    async def checkpoints(self, model_id: str, request: Request) -> dict[str, Any]:
        return {"checkpoints": await self._call(request, self.service.rest, R.CheckpointsView(model_id))}

    # a checkpoint id is "<weights|sampler_weights|external_weights>/<name>": two path segments (no "/" in names)
    @tinker_api.delete("/training_runs/{model_id}/checkpoints/{segment}/{name}")
    async def delete_checkpoint(self, model_id: str, segment: str, name: str, request: Request) -> Response:
        return await _no_content(self._call(request, self.service.rest, R.DeleteCheckpoint(model_id, f"{segment}/{name}")))

    @tinker_api.get("/checkpoints")
    async def user_checkpoints(self, request: Request, limit: int = 100, offset: int = 0) -> dict[str, Any]:
        _page(limit, offset)
        return await self._call(request, self.service.rest, R.UserCheckpointsView(limit, offset))

    @tinker_api.api_route("/training_runs/{model_id}/checkpoints/{segment}/{name}/publish", methods=["POST", "DELETE"])
    async def publish(self, model_id: str, segment: str, name: str, request: Request) -> Response:  # DELETE: unpublish
        q = R.Publish(model_id, f"{segment}/{name}", request.method == "POST")
        return await _no_content(self._call(request, self.service.rest, q))

    @tinker_api.put("/training_runs/{model_id}/checkpoints/{segment}/{name}/ttl")
    async def set_ttl(self, model_id: str, segment: str, name: str, request: Request) -> Response:
        ttl = (await _json(request, self.cfg.max_body_bytes)).get("ttl_seconds")
        return await _no_content(self._call(request, self.service.rest, R.SetTtl(model_id, f"{segment}/{name}", ttl)))

    @tinker_api.get("/sessions")
    async def sessions(self, request: Request, limit: int = 20, offset: int = 0) -> dict[str, Any]:
        _page(limit, offset)
        return await self._call(request, self.service.rest, R.SessionsView(limit, offset))

    @tinker_api.get("/sessions/{session_id}")
    async def session(self, session_id: str, request: Request) -> dict[str, Any]:
        return await self._call(request, self.service.rest, R.SessionView(session_id))

    @tinker_api.post("/sessions/search")
    async def search_sessions(self, request: Request) -> dict[str, Any]:  # session_search.py
        q = R.SessionSearch(Q.SearchSessions.of(await _json(request, self.cfg.max_body_bytes)))
        return await self._call(request, self.service.rest, q)

    @tinker_api.put("/sessions/{session_id}/project")
    async def assign_project(self, session_id: str, request: Request) -> Response:  # a label: otray has no projects
        data = await _json(request, self.cfg.max_body_bytes)
        return await _no_content(self._call(request, self.service.rest, R.SessionProject(session_id, data.get("project_id"))))

    @tinker_api.get("/sessions/{session_id}/trace_export")
    async def trace_export(self, session_id: str, request: Request) -> dict[str, Any]:  # built at once, URL signed
        token = await self._call(request, self.service.rest, R.TraceExport(session_id))
        return {"status": "ready", "url": f"{request.url.scheme}://{request.url.netloc}{ROUTE_PREFIX}/traces/{token}"}

    @tinker_api.get("/traces/{token}")
    async def trace_file(self, token: str) -> Response:  # the token is the grant: no key
        return Response(await _served(self.service.external_file.remote(token)), media_type="application/json")

    @tinker_api.post("/weights_info")
    async def weights_info(self, request: Request) -> dict[str, Any]:
        data = await _json(request, self.cfg.max_body_bytes)
        _need(data, "tinker_path")
        return await self._call(request, self.service.rest, R.WeightsInfoView(data["tinker_path"]))


def run(cfg: Any, *, blocking: bool = False) -> Any:
    """Start Serve at ``cfg.host:cfg.port`` on the connected cluster and deploy the Tinker app."""
    from otray.structured import to_dict

    from otray.tinker.gateway.oai import OAI_PREFIX, TinkerOpenAI

    serve.start(http_options={"host": cfg.host, "port": cfg.port})
    handle = serve.run(TinkerGateway.bind(to_dict(cfg)), name=APP_NAME, route_prefix=ROUTE_PREFIX)
    serve.run(TinkerOpenAI.bind(to_dict(cfg)), name=f"{APP_NAME}-openai", route_prefix=OAI_PREFIX, blocking=blocking)
    return handle
