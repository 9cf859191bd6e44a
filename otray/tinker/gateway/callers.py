"""Who is calling the Tinker API: a JWT this service minted (:mod:`otray.tinker.service.tokens`), or a
``tml-`` key checked against the ResourceManager's registry when auth is on (``local`` when off).

The manager's answer that a key (or the key a JWT was minted for) holds is kept while the cluster's key epoch
reads the same (:mod:`otray.actors.control.epochs`): the manager sets a new one before a deletion or rotation
answers, so a revoked key is still refused at its very next request, and a request otherwise costs one GCS read
instead of a call to the manager.

Runs in the gateway's Ray Serve replica."""

from __future__ import annotations

import hashlib
import time
from typing import Any, Callable

from otray.actors.control.epochs import KEYS, EpochCache
from otray.tinker.service import tokens
from otray.tinker.errors import UserError, unwrap


class Callers:
    def __init__(self, cfg: Any, service: Any):
        self.cfg, self.service = cfg, service  # a TinkerConfig; the TinkerService actor
        self.auth_cache = (False, 0.0)  # (auth on, until when that answer holds)
        self.secret: bytes | None = None  # the JWT signing key, fetched from the service once
        self.checked = EpochCache(KEYS)  # (user, tag) -> live; sha256 of a key -> its user: the manager's answers

    async def owner(self, key: str) -> str:
        """The caller's user name: from a JWT this service minted (while the key it was exchanged for is
        still its user's: asked of the ResourceManager each time), or a key checked against the
        ResourceManager's registry when auth is on."""
        if tokens.looks_like_jwt(key):
            user, tag = tokens.user_of(await self._secret(), key)
            if await self._auth_on() and not await self._held(("live", user, tag),
                                                              lambda rm: rm.key_live.remote(user, tag)):
                raise tokens.BadToken("the API key this JWT was exchanged for was deleted or rotated; exchange a "
                                      "current key at /auth/token")
            return user
        return await self.key_owner(key)

    async def minted(self, key: str) -> tuple[str, str | None]:
        """For ``/auth/token``: the key's user and its tag (None with auth off), the key checked."""
        user = await self.key_owner(key)
        return user, (await self._registry(lambda rm: rm.key_tag.remote(key)) if await self._auth_on() else None)

    async def _registry(self, call: Callable[[Any], Any]) -> Any:
        """``call(the ResourceManager)``'s answer; a 401 for a refused key, a 503 when no manager answers."""
        from otray.serve.http import rm_handle

        try:
            return await call(rm_handle())
        except Exception as e:  # noqa: BLE001 - AuthError from the registry, or no manager
            if isinstance(unwrap(e), PermissionError):
                raise UserError(str(unwrap(e)).splitlines()[-1], 401) from None
            raise UserError("no ResourceManager answers on this cluster, so keys cannot be checked", 503) from None

    async def _secret(self) -> bytes:
        if self.secret is None:
            self.secret = await self.service.jwt_secret.remote()
        return self.secret

    async def key_owner(self, key: str) -> str:
        if not key.startswith("tml-"):
            raise UserError("missing or malformed API key: send X-API-Key: tml-... (from `otray users add`)", 401)
        if not await self._auth_on():
            return "local"
        digest = hashlib.sha256(key.encode()).digest()  # (the key itself is not kept)
        return await self._held(("owner", digest), lambda rm: rm.whoami.remote(key), lambda who: who.name)

    async def _held(self, what: tuple, call: Callable[[Any], Any], answer: Callable[[Any], Any] = bool) -> Any:
        """The manager's answer to ``call`` (``answer`` of it), kept under the key epoch (:class:`EpochCache`)."""
        async def ask() -> Any:
            return answer(await self._registry(call))

        return await self.checked.answer(what, ask)

    async def _auth_on(self) -> bool:
        from otray.serve.http import rm_handle

        if self.cfg.auth != "auto":
            return self.cfg.auth == "on"
        if self.auth_cache[1] > time.monotonic():
            return self.auth_cache[0]
        rm = rm_handle()
        if rm is None:
            raise UserError("no ResourceManager answers on this cluster (auth: auto asks it whether keys are needed); "
                            "start one with any `otray` command, or set auth: off", 503)
        on = bool(await rm.auth_required.remote())
        self.auth_cache = (on, time.monotonic() + 10.0)
        return on
