"""The suite's check for Ray clusters left behind (``tests/conftest.py``): it judges only the clusters this
pytest run started, never those of a program running beside it (a demo, a benchmark)."""

from __future__ import annotations

import os
import subprocess
import time


def _fake_raylet(tmp_path, env):
    """A process named ``raylet`` (a renamed ``sleep``), with ``env``."""
    exe = tmp_path / "raylet"
    exe.symlink_to("/bin/sleep")
    return subprocess.Popen([str(exe), "60"], env=env)


def test_only_this_runs_clusters_are_judged(tmp_path):
    from tests.conftest import _ray_cluster_processes

    ours = {k: v for k, v in os.environ.items()}
    other = {k: v for k, v in ours.items() if k != "OTRAY_PYTEST_RUN"}  # e.g. `otray train` started in a shell
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    mine, theirs = _fake_raylet(tmp_path / "a", ours), _fake_raylet(tmp_path / "b", other)
    try:
        time.sleep(0.2)
        found = _ray_cluster_processes()
        assert mine.pid in found and theirs.pid not in found, found
    finally:
        for p in (mine, theirs):
            p.kill()
            p.wait()
