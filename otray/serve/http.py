"""The FastAPI object behind the Gateway, its OpenAI-style error handlers, the ResourceManager lookup."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from otray.serve.openai_api import APIError

api = FastAPI(title="otray", docs_url=None, redoc_url=None)


@api.exception_handler(APIError)
async def _api_error(_: Request, e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


@api.exception_handler(404)
async def _not_found(request: Request, _: Exception) -> JSONResponse:
    return JSONResponse(APIError(404, f"no route {request.method} {request.url.path}").body(), status_code=404)


@api.exception_handler(405)
async def _bad_method(request: Request, _: Exception) -> JSONResponse:
    return JSONResponse(APIError(405, f"{request.method} is not allowed on {request.url.path}").body(), status_code=405)


def rm_handle() -> Any:
    import ray

    from otray.actors.resource_manager import NAME, NAMESPACE

    try:
        return ray.get_actor(NAME, namespace=NAMESPACE)
    except ValueError:
        return None


