"""External weights: a training client's LoRA as files a user downloads (``save_weights_external``).

Tinker's ``TrainingClient.save_weights_external(name, ttl_seconds, age_encryption_recipients)`` saves
the adapter in PEFT's format (``adapter_model.safetensors`` + ``adapter_config.json``) as the checkpoint
``tinker://<run>/external_weights/<name>``; ``RestClient.get_external_weights_urls(path)`` gives one
signed URL per file, valid until ``expires``. The cookbook's ``weights.download`` fetches them (and
``weights.build_hf_model`` merges the adapter into the base model, ``build_lora_adapter`` converts it
for vLLM).

Here a signed URL is ``<service>/api/v1/external_weights/<token>``: the token is an HS256 JWT, signed
with the service's own secret (the one its auth tokens use), naming the checkpoint, the file and an
expiry (``external_url_ttl_s``, an hour by default). It needs no API key (that is what signing is
for: it can be handed to a download tool), names one file of one checkpoint, and stops working when
it expires or the checkpoint is deleted or expires. Files are encrypted to the request's age
recipients (``age1...`` keys or SSH public keys, at most 10; stored with a ``.age`` suffix) with
``pyrage``, so the service keeps only ciphertext of such an export.

Runs in the TinkerService actor."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import jwt

from otray.tinker.errors import UserError

PEFT_FILES = ("adapter_model.safetensors", "adapter_config.json")  # what an export holds (before encryption)
AGE_SUFFIX = ".age"
MAX_RECIPIENTS = 10
AUDIENCE = "otray:external_weights"


@dataclass(frozen=True)
class FileGrant:
    """What a signed URL grants: one file of one checkpoint."""

    model_id: str
    checkpoint_id: str  # external_weights/<name>
    file: str


def keep_peft_files(where: Path) -> int:
    """Leave only PEFT's adapter files in a freshly saved checkpoint dir; their total size in bytes."""
    for path in where.iterdir():
        if path.name not in PEFT_FILES:
            path.unlink() if path.is_file() else None
    missing = [f for f in PEFT_FILES if not (where / f).is_file()]
    if missing:
        raise RuntimeError(f"the learner's save left no {missing} in {where}")
    return sum((where / f).stat().st_size for f in PEFT_FILES)


def recipients(raw: object) -> list[object]:
    """``age_encryption_recipients`` as pyrage recipients; a bad one is a UserError naming it."""
    if raw is None:
        return []
    if not isinstance(raw, list) or not all(isinstance(r, str) for r in raw) or not 1 <= len(raw) <= MAX_RECIPIENTS:
        raise UserError(f"age_encryption_recipients must be a list of 1 to {MAX_RECIPIENTS} age or SSH public keys")
    try:
        import pyrage
    except ImportError:
        raise UserError("this service cannot encrypt exports (pyrage is not installed there); leave "
                        "age_encryption_recipients unset or ask its admin") from None
    out = []
    for text in raw:
        try:
            out.append(pyrage.ssh.Recipient.from_str(text) if text.startswith("ssh-")
                       else pyrage.x25519.Recipient.from_str(text))
        except Exception as e:  # noqa: BLE001 - pyrage raises its own error types per kind of key
            raise UserError(f"age_encryption_recipients: {text[:40]!r} is not an age (age1...) or SSH public key "
                            f"({e})") from None
    return out


def encrypt_in_place(where: Path, to: list[object]) -> int:
    """Each file of ``where`` encrypted to ``to`` as ``<file>.age`` (the plain file removed); total bytes."""
    import pyrage

    size = 0
    for path in sorted(p for p in where.iterdir() if p.is_file()):
        sealed = path.with_name(path.name + AGE_SUFFIX)
        pyrage.encrypt_file(str(path), str(sealed), to)
        path.unlink()
        size += sealed.stat().st_size
    return size


def sign(secret: bytes, grant: FileGrant, ttl_s: float) -> tuple[str, float]:
    """A token for ``grant`` and when it expires (epoch seconds)."""
    expires = time.time() + ttl_s
    token = jwt.encode({"aud": AUDIENCE, "run": grant.model_id, "ckpt": grant.checkpoint_id, "file": grant.file,
                        "exp": int(expires)}, secret, algorithm="HS256")
    return token, float(int(expires))


def verify(secret: bytes, token: str) -> FileGrant:
    """The grant of a valid, unexpired token; a 404 otherwise (a bad token reveals nothing)."""
    try:
        claims = jwt.decode(token, secret, algorithms=["HS256"], audience=AUDIENCE)
        return FileGrant(str(claims["run"]), str(claims["ckpt"]), str(claims["file"]))
    except (jwt.PyJWTError, KeyError):
        raise UserError("no such file (the link is wrong or expired: get new URLs with "
                        "RestClient.get_external_weights_urls)", 404) from None


def files_of(where: Path) -> list[str]:
    """The files of an export dir, by name (an export is flat)."""
    return sorted(p.name for p in where.iterdir() if p.is_file()) if where.is_dir() else []
