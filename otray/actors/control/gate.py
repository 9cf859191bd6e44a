"""The ResourceManager's access checks: keys, admin rights, job tokens, checkpoint grants.

Every ResourceManager method a client, a job or the Serve app calls names who is calling:

- a **user's API key** (``api_key=``): what a user may see and do (their own jobs; an admin
  everything). With auth off every caller is the admin ``local``.
- a **job token**: a random secret the manager gives a job's driver when it starts. The
  driver's calls (``report``, ``put_checkpoint``, ``ref_blob``...) carry it; they act on
  that job only. Tokens live in the manager's memory (a restart fails running jobs anyway); a
  finished job keeps its token, since the last rows its driver sent may still be queued, and a
  cancelled job loses it.
- a **checkpoint grant**: ``HMAC(cluster secret, "JOB_ID:STEP")``, handed to the Serve app
  once it checked that the HTTP caller may use that checkpoint; a replica loads the
  checkpoint with it. The secret is kept in the registry, so grants survive restarts.

Auth, once on, stays on: the setting is stored in the registry and no later caller can turn
it off (``auth_enabled=False`` from a client that recreates the manager is ignored).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from typing import Any

from otray.actors.control import epochs
from otray.actors.control.registry import AuthError, JobRecord, Registry, unknown_job
from otray.types import QuotaError
from otray.trust import BUNDLED_MODULES, Caller, normal_url

DEFAULT_JOB_QUOTA = 16  # a user's jobs queued, starting or running at once, unless an admin set another


class Gate:
    def __init__(self, registry: Registry, auth_requested: bool):
        self.registry = registry
        self.auth_enabled = bool(registry.setting("auth", False)) or auth_requested
        if self.auth_enabled:
            registry.set_setting("auth", True)
        secret = registry.setting("secret")
        if secret is None:
            secret = secrets.token_hex(32)
            registry.set_setting("secret", secret)
        self._secret = bytes.fromhex(secret)
        self._job_tokens: dict[str, str] = {}
        epochs.bump(epochs.KEYS, epochs.LEASES)  # a manager (re)started: its job tokens are new; cached answers go

    # ------------------------------------------------------------------ users

    def caller(self, api_key: str | None) -> Caller:
        """Who holds ``api_key`` (AuthError when auth is on and the key is missing or wrong)."""
        if not self.auth_enabled:
            return Caller("local", True)
        user = self.registry.authenticate(api_key)
        return Caller(user.name, user.admin)

    def admin(self, api_key: str | None, what: str) -> Caller:
        who = self.caller(api_key)
        if not who.admin:
            raise AuthError(f"only an admin can {what}")
        return who

    def own(self, job_id: str, api_key: str | None) -> JobRecord:
        """The job, when the key's user owns it or is an admin. Another user's job is answered exactly
        like one that does not exist (the registry's KeyError), so job ids cannot be probed."""
        who = self.caller(api_key)
        try:
            job = self.registry.job(job_id) if isinstance(job_id, str) else None  # (any value may come over Ray)
        except KeyError:
            job = None
        if job is None or (not who.admin and job.owner != who.name):
            raise KeyError(unknown_job(job_id))
        return job

    # ------------------------------------------------------------------ modules users may name

    def allowed_modules(self) -> frozenset[str]:
        return BUNDLED_MODULES | frozenset(self.registry.setting("allowed_modules", []))

    def allow_modules(self, modules: list[str], api_key: str | None) -> list[str]:
        self.admin(api_key, "allow modules")
        bad = [m for m in modules if not all(part.isidentifier() for part in m.split("."))]
        if bad:
            raise ValueError(f"not module names: {bad}; give dotted names like mypkg.envs")
        extra = sorted(set(self.registry.setting("allowed_modules", [])) | set(modules))
        self.registry.set_setting("allowed_modules", extra)
        return extra

    # ------------------------------------------------------------------ addresses users' envs may reach

    def allowed_urls(self) -> frozenset[str]:
        return frozenset(self.registry.setting("allowed_urls", []))

    def allow_urls(self, urls: list[str], api_key: str | None) -> list[str]:
        self.admin(api_key, "allow URLs")
        bad = [u for u in urls if not re.fullmatch(r"https?://[^\s/]+(/\S*)?", u.strip())]
        if bad:
            raise ValueError(f"not http(s) URLs: {bad}; give them as http://HOST:PORT or https://HOST/PATH")
        extra = sorted(self.allowed_urls() | {normal_url(u) for u in urls})
        self.registry.set_setting("allowed_urls", extra)
        return extra

    # ------------------------------------------------------------------ jobs per user

    def job_quota(self, user: str) -> int:
        """How many jobs ``user`` may have queued, starting or running at once (``*``: everyone's default)."""
        quotas = self.registry.setting("job_quota", {})
        return int(quotas.get(user, quotas.get("*", DEFAULT_JOB_QUOTA)))

    def set_job_quota(self, user: str, jobs: int, api_key: str | None) -> int:
        self.admin(api_key, "set job quotas")
        if isinstance(jobs, bool) or not isinstance(jobs, int) or not 0 <= jobs <= 100_000:
            raise ValueError(f"a job quota is a count from 0 to 100000, got {jobs!r}")
        if user != "*" and user not in {u.name for u in self.registry.users()}:
            raise KeyError(f"no user {user!r} (list users with `otray users list`; `*` sets everyone's default)")
        self.registry.set_setting("job_quota", {**self.registry.setting("job_quota", {}), user: jobs})
        return jobs

    def check_job_quota(self, user: str, active: int) -> None:
        """QuotaError when ``user``, holding ``active`` unfinished jobs, may not queue another."""
        limit = self.job_quota(user)
        if active >= limit:
            raise QuotaError(f"quota: {user} has {active} jobs queued or running, the limit is {limit}; wait for one "
                             "to finish, cancel one (`otray cancel JOB`), or ask an admin (`otray users quota`)")

    # ------------------------------------------------------------------ jobs and the Serve app

    def job_token(self, job_id: str) -> str:
        """A new token for the driver of ``job_id`` (replaces any earlier one)."""
        self._job_tokens[job_id] = secrets.token_urlsafe(32)
        return self._job_tokens[job_id]

    def check_job(self, job_id: str, token: Any) -> None:
        want = self._job_tokens.get(job_id) if isinstance(job_id, str) else None
        if want is None or not isinstance(token, str) or not hmac.compare_digest(want, token):
            raise AuthError(f"not the job token of {job_id}: only that job's driver may report for it")

    def drop_job(self, job_id: str) -> None:
        """``job_id``'s token no longer holds (cancelled, its lease closed or its holder gone): from the next
        request on, also where a lease check was cached (:mod:`~otray.actors.control.epochs`)."""
        self._job_tokens.pop(job_id, None)
        epochs.bump(epochs.LEASES)

    def keys_changed(self) -> None:
        """A key was deleted or rotated: every cached key check asks again (:mod:`~otray.actors.control.epochs`)."""
        epochs.bump(epochs.KEYS)

    def grant(self, job_id: str, step: int) -> str:
        return hmac.new(self._secret, f"{job_id}:{step}".encode(), hashlib.sha256).hexdigest()

    def check_grant(self, job_id: str, step: int, grant: Any) -> None:
        if not isinstance(grant, str) or not hmac.compare_digest(self.grant(job_id, step), grant):
            raise AuthError(f"no grant for checkpoint {job_id}:{step}: the Serve app gets one for callers who own it")
