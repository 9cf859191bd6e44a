"""Each user's storage quota (``quota.storage_gb``): what their checkpoints and custom losses take, plus what
saves and merges in flight have reserved.

A save or merge reserves its expected size for the directory it writes when it starts
(:meth:`StorageLedger.reserve`) and releases it once its files are written (they then count as themselves),
so concurrent ones cannot together pass the quota that each alone was checked against (15 concurrent merges
ended 48% over it when the size was only charged after). While it is in flight its directory counts as the
larger of its reservation and what is written there so far (a merge writes a sibling ``<name>.partial-*`` first,
:data:`PARTIAL`), never both (counting both refused a merge beside another that was half written: CI, session 45). Expected sizes: a merge, its base model's files; a save,
that run's last checkpoint of the same kind (0 for its first).

Runs in the TinkerService actor (one event loop: a check and its reservation happen with no await between)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from otray.tinker.errors import UserError
from otray.tinker.service.store import Store, disk_usage


PARTIAL = ".partial-"  # a directory written under ``<name>.partial-<ns>``, then renamed to ``<name>`` (merges)


def in_flight(where: Path) -> list[Path]:
    """The directories a save or merge into ``where`` writes: ``where`` and its partial siblings."""
    return [where, *where.parent.glob(where.name + PARTIAL + "*")] if where.parent.is_dir() else [where]


class StorageLedger:
    def __init__(self, store: Store, quotas: Callable[[str], Any]):
        self.store, self.quotas = store, quotas  # quotas: user -> their TinkerQuota
        self.reserved: dict[str, list[tuple[Path, int]]] = {}  # user -> (directory, bytes) of saves and merges in flight

    def used(self, owner: str) -> int:
        """Bytes ``owner``'s stored files, custom losses and saves and merges in flight take."""
        flight: dict[Path, int] = {}
        for where, nbytes in self.reserved.get(owner, ()):
            flight[where] = flight.get(where, 0) + nbytes
        dirs = {d: in_flight(d) for d in flight}
        return self.store.usage(owner, skip=[p for ps in dirs.values() for p in ps]) + \
            sum(max(n, sum(disk_usage(p) for p in dirs[d])) for d, n in flight.items())

    def room(self, owner: str, adding: int = 0) -> None:
        """Refuse (a 403 naming the quota) while ``owner``'s stored bytes and reservations take their quota,
        or would with ``adding`` more."""
        limit = self.quotas(owner).storage_gb
        used = self.used(owner) / 1e9
        if used >= limit or (adding and used + adding / 1e9 > limit):
            raise UserError(f"quota: {owner}'s checkpoints, custom losses and saves in progress take {used:.3f} GB"
                            f"{f' (this one {adding / 1e9:.3f} GB more)' if adding else ''}, the limit is {limit:g} GB "
                            "(quota.storage_gb); delete some (RestClient.delete_checkpoint) or ask an admin", 403)

    def reserve(self, owner: str, where: Path, nbytes: int) -> Callable[[], None]:
        """Check room for ``nbytes`` more and hold them for ``owner``'s save or merge into the directory
        ``where``; call the returned function (once) when the files are written or the work failed."""
        self.room(owner, nbytes)
        entry = (Path(where), nbytes)
        self.reserved.setdefault(owner, []).append(entry)

        def release() -> None:
            held = self.reserved.get(owner, [])
            if entry in held:
                held.remove(entry)  # equal entries are interchangeable: any one of them
                if not held:
                    self.reserved.pop(owner, None)

        return release

    def last_size(self, model_id: str, kind: str) -> int:
        """Bytes of ``model_id``'s newest checkpoint of ``kind`` (0: none yet): a save's expected size."""
        same = [c for c in self.store.checkpoints(model_id) if c.kind == kind]
        return max(same, key=lambda c: c.created).size if same else 0
