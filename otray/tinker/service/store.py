"""What the Tinker service keeps across restarts, in SQLite: training runs, their checkpoints and
sampling sessions, each with its owner. Checkpoint files live beside the database; a row is
written only after its files are complete, so a restart never lists a half-written checkpoint.

Runs in the TinkerService actor."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Optional

def disk_usage(top: Path, skip: Collection[Path] = ()) -> int:
    """Bytes of the files under ``top`` at any depth (0 when it does not exist), those under a directory in
    ``skip`` left out. A file or directory that goes while it walks (a merge renaming its partial directory
    into place, a delete) is not counted: never an error (a walk that stat-ed each file it had listed failed so,
    a 500 for a merge beside another's rename)."""
    total = 0
    for root, dirs, files in os.walk(top):  # (os.walk skips a directory it can no longer list)
        if skip and any(Path(root).is_relative_to(d) for d in skip):
            dirs[:] = []
            continue
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except OSError:  # gone since the listing (or a broken link)
                pass
    return total


def files_usage(where: Path) -> int:
    """Bytes of the files directly in ``where`` (0 when it does not exist), as :func:`disk_usage` does."""
    try:
        entries = list(os.scandir(where))
    except OSError:
        return 0
    total = 0
    for entry in entries:
        try:
            if entry.is_file():
                total += entry.stat().st_size
        except OSError:
            pass
    return total


_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (model_id TEXT PRIMARY KEY, owner TEXT, base_model TEXT, spec TEXT,
    created REAL, last_request REAL, user_metadata TEXT);
CREATE TABLE IF NOT EXISTS checkpoints (model_id TEXT, kind TEXT, name TEXT, path TEXT, created REAL,
    size INTEGER, expires REAL, user_metadata TEXT, PRIMARY KEY (model_id, kind, name));
CREATE TABLE IF NOT EXISTS samplers (sampler_id TEXT PRIMARY KEY, owner TEXT, base_model TEXT,
    model_path TEXT, adapter_dir TEXT);
CREATE TABLE IF NOT EXISTS leases (model_id TEXT PRIMARY KEY, job_id TEXT, token TEXT);
CREATE TABLE IF NOT EXISTS sessions (session_id TEXT PRIMARY KEY, owner TEXT);
CREATE TABLE IF NOT EXISTS losses (loss_id TEXT PRIMARY KEY, owner TEXT, body TEXT);
CREATE TABLE IF NOT EXISTS sampler_clones (sampler_id TEXT PRIMARY KEY, n INTEGER);
CREATE TABLE IF NOT EXISTS session_info (session_id TEXT PRIMARY KEY, owner TEXT, created REAL, display_name TEXT,
    user_metadata TEXT, project_id TEXT, status TEXT);
"""
# checkpoint kind -> tinker path segment (external: an adapter export for download, otray/tinker/service/external.py)
TOUCH_WRITE_S = 1.0  # a run's last_request is written at most this often (Store.touch)
SEGMENT = {"training": "weights", "sampler": "sampler_weights", "external": "external_weights"}


@dataclass(frozen=True)
class Run:
    model_id: str
    owner: str
    base_model: str
    spec: dict[str, Any]
    created: float
    last_request: float
    user_metadata: Optional[dict[str, Any]]


@dataclass(frozen=True)
class Checkpoint:
    model_id: str
    kind: str  # training | sampler | external
    name: str
    path: str  # the directory holding its files
    created: float
    size: int
    expires: Optional[float]
    user_metadata: Optional[dict[str, str]]
    public: bool = False  # published: every user of the service may read it by its path

    @property
    def checkpoint_id(self) -> str:
        return f"{SEGMENT[self.kind]}/{self.name}"

    @property
    def tinker_path(self) -> str:
        return f"tinker://{self.model_id}/{self.checkpoint_id}"


@dataclass(frozen=True)
class SessionInfo:
    """What a session was created with, and how it ended, kept after it closed (search_sessions).
    ``status``: Tinker's SessionStatus JSON (``{"type": "active"}``, ``client_finished`` with its reason),
    None once it expired without its client finishing it."""

    session_id: str
    owner: str
    created: float
    display_name: Optional[str]
    user_metadata: Optional[dict[str, str]]
    project_id: Optional[str]
    status: Optional[dict[str, Any]]


@dataclass(frozen=True)
class Sampler:
    sampler_id: str
    owner: str
    base_model: str
    model_path: Optional[str]  # the tinker:// path it samples, None for the base model
    adapter_dir: Optional[str]


def session_of(model_or_sampler_id: str) -> str:
    """The session a run (``{session}:train:{n}``) or sampler (``{session}:sampler:{n}``, or an
    ephemeral ``{session}:train:{n}:sampler:{k}``) belongs to: session ids hold no ``:``."""
    return model_or_sampler_id.split(":")[0]


def parse_path(path: str) -> tuple[str, str, str]:
    """``tinker://<model id>/{weights|sampler_weights|external_weights}/<name>`` -> (model id, kind, name)."""
    from otray.tinker.errors import UserError

    rest = path[len("tinker://"):] if path.startswith("tinker://") else None
    parts = rest.split("/") if rest else []
    kinds = {v: k for k, v in SEGMENT.items()}
    if len(parts) != 3 or parts[1] not in kinds or not parts[0] or not parts[2]:
        raise UserError(f"{path!r} is not a checkpoint path: expected tinker://<run>/weights/<name>, "
                        "tinker://<run>/sampler_weights/<name> or tinker://<run>/external_weights/<name>")
    return parts[0], kinds[parts[1]], parts[2]


class Store:
    def __init__(self, root: str | Path):
        self.root = Path(root).absolute()
        self.root.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.root / "tinker.db", isolation_level=None, check_same_thread=False)
        self.touched: dict[str, float] = {}  # model id -> its last request's time, not written yet (touch)
        self.written: dict[str, float] = {}  # model id -> when touch last wrote it
        self.db.executescript(_SCHEMA)
        if "public" not in [c[1] for c in self.db.execute("PRAGMA table_info(checkpoints)").fetchall()]:
            self.db.execute("ALTER TABLE checkpoints ADD COLUMN public INTEGER NOT NULL DEFAULT 0")  # an older index

    def checkpoint_dir(self, owner: str, model_id: str, kind: str, name: str) -> Path:
        safe = model_id.replace(":", "_").replace("/", "_")
        return self.root / "checkpoints" / owner / safe / SEGMENT[kind] / name

    def usage(self, owner: str, skip: Collection[Path] = ()) -> int:
        """Bytes ``owner`` stores here: checkpoint files (named and ephemeral) and custom losses; files under
        the directories in ``skip`` (saves and merges in flight, counted by their reservations) left out."""
        return disk_usage(self.root / "checkpoints" / owner, skip) + self.losses_of(owner)[1]

    def prune_ephemeral(self, owner: str, model_id: str, keep: int) -> None:
        """Delete all but the newest ``keep`` ephemeral sampler weights of ``model_id`` (every RL step
        saves one; kept, they filled the disk)."""
        top = self.checkpoint_dir(owner, model_id, "sampler", "x").parent
        dirs = sorted((d for d in top.glob("ephemeral-*") if d.name.removeprefix("ephemeral-").isdigit()),
                      key=lambda d: int(d.name.removeprefix("ephemeral-")))
        for d in dirs[:-keep] if keep else dirs:
            shutil.rmtree(d, ignore_errors=True)

    # ------------------------------------------------------------------ runs

    def add_run(self, model_id: str, owner: str, base_model: str, spec: dict[str, Any],
                user_metadata: Optional[dict[str, Any]]) -> None:
        now = time.time()
        self.db.execute("INSERT OR REPLACE INTO runs VALUES (?, ?, ?, ?, ?, ?, ?)",
                        (model_id, owner, base_model, json.dumps(spec), now, now, json.dumps(user_metadata)))

    def touch(self, model_id: str) -> None:
        """A request of ``model_id`` came now (its run's ``last_request``). Written at most every
        ``TOUCH_WRITE_S`` per model: each write is a SQLite transaction (~1 ms here, on the service's event loop,
        twice a training step); the time in between is kept here and read with the run (:meth:`run`)."""
        now = time.time()
        if now - self.written.get(model_id, 0.0) < TOUCH_WRITE_S:
            self.touched[model_id] = now
            return
        self.touched.pop(model_id, None)
        self.written[model_id] = now
        self.db.execute("UPDATE runs SET last_request = ? WHERE model_id = ?", (now, model_id))

    def run(self, model_id: str) -> Optional[Run]:
        row = self.db.execute("SELECT * FROM runs WHERE model_id = ?", (model_id,)).fetchone()
        return None if row is None else Run(row[0], row[1], row[2], json.loads(row[3]), row[4],
                                            max(row[5], self.touched.get(model_id, 0.0)), json.loads(row[6]))

    def runs(self, owner: Optional[str]) -> list[Run]:
        ids = self.db.execute("SELECT model_id FROM runs WHERE ? IS NULL OR owner = ? ORDER BY created",
                              (owner, owner)).fetchall()
        return [r for (i,) in ids if (r := self.run(i)) is not None]

    # ------------------------------------------------------------------ checkpoints

    def add_checkpoint(self, c: Checkpoint) -> None:
        self.db.execute("INSERT OR REPLACE INTO checkpoints VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        (c.model_id, c.kind, c.name, c.path, c.created, c.size, c.expires,
                         json.dumps(c.user_metadata), int(c.public)))

    def checkpoint(self, model_id: str, kind: str, name: str) -> Optional[Checkpoint]:
        row = self.db.execute("SELECT * FROM checkpoints WHERE model_id = ? AND kind = ? AND name = ?",
                              (model_id, kind, name)).fetchone()
        return None if row is None else self._ckpt(row)

    def checkpoints(self, model_id: str) -> list[Checkpoint]:
        rows = self.db.execute("SELECT * FROM checkpoints WHERE model_id = ? ORDER BY created", (model_id,))
        return [self._ckpt(r) for r in rows.fetchall()]

    def user_checkpoints(self, owner: str) -> list[Checkpoint]:
        """Every checkpoint of ``owner``'s runs, newest first."""
        rows = self.db.execute("SELECT c.* FROM checkpoints c JOIN runs r ON c.model_id = r.model_id WHERE r.owner = ? "
                               "ORDER BY c.created DESC", (owner,))
        return [self._ckpt(r) for r in rows.fetchall()]

    def expired(self, now: float) -> list[Checkpoint]:
        rows = self.db.execute("SELECT * FROM checkpoints WHERE expires IS NOT NULL AND expires < ?", (now,))
        return [self._ckpt(r) for r in rows.fetchall()]

    def update_checkpoint(self, c: Checkpoint, *, public: Optional[bool] = None, expires: Any = ...) -> None:
        """Set a checkpoint's ``public`` flag or its ``expires`` time (None: never)."""
        if public is not None:
            self.db.execute("UPDATE checkpoints SET public = ? WHERE model_id = ? AND kind = ? AND name = ?",
                            (int(public), c.model_id, c.kind, c.name))
        if expires is not ...:
            self.db.execute("UPDATE checkpoints SET expires = ? WHERE model_id = ? AND kind = ? AND name = ?",
                            (expires, c.model_id, c.kind, c.name))

    def delete_checkpoint(self, model_id: str, kind: str, name: str) -> None:
        self.db.execute("DELETE FROM checkpoints WHERE model_id = ? AND kind = ? AND name = ?", (model_id, kind, name))

    @staticmethod
    def _ckpt(row: tuple) -> Checkpoint:
        return Checkpoint(row[0], row[1], row[2], row[3], row[4], row[5], row[6], json.loads(row[7]), bool(row[8]))

    # ------------------------------------------------------------------ samplers

    def add_sampler(self, s: Sampler) -> None:
        self.db.execute("INSERT OR REPLACE INTO samplers VALUES (?, ?, ?, ?, ?)",
                        (s.sampler_id, s.owner, s.base_model, s.model_path, s.adapter_dir))

    def samplers(self, owner: str) -> list[Sampler]:
        return [Sampler(*r) for r in self.db.execute("SELECT * FROM samplers WHERE owner = ? ORDER BY rowid", (owner,))]

    def sessions(self, owner: str) -> list[str]:
        """The ids of ``owner``'s sessions the index knows: open ones, and those of their runs and samplers."""
        seen: dict[str, None] = {}
        for (sid,) in self.db.execute("SELECT session_id FROM sessions WHERE owner = ? ORDER BY rowid", (owner,)):
            seen[sid] = None
        for r in self.runs(owner):
            seen[session_of(r.model_id)] = None
        for smp in self.samplers(owner):
            seen[session_of(smp.sampler_id)] = None
        return list(seen)

    def next_clone(self, sampler_id: str) -> int:
        """The next copy's number of a sampling client (1, 2, ...; the original is 0), never given twice,
        across restarts too (a copy's request ids are made from it)."""
        return self.db.execute("INSERT INTO sampler_clones VALUES (?, 1) ON CONFLICT(sampler_id) DO UPDATE "
                               "SET n = n + 1 RETURNING n", (sampler_id,)).fetchone()[0]

    def sampler(self, sampler_id: str) -> Optional[Sampler]:
        row = self.db.execute("SELECT * FROM samplers WHERE sampler_id = ?", (sampler_id,)).fetchone()
        return None if row is None else Sampler(*row)

    # ------------------------------------------------------------------ sessions open when the service stopped

    def add_session(self, session_id: str, owner: str) -> None:
        self.db.execute("INSERT OR REPLACE INTO sessions VALUES (?, ?)", (session_id, owner))

    def drop_session(self, session_id: str) -> None:
        self.db.execute("DELETE FROM sessions WHERE session_id = ?", (session_id,))
        self.db.execute("DELETE FROM losses WHERE substr(loss_id, 1, ?) = ?", (len(session_id) + 1, f"{session_id}:"))

    def add_session_info(self, i: SessionInfo) -> None:
        self.db.execute("INSERT OR REPLACE INTO session_info VALUES (?, ?, ?, ?, ?, ?, ?)",
                        (i.session_id, i.owner, i.created, i.display_name, json.dumps(i.user_metadata), i.project_id,
                         json.dumps(i.status)))

    def session_infos(self, owner: str) -> list[SessionInfo]:
        rows = self.db.execute("SELECT * FROM session_info WHERE owner = ? ORDER BY created", (owner,)).fetchall()
        return [SessionInfo(r[0], r[1], r[2], r[3], json.loads(r[4]), r[5], json.loads(r[6])) for r in rows]

    def update_session_info(self, session_id: str, *, project_id: Any = ..., status: Any = ...) -> None:
        """Set a session's project (a label) or status; ``...`` leaves a field as it is."""
        if project_id is not ...:
            self.db.execute("UPDATE session_info SET project_id = ? WHERE session_id = ?", (project_id, session_id))
        if status is not ...:
            self.db.execute("UPDATE session_info SET status = ? WHERE session_id = ?", (json.dumps(status), session_id))

    def add_loss(self, loss_id: str, owner: str, body: str) -> None:
        """A custom loss a session created (``{session}:loss:{n}``): its ``create_custom_loss`` JSON."""
        self.db.execute("INSERT OR REPLACE INTO losses VALUES (?, ?, ?)", (loss_id, owner, body))

    def losses_of(self, owner: str, besides: str = "") -> tuple[int, int]:
        """How many custom losses ``owner`` has stored and their bytes (``besides``: one not counted)."""
        n, size = self.db.execute("SELECT COUNT(*), COALESCE(SUM(LENGTH(body)), 0) FROM losses WHERE owner = ? "
                                  "AND loss_id != ?", (owner, besides)).fetchone()
        return int(n), int(size)

    def loss(self, loss_id: str) -> Optional[tuple[str, str]]:
        """A custom loss's (owner, JSON), or None."""
        return self.db.execute("SELECT owner, body FROM losses WHERE loss_id = ?", (loss_id,)).fetchone()

    def session_owner(self, session_id: str) -> Optional[str]:
        row = self.db.execute("SELECT owner FROM sessions WHERE session_id = ?", (session_id,)).fetchone()
        return None if row is None else row[0]

    # ------------------------------------------------------------------ ResourceManager leases

    def add_lease(self, model_id: str, job_id: str, token: str) -> None:
        self.db.execute("INSERT OR REPLACE INTO leases VALUES (?, ?, ?)", (model_id, job_id, token))

    def drop_lease(self, model_id: str) -> None:
        self.db.execute("DELETE FROM leases WHERE model_id = ?", (model_id,))

    def leases(self) -> dict[str, tuple[str, str]]:
        """model id -> (job id, job token) of every lease still open."""
        return {m: (j, t) for m, j, t in self.db.execute("SELECT * FROM leases").fetchall()}


def link_tree(src: str | Path, dest: str | Path) -> None:
    """A copy of directory ``src`` at ``dest`` by hard links (a file copy where the two are on different
    file systems): either side's deletion leaves the other whole."""
    def link(a: str, b: str) -> None:
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    shutil.copytree(src, dest, copy_function=link)
