"""Short-lived JWTs for the Tinker API: what ``POST /auth/token`` mints and every route accepts.

The SDK asks ``client/config`` whether the server uses JWT auth (``pjwt_auth_enabled``); when it
does, it exchanges its ``tml-`` key for a JWT at ``/auth/token``, sends the JWT as ``X-API-Key``
on every request, and refreshes it at about half its lifetime. ``RestClient.whoami()`` reads the
caller's identity from the JWT's claims (``sub``: ``tml:user:<name>``, ``org_id``, ``email``)
without a request, so it works only with JWT auth on.

Tokens are HS256, signed with a random secret the service keeps beside its SQLite index
(``<storage>/jwt.secret``, created once, mode 0600), so tokens survive a restart of the service
and stop working when the file is replaced. A JWT is accepted until it expires (``jwt_ttl_s``,
15 minutes by default) while the key it was exchanged for stays its user's: it carries that key's tag
(``ktag``, :meth:`~otray.actors.control.registry.Registry.key_tag`), which the gateway checks with the
ResourceManager on every request, so a deleted user's or a rotated key's JWTs stop at the next request.

A training client is a ResourceManager lease opened with its user's own key, so the service keeps
the key each JWT was exchanged for (:class:`Exchanges`, in memory, until the JWT expires): a
``create_model`` sent with a JWT opens its lease with that key. After a service restart the
memory is gone; such a request is then answered like an invalid token, and the SDK exchanges its
key again and replays it.

Runs in the TinkerService actor (minting) and the gateway's Serve replica (checking a JWT)."""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path

import jwt

from otray.tinker.errors import UserError

ALGORITHM = "HS256"
USER_PREFIX = "tml:user:"
ORG_ID = "otray"


def load_secret(storage: str | Path) -> bytes:
    """The signing secret under ``storage``, made on first use (readable by the service's user only)."""
    path = Path(storage) / "jwt.secret"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(32))
    return path.read_bytes()


def looks_like_jwt(credential: str) -> bool:
    return credential.startswith("eyJ") and credential.count(".") == 2


def user_of(secret: bytes, token: str) -> tuple[str, str | None]:
    """The user a valid, unexpired token was minted for and its key's tag (``ktag``; None if it has none);
    :class:`BadToken` naming why otherwise."""
    claims = _claims(secret, token)
    sub = str(claims["sub"])
    if not sub.startswith(USER_PREFIX) or sub == USER_PREFIX:
        raise BadToken(f"the JWT names no user of this service (sub={sub!r})")
    tag = claims.get("ktag")
    return sub[len(USER_PREFIX):], tag if isinstance(tag, str) else None


def _claims(secret: bytes, token: str) -> dict:
    try:
        return jwt.decode(token, secret, algorithms=[ALGORITHM], options={"require": ["exp", "sub"]})
    except jwt.ExpiredSignatureError:
        raise BadToken("the JWT has expired; exchange the API key for a new one at /auth/token") from None
    except jwt.InvalidTokenError as e:
        raise BadToken(f"the JWT is not one this service minted ({type(e).__name__}); exchange the API key "
                       "for one at /auth/token") from None


class BadToken(UserError):
    """A JWT that is expired, forged or malformed: a 401 marked ``invalid_token`` (RFC 6750), which
    the SDK answers by exchanging its key for a new JWT and sending the request again."""

    def __init__(self, message: str):
        super().__init__(message, 401)


class Exchanges:
    """The key each live JWT was exchanged for (by its ``jti``), so work the ResourceManager must
    attribute to the user (a lease) can be opened with their key."""

    def __init__(self) -> None:
        self.keys: dict[str, tuple[str, float]] = {}  # jti -> (key, expiry)

    def mint(self, secret: bytes, user: str, key: str, ttl_s: float, tag: str | None = None) -> str:
        """A JWT for ``user`` (``key`` checked to be theirs, ``tag`` its tag), valid for ``ttl_s`` while the
        key stays theirs; ``key`` kept until it expires."""
        now = int(time.time())
        self.keys = {j: v for j, v in self.keys.items() if v[1] > now}
        claims = {"sub": f"{USER_PREFIX}{user}", "org_id": ORG_ID, "email": "", "iat": now, "exp": now + int(ttl_s),
                  "jti": secrets.token_hex(8), **({"ktag": tag} if tag else {})}
        self.keys[claims["jti"]] = (key, float(claims["exp"]))
        return jwt.encode(claims, secret, algorithm=ALGORITHM)

    def key(self, secret: bytes, credential: str | None) -> str | None:
        """The API key behind ``credential`` (a JWT this service minted, or the key itself)."""
        if credential is None or not looks_like_jwt(credential):
            return credential
        hit = self.keys.get(str(_claims(secret, credential).get("jti")))
        if hit is None:
            raise BadToken("this JWT was minted before the service restarted; exchange the API key for a new one")
        return hit[0]
