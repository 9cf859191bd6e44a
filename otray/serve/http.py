"""The FastAPI object behind the Gateway, its OpenAI-style error handlers, the ResourceManager lookup."""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from otray.serve.openai_api import APIError

api = FastAPI(title="otray", docs_url=None, redoc_url=None)


@api.exception_handler(APIError)
async def _api_error(_: Request, e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


@api.exception_handler(RequestValidationError)
async def _bad_params(_: Request, e: RequestValidationError) -> JSONResponse:
    """FastAPI's own checks (query parameters) in OpenAI's error shape, as a 400."""
    first = (e.errors() or [{}])[0]
    where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
    return JSONResponse(APIError(400, f"{where or 'request'}: {first.get('msg', 'invalid')}",
                                 param=where).body(), status_code=400)


@api.exception_handler(404)
async def _not_found(request: Request, _: Exception) -> JSONResponse:
    return JSONResponse(APIError(404, f"no route {request.method} {request.url.path}").body(), status_code=404)


@api.exception_handler(405)
async def _bad_method(request: Request, _: Exception) -> JSONResponse:
    return JSONResponse(APIError(405, f"{request.method} is not allowed on {request.url.path}").body(), status_code=405)


_RM: list[Any] = [None, 0.0]  # (handle or None, time it expires)


def rm_handle() -> Any:
    """The cluster's ResourceManager, or None without one. Looked up at most every few
    seconds (a lookup is a GCS round trip; requests would pay it each time)."""
    import ray

    from otray.actors.control.resource_manager import NAME, NAMESPACE

    now = time.monotonic()
    if now < _RM[1]:
        return _RM[0]
    try:
        handle = ray.get_actor(NAME, namespace=NAMESPACE)
    except ValueError:
        handle = None
    _RM[:] = [handle, now + (10.0 if handle is not None else 2.0)]
    return handle


