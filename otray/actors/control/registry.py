"""The SQLite store behind the ResourceManager: users, jobs, checkpoints.

- Users: an API key is shown once, at creation, and stored only as a salted
  scrypt hash. Keys look like ``otr_<user id>_<secret>``: the id finds the row, the
  hash checks the secret; no key string ever reaches the database. The Tinker API's clients
  send the same key as ``tml-<user id>_<secret>`` (the ``tinker`` SDK only takes keys that
  start with ``tml-``): one secret, two spellings (:func:`tinker_key`).
- Jobs: ``QUEUED -> STARTING -> RUNNING -> SUCCEEDED | FAILED | CANCELLED``, with a
  timestamp per transition and error text; an illegal transition is an error.
- Checkpoints: (job, step, path), latest-first lookup.
- Settings: cluster-wide values that outlive the ResourceManager (``auth`` once on stays on,
  the modules an admin allowed, the secret that signs checkpoint grants).

One connection per Registry; callers (the ResourceManager actor) serialize access.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from otray.records import JobState, JobStatus, MetricsPage
from otray.types import OtrayError


def unknown_job(job_id: str) -> str:
    """The one answer for a job id that does not exist or is not the caller's."""
    return f"no job {job_id!r} of yours (list yours with `otray jobs`)"


class AuthError(OtrayError, PermissionError):
    """A missing, malformed or wrong API key, or an action on another user's job."""


class JobStateError(OtrayError, ValueError):
    """A job state transition that the lifecycle does not allow."""


_NEXT = {
    JobState.QUEUED: {JobState.STARTING, JobState.CANCELLED, JobState.FAILED},
    JobState.STARTING: {JobState.RUNNING, JobState.FAILED, JobState.CANCELLED},
    JobState.RUNNING: {JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED},
}

_SCHEMA = """
CREATE TABLE IF NOT EXISTS users (
    id INTEGER PRIMARY KEY, name TEXT UNIQUE NOT NULL, admin INTEGER NOT NULL,
    salt BLOB NOT NULL, key_hash BLOB NOT NULL, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, name TEXT NOT NULL, state TEXT NOT NULL,
    config TEXT NOT NULL, error TEXT, progress TEXT NOT NULL DEFAULT '{}',
    created REAL NOT NULL, started REAL, finished REAL, transitions TEXT NOT NULL DEFAULT '[]');
CREATE TABLE IF NOT EXISTS metrics (
    job_id TEXT NOT NULL, seq INTEGER NOT NULL, row TEXT NOT NULL, PRIMARY KEY (job_id, seq));
CREATE TABLE IF NOT EXISTS metric_ends (job_id TEXT PRIMARY KEY, next INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS episodes (
    job_id TEXT NOT NULL, seq INTEGER NOT NULL, step INTEGER NOT NULL, row TEXT NOT NULL,
    PRIMARY KEY (job_id, seq));
CREATE TABLE IF NOT EXISTS outputs (
    job_id TEXT NOT NULL, seq INTEGER NOT NULL, row TEXT NOT NULL, PRIMARY KEY (job_id, seq));
CREATE TABLE IF NOT EXISTS settings (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS checkpoints (
    job_id TEXT NOT NULL, step INTEGER NOT NULL, path TEXT NOT NULL, created REAL NOT NULL,
    PRIMARY KEY (job_id, step));
"""


@dataclass(frozen=True)
class User:
    id: int
    name: str
    admin: bool


@dataclass
class JobRecord:
    id: str
    owner: str
    name: str
    state: JobState
    config: dict[str, Any]
    error: str | None
    progress: dict[str, Any]
    created: float
    started: float | None
    finished: float | None
    transitions: list[tuple[str, float]]

    def status(self) -> JobStatus:
        """What the job's owner sees of it (``otray.records``): no config, no transitions."""
        kind = self.config.get("job", {}).get("kind", "rl")
        total = 1 if kind == "infer" else self.config.get("sft" if kind == "sft" else "algo", {}).get("steps")
        return JobStatus(self.id, self.owner, self.name, self.state, self.error, kind, total, self.progress,
                         self.created, self.started, self.finished)


def tinker_key(key: str) -> str:
    """``otr_<id>_<secret>`` as the Tinker SDK takes it: ``tml-<id>_<secret>``."""
    return "tml-" + key.removeprefix("otr_")


def _hash(salt: bytes, secret: str) -> bytes:
    return hashlib.scrypt(secret.encode(), salt=salt, n=2**14, r=8, p=1, dklen=32)


class Registry:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self.db.executescript(_SCHEMA)
        self._verified: dict[bytes, User] = {}  # sha256(key) -> user: scrypt once per key, dropped on changes

    # ------------------------------------------------------------------ settings

    def setting(self, key: str, default: Any = None) -> Any:
        row = self.db.execute("SELECT value FROM settings WHERE key = ?", (key,)).fetchone()
        return json.loads(row[0]) if row else default

    def set_setting(self, key: str, value: Any) -> None:
        self.db.execute("INSERT OR REPLACE INTO settings VALUES (?, ?)", (key, json.dumps(value)))

    # ------------------------------------------------------------------ users and keys

    def add_user(self, name: str, admin: bool = False) -> str:
        """Create a user; returns its API key, which is not stored and cannot be shown again."""
        if not name or not name.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"user name {name!r} must be letters, digits, '-' or '_'")
        secret, salt = secrets.token_urlsafe(24), secrets.token_bytes(16)
        try:
            cur = self.db.execute("INSERT INTO users (name, admin, salt, key_hash, created) VALUES (?, ?, ?, ?, ?)",
                                  (name, int(admin), salt, _hash(salt, secret), time.time()))
        except sqlite3.IntegrityError:
            raise ValueError(f"user {name!r} already exists") from None
        return f"otr_{cur.lastrowid}_{secret}"

    def authenticate(self, key: str | None) -> User:
        digest = hashlib.sha256(key.encode()).digest() if key else b""
        if digest in self._verified:
            return self._verified[digest]
        user = self._authenticate(key)
        self._verified[digest] = user
        return user

    def _authenticate(self, key: str | None) -> User:
        if not key:
            raise AuthError("this cluster requires an API key: pass api_key= to otray.connect or set OTRAY_API_KEY")
        if key.startswith("tml-"):  # the Tinker SDK's spelling of the same key
            key = "otr_" + key[4:]
        parts = key.split("_", 2)
        if len(parts) != 3 or parts[0] != "otr" or not parts[1].isdigit():
            raise AuthError("malformed API key: expected the 'otr_<id>_<secret>' (or Tinker's 'tml-<id>_<secret>') "
                            "string printed by `otray users add`")
        row = self.db.execute("SELECT id, name, admin, salt, key_hash FROM users WHERE id = ?", (int(parts[1]),)).fetchone()
        if row is None or not hmac.compare_digest(_hash(row[3], parts[2]), row[4]):
            raise AuthError("wrong API key: no user has this key (ask an admin for a new one)")
        return User(row[0], row[1], bool(row[2]))

    def key_tag(self, name: str) -> str | None:
        """A tag of ``name``'s current key (from its salt, which a rotation replaces): what a token minted
        for that key carries, so the token stops when the key is rotated or the user deleted (None: no
        such user)."""
        row = self.db.execute("SELECT salt FROM users WHERE name = ?", (name,)).fetchone()
        return None if row is None else hashlib.sha256(b"key-tag:" + bytes(row[0])).hexdigest()[:24]

    def users(self) -> list[User]:
        return [User(r[0], r[1], bool(r[2])) for r in self.db.execute("SELECT id, name, admin FROM users ORDER BY id")]

    def delete_user(self, name: str) -> None:
        """Remove a user; their key stops working at once (their jobs and checkpoints stay)."""
        if self.db.execute("DELETE FROM users WHERE name = ?", (name,)).rowcount == 0:
            raise KeyError(f"no user {name!r} (list users with `otray users list`)")
        self._verified.clear()

    def rotate_key(self, name: str) -> str:
        """A new key for ``name``; the old one stops working at once. Returns the new key (shown once)."""
        secret, salt = secrets.token_urlsafe(24), secrets.token_bytes(16)
        cur = self.db.execute("UPDATE users SET salt = ?, key_hash = ? WHERE name = ?", (salt, _hash(salt, secret), name))
        if cur.rowcount == 0:
            raise KeyError(f"no user {name!r} (list users with `otray users list`)")
        self._verified.clear()
        uid = self.db.execute("SELECT id FROM users WHERE name = ?", (name,)).fetchone()[0]
        return f"otr_{uid}_{secret}"

    def has_users(self) -> bool:
        return self.db.execute("SELECT 1 FROM users LIMIT 1").fetchone() is not None

    # ------------------------------------------------------------------ jobs

    def create_job(self, owner: str, name: str, config: dict[str, Any]) -> str:
        job_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
        now = time.time()
        self.db.execute("INSERT INTO jobs (id, owner, name, state, config, created, transitions) VALUES (?, ?, ?, ?, ?, ?, ?)",
                        (job_id, owner, name, JobState.QUEUED.value, json.dumps(config), now,
                         json.dumps([[JobState.QUEUED.value, now]])))
        return job_id

    def job(self, job_id: str) -> JobRecord:
        row = self.db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            raise KeyError(unknown_job(job_id))
        return self._record(row)

    def jobs(self, owner: str | None = None) -> list[JobRecord]:
        """All jobs, oldest first; only ``owner``'s when given."""
        q, args = ("SELECT * FROM jobs WHERE owner = ? ORDER BY created", (owner,)) if owner else \
            ("SELECT * FROM jobs ORDER BY created", ())
        return [self._record(r) for r in self.db.execute(q, args)]

    def set_state(self, job_id: str, state: JobState, error: str | None = None) -> JobRecord:
        current = self.job(job_id)
        if state not in _NEXT.get(current.state, set()):
            raise JobStateError(f"job {job_id} cannot go from {current.state.value} to {state.value}")
        now = time.time()
        transitions = [*current.transitions, (state.value, now)]
        self.db.execute(
            "UPDATE jobs SET state = ?, error = COALESCE(?, error), transitions = ?, "
            "started = CASE WHEN ? = 'RUNNING' THEN ? ELSE started END, "
            "finished = CASE WHEN ? IN ('SUCCEEDED', 'FAILED', 'CANCELLED') THEN ? ELSE finished END WHERE id = ?",
            (state.value, error, json.dumps(transitions), state.value, now, state.value, now, job_id))
        return self.job(job_id)

    def set_progress(self, job_id: str, progress: dict[str, Any]) -> None:
        """Record one metrics row: it becomes the job's progress and is appended to its metrics. Its index
        (``seq``, a follower's cursor: :meth:`metrics_after`) is past every index the job ever had: one past its
        last row, or past the rows a :meth:`rewind` dropped (``metric_ends``), so an index is never given twice
        (a row count, lowered by a rewind under a kept recovery row, collided with it: ``IntegrityError``)."""
        row = json.dumps(progress)
        self.db.execute("UPDATE jobs SET progress = ? WHERE id = ?", (row, job_id))
        self.db.execute("INSERT INTO metrics VALUES (?, MAX((SELECT COALESCE(MAX(seq), -1) + 1 FROM metrics WHERE "
                        "job_id = ?), (SELECT COALESCE(MAX(next), 0) FROM metric_ends WHERE job_id = ?)), ?)",
                        (job_id, job_id, job_id, row))

    def rewind(self, job_id: str, step: int) -> None:
        """Forget a job's metrics rows and episodes after ``step`` (a restarted job runs those steps again:
        kept, they would be duplicates). Its rows are in step order, so what goes is their tail; the index after
        them is kept, and the rows written next come after it."""
        self.db.execute("INSERT INTO metric_ends SELECT ?, COALESCE(MAX(seq), -1) + 1 FROM metrics WHERE job_id = ? "
                        "ON CONFLICT(job_id) DO UPDATE SET next = MAX(next, excluded.next)", (job_id, job_id))
        self.db.execute("DELETE FROM metrics WHERE job_id = ? AND CAST(json_extract(row, '$.step') AS INTEGER) > ? "
                        "AND json_extract(row, '$.phase') IS NOT 'recovery'", (job_id, step))  # (events: they stay)
        self.db.execute("DELETE FROM episodes WHERE job_id = ? AND step > ?", (job_id, step))
        self.db.commit()

    def recoveries(self, job_id: str) -> list[dict[str, Any]]:
        """The job's recovery rows (phase ``recovery``: restarts, and rollout workers replaced), in order."""
        rows = self.db.execute("SELECT row FROM metrics WHERE job_id = ? AND json_extract(row, '$.phase') = "
                               "'recovery' ORDER BY seq", (job_id,))
        return [json.loads(r[0]) for r in rows]

    def metrics(self, job_id: str, since: int = 0) -> list[dict[str, Any]]:
        """The job's metrics rows from position ``since`` on, in order (a position among the rows there are now:
        a follower that counts them misses the rows a restart runs again; :meth:`metrics_after` does not)."""
        rows = self.db.execute("SELECT row FROM metrics WHERE job_id = ? ORDER BY seq LIMIT -1 OFFSET ?",
                               (job_id, max(since, 0)))
        return [json.loads(r[0]) for r in rows]

    def metrics_after(self, job_id: str, cursor: int = -1, limit: int = 10_000) -> MetricsPage:
        """The job's metrics rows written after ``cursor`` (-1: from the first), at most ``limit``, and the
        cursor that follows them (``cursor`` itself when there are none)."""
        rows = self.db.execute("SELECT seq, row FROM metrics WHERE job_id = ? AND seq > ? ORDER BY seq LIMIT ?",
                               (job_id, cursor, max(limit, 1))).fetchall()
        return MetricsPage([json.loads(r[1]) for r in rows], rows[-1][0] if rows else cursor)

    @staticmethod
    def _record(row: tuple) -> JobRecord:
        return JobRecord(row[0], row[1], row[2], JobState(row[3]), json.loads(row[4]), row[5], json.loads(row[6]),
                         row[7], row[8], row[9], [tuple(t) for t in json.loads(row[10])])

    # ------------------------------------------------------------------ checkpoints

    def add_checkpoint(self, job_id: str, step: int, path: str) -> None:
        self.job(job_id)
        self.db.execute("INSERT OR REPLACE INTO checkpoints VALUES (?, ?, ?, ?)", (job_id, step, path, time.time()))

    def add_episodes(self, job_id: str, episodes: list[dict[str, Any]]) -> None:
        """Append sampled episodes a job logged (for the dashboard's trajectory viewer)."""
        start = self.db.execute("SELECT COALESCE(MAX(seq) + 1, 0) FROM episodes WHERE job_id = ?", (job_id,)).fetchone()[0]
        self.db.executemany("INSERT INTO episodes VALUES (?, ?, ?, ?)",
                            [(job_id, start + i, int(e.get("step", 0)), json.dumps(e)) for i, e in enumerate(episodes)])
        self.db.commit()

    def episodes(self, job_id: str, step: int | None = None, limit: int = 50) -> list[dict[str, Any]]:
        """The episodes logged at ``step`` (default: the latest step that logged any)."""
        if step is None:
            row = self.db.execute("SELECT MAX(step) FROM episodes WHERE job_id = ?", (job_id,)).fetchone()
            step = row[0] if row and row[0] is not None else -1
        rows = self.db.execute("SELECT row FROM episodes WHERE job_id = ? AND step = ? ORDER BY seq LIMIT ?",
                               (job_id, step, limit))
        return [json.loads(r[0]) for r in rows]

    def add_outputs(self, job_id: str, rows: list[dict[str, Any]]) -> None:
        """Append an inference job's output rows (one per episode or game), kept for its submitter."""
        start = self.db.execute("SELECT COALESCE(MAX(seq) + 1, 0) FROM outputs WHERE job_id = ?", (job_id,)).fetchone()[0]
        self.db.executemany("INSERT INTO outputs VALUES (?, ?, ?)",
                            [(job_id, start + i, json.dumps(r)) for i, r in enumerate(rows)])
        self.db.commit()

    def outputs(self, job_id: str, since: int = 0, limit: int = 1000) -> list[dict[str, Any]]:
        rows = self.db.execute("SELECT row FROM outputs WHERE job_id = ? AND seq >= ? ORDER BY seq LIMIT ?",
                               (job_id, since, limit))
        return [json.loads(r[0]) for r in rows]

    def episode_steps(self, job_id: str) -> list[int]:
        return [r[0] for r in self.db.execute("SELECT DISTINCT step FROM episodes WHERE job_id = ? ORDER BY step",
                                              (job_id,))]

    def checkpoints(self, job_id: str) -> list[int]:
        """The steps of a job's registered checkpoints, ascending."""
        return [r[0] for r in self.db.execute("SELECT step FROM checkpoints WHERE job_id = ? ORDER BY step",
                                              (job_id,)).fetchall()]

    def checkpoint(self, job_id: str, step: int | None = None) -> tuple[int, str]:
        """(step, path) of ``step``, or of the latest checkpoint when ``step`` is None."""
        if step is None:
            row = self.db.execute("SELECT step, path FROM checkpoints WHERE job_id = ? ORDER BY step DESC LIMIT 1",
                                  (job_id,)).fetchone()
        else:
            row = self.db.execute("SELECT step, path FROM checkpoints WHERE job_id = ? AND step = ?",
                                  (job_id, step)).fetchone()
        if row is None:
            what = f"step {step}" if step is not None else "any step"
            raise KeyError(f"job {job_id!r} has no checkpoint at {what}")
        return row[0], row[1]

    def close(self) -> None:
        self.db.close()
