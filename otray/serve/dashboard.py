"""The jobs dashboard at ``/dashboard`` and the JSON API behind it, on the Gateway.

``/api/jobs`` (state, owner, progress, latest reward and eval accuracy),
``/api/jobs/{id}`` (+ ``/metrics``, ``/episodes?step=``, ``/checkpoints``) and
``POST /api/jobs/{id}/cancel`` answer with the caller's rights (the same Bearer key as
``/v1``; admins see every job). The page (``otray/serve/static``) is plain HTML, CSS and
JavaScript served from here: no CDN, no build step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import Query, Request
from fastapi.responses import FileResponse, HTMLResponse

from otray import metric_keys as K
from otray.serve.http import api, rm_handle
from otray.serve.openai_api import APIError

STATIC = Path(__file__).resolve().parent / "static"
ASSETS = {"app.js": "text/javascript", "style.css": "text/css"}
MAX_INDEX = 2**62  # query indexes past SQLite's 64-bit integers are a 400, not a 500


def _cause(e: BaseException) -> BaseException:
    return getattr(e, "cause", None) or e


async def rm_call(method: Any, job_id: str, *args: Any) -> Any:
    """Call a ResourceManager method about ``job_id``. Another user's job and a job that does not
    exist get the same 404 (no existence oracle); a dead manager is a 503."""
    try:
        return await method.remote(job_id, *args)
    except Exception as e:  # noqa: BLE001 - Ray wraps the actor's exception
        cause = _cause(e)
        if isinstance(cause, (PermissionError, KeyError)):  # AuthError (not yours) or unknown id / step
            raise APIError(404, f"no job {job_id!r} of yours with that (list yours at GET /api/jobs)",
                           type="not_found", code="job_not_found") from None
        raise APIError(503, f"the ResourceManager did not answer ({type(cause).__name__}); try again",
                       type="server_error", code="service_unavailable") from None


class DashboardRoutes:
    """Mixed into the Gateway deployment (which provides ``_caller`` and ``cfg``)."""

    def _rm(self) -> Any:
        rm = rm_handle()
        if rm is None:
            raise APIError(503, "no ResourceManager on this cluster: start one with `otray train` or otray.connect()",
                           type="server_error")
        return rm

    @api.get("/dashboard", response_class=HTMLResponse)
    async def dashboard(self) -> HTMLResponse:
        return HTMLResponse((STATIC / "index.html").read_text())

    @api.get("/dashboard/{name}")
    async def dashboard_asset(self, name: str) -> FileResponse:
        if name not in ASSETS:
            raise APIError(404, f"no dashboard asset {name!r}")
        return FileResponse(STATIC / name, media_type=ASSETS[name])

    @api.get("/api/info")
    async def info(self) -> dict[str, Any]:
        return {"auth": await self._auth_on(), "ray_dashboard": self.ray_dashboard,
                "models": [m.name for m in self.cfg.models], "resource_manager": rm_handle() is not None,
                "metric_keys": K.for_dashboard()}

    @api.get("/api/jobs")
    async def jobs(self, request: Request) -> list[dict[str, Any]]:
        key = await self._caller(request)
        try:
            jobs = await self._rm().jobs.remote(key)
        except Exception as e:  # noqa: BLE001 - the manager died or is restarting
            raise APIError(503, f"the ResourceManager did not answer ({type(e).__name__}); try again",
                           type="server_error", code="service_unavailable") from None
        out = []
        for j in sorted(jobs, key=lambda j: j.created, reverse=True):
            p = j.progress
            out.append({"id": j.id, "name": j.name, "owner": j.owner, "state": j.state.value, "kind": j.kind,
                        "step": p.get(K.STEP), "total_steps": j.total_steps, "phase": p.get(K.PHASE),
                        "reward": K.headline_reward(p), "accuracy": p.get(K.EVAL_ACCURACY), "created": j.created,
                        "error": j.error})
        return out

    @api.get("/api/jobs/{job_id}")
    async def job(self, job_id: str, request: Request) -> dict[str, Any]:
        return (await rm_call(self._rm().status, job_id, await self._caller(request))).to_json()

    @api.get("/api/jobs/{job_id}/metrics")
    async def job_metrics(self, job_id: str, request: Request,
                          since: int = Query(0, ge=0, le=MAX_INDEX)) -> list[dict[str, Any]]:
        return await rm_call(self._rm().metrics, job_id, since, await self._caller(request))

    @api.get("/api/jobs/{job_id}/episodes")
    async def job_episodes(self, job_id: str, request: Request,
                           step: int | None = Query(None, ge=0, le=MAX_INDEX)) -> dict[str, Any]:
        page = await rm_call(self._rm().episodes, job_id, step, await self._caller(request))
        return {"steps": page.steps, "episodes": page.episodes}

    @api.get("/api/jobs/{job_id}/checkpoints")
    async def job_checkpoints(self, job_id: str, request: Request) -> list[dict[str, Any]]:
        steps = await rm_call(self._rm().checkpoints, job_id, await self._caller(request))
        return [{"step": s, "model": f"job-{job_id}:{s}"} for s in steps]

    @api.post("/api/jobs/{job_id}/cancel")
    async def job_cancel(self, job_id: str, request: Request) -> dict[str, Any]:
        return (await rm_call(self._rm().cancel, job_id, await self._caller(request))).to_json()
