"""The storage quota's ledger (otray.tinker.service.storage) on a real Store in a temporary folder: what saves
and merges in flight count for. Runs in the test process (in the service, the TinkerService actor)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from otray.tinker.errors import UserError
from otray.tinker.service.storage import StorageLedger
from otray.tinker.service.store import Store

MB = 1_000_000


def ledger(tmp_path, quota_gb: float) -> StorageLedger:
    return StorageLedger(Store(tmp_path / "store"), lambda owner: SimpleNamespace(storage_gb=quota_gb))


def write(where, nbytes: int, name: str = "model.safetensors") -> None:
    where.mkdir(parents=True, exist_ok=True)
    (where / name).write_bytes(b"\0" * nbytes)


def test_a_directory_in_flight_counts_once_as_the_larger_of_its_reservation_and_its_files(tmp_path):
    """Two 3.4 MB merges in a 9 MB quota fit, even while the first is half written (counting its files and
    its reservation both refused the second: the CI failure that found it); a third does not."""
    book = ledger(tmp_path, 0.009)
    first = book.store.checkpoint_dir("carol", "run1", "external", "m0")
    release = book.reserve("carol", first, int(3.4 * MB))
    partial = first.with_name(first.name + ".partial-1")  # where a merge writes before it renames
    write(partial, 3 * MB)  # half written
    assert book.used("carol") == int(3.4 * MB)
    second = book.reserve("carol", book.store.checkpoint_dir("carol", "run1", "external", "m1"), int(3.4 * MB))
    with pytest.raises(UserError, match="quota.storage_gb") as refused:
        book.reserve("carol", book.store.checkpoint_dir("carol", "run1", "external", "m2"), int(3.4 * MB))
    assert refused.value.status == 403
    partial.rename(first)
    write(first, 4 * MB)  # past its reservation: the files count
    assert book.used("carol") == 4 * MB + int(3.4 * MB)
    release()
    release()  # once only
    assert book.used("carol") == 4 * MB + int(3.4 * MB)  # now as stored files
    second()
    assert book.used("carol") == 4 * MB and book.reserved == {}


def test_other_users_and_stored_files_count_as_before(tmp_path):
    book = ledger(tmp_path, 1.0)
    write(book.store.checkpoint_dir("carol", "run1", "training", "s"), 2 * MB)
    write(book.store.checkpoint_dir("dave", "run2", "training", "s"), 5 * MB)
    release = book.reserve("dave", book.store.checkpoint_dir("dave", "run2", "training", "t"), MB)
    assert (book.used("carol"), book.used("dave")) == (2 * MB, 6 * MB)
    release()
    assert book.used("dave") == 5 * MB


def test_usage_counts_while_merges_rename_their_directories_beside_it(tmp_path):
    """The quota's walk of a user's files runs while other merges write partial directories and rename them
    into place: a file listed then moved is not counted, never an error (the walk that stat-ed every file it
    listed raised FileNotFoundError, a merge's 500 in test_external's concurrent merges, ~1 run in 5; here it
    failed ~1,000 times in 2 s). The files that stay are all counted, every time."""
    import shutil
    import threading
    import time

    book = ledger(tmp_path, 1.0)
    write(book.store.checkpoint_dir("carol", "run1", "external", "kept"), MB)
    top = book.store.checkpoint_dir("carol", "run1", "external", "x").parent
    stop = threading.Event()

    def churn() -> None:  # a merge's life: write under <name>.partial-<ns>, rename to <name>, deleted later
        i = 0
        while not stop.is_set():
            partial = top / f"m{i}.partial-1"
            for k in range(20):
                write(partial, 10, f"f{k}")
            partial.rename(top / f"m{i}")
            shutil.rmtree(top / f"m{i}")
            i += 1

    thread = threading.Thread(target=churn)
    thread.start()
    try:
        walks, deadline = 0, time.monotonic() + 1.0
        while time.monotonic() < deadline:
            assert MB <= book.used("carol") < MB + 1000
            walks += 1
    finally:
        stop.set()
        thread.join()
    assert walks > 10


def test_a_runs_last_request_is_written_at_most_once_a_second_and_read_exact(tmp_path, monkeypatch):
    """``Store.touch`` (every training request) writes the run's ``last_request`` to SQLite at most every
    ``TOUCH_WRITE_S`` (each write is a transaction on the service's event loop); the run read back still has the
    latest request's time."""
    import otray.tinker.service.store as store_module

    clock = [1000.0]
    monkeypatch.setattr(store_module.time, "time", lambda: clock[0])
    store = Store(tmp_path / "store")
    store.add_run("run1", "carol", "base", {"rank": 4}, None)
    written = lambda: store.db.execute("SELECT last_request FROM runs WHERE model_id = 'run1'").fetchone()[0]  # noqa: E731
    for t, on_disk in ((1001.0, 1001.0), (1001.5, 1001.0), (1001.9, 1001.0), (1002.2, 1002.2)):
        clock[0] = t
        store.touch("run1")
        assert written() == on_disk and store.run("run1").last_request == t
    assert store.touched == {} and store_module.TOUCH_WRITE_S == 1.0
