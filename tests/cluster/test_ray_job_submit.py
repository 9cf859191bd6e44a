"""`ray start --head` + `ray job submit --working-dir . -- otray train ...` for two steps.

The ``cluster`` marker (tests/conftest.py) orders it: last in one process, first in `make test`'s xdist workers.
It starts a Ray cluster of its own with its own temp dir and ports and stops only that one's processes, leaving
the suite's local clusters (one per xdist worker) alone.
"""

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.conftest import ROOT  # noqa: E402 (the repository root)
BIN = Path(sys.executable).parent


def test_ray_job_submit_runs_otray_train():
    temp = tempfile.mkdtemp(prefix="orjs")
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "RAY_AUTH_MODE": "disabled",
           "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    ray, dash = str(BIN / "ray"), "http://127.0.0.1:8299"
    subprocess.run([ray, "start", "--head", "--port=6399", "--num-cpus=3", "--include-dashboard=true",
                    "--dashboard-port=8299", f"--temp-dir={temp}", "--disable-usage-stats",
                    # the suite's own local cluster holds the default agent/metrics ports
                    "--dashboard-agent-listen-port=52711", "--dashboard-agent-grpc-port=52712",
                    "--metrics-export-port=52713", "--runtime-env-agent-port=52714"],
                   check=True, env=env, capture_output=True, timeout=120)
    try:
        for attempt in range(12):  # right after `ray start` the job agent may not be up yet
            sub_id = f"otray-test-{int(time.time())}-{attempt}"
            submit = subprocess.run(
                [ray, "job", "submit", "--address", dash, "--working-dir", str(ROOT), "--submission-id", sub_id,
                 "--", "otray", "train", "conf/arithmetic_grpo.yaml", "algo.steps=2", "sft.steps=5",
                 "sft.stop_at_accuracy=null", "eval.num_samples=5"], env=env, capture_output=True, text=True,
                timeout=480)
            if "No available agent" not in submit.stdout + submit.stderr:
                break
            time.sleep(5)
        assert submit.returncode == 0, submit.stdout[-3000:] + submit.stderr[-3000:]
        logs = subprocess.run([ray, "job", "logs", "--address", dash, sub_id], env=env, capture_output=True,
                              text=True, timeout=60).stdout
        assert "    2 grpo" in logs and "SUCCEEDED" in logs
        status = subprocess.run([ray, "job", "status", "--address", dash, sub_id], env=env, capture_output=True,
                                text=True, timeout=60)
        assert "succeeded" in (status.stdout + status.stderr).lower()
        # the Ray job carries the otray job id in its metadata (the Ray dashboard's job list shows it)
        otray_id = next(line.split()[-1] for line in logs.splitlines() if line.startswith("submitted job "))
        from ray.job_submission import JobSubmissionClient

        info = JobSubmissionClient(dash).get_job_info(sub_id)
        assert info.metadata.get("otray_job_id") == otray_id, info.metadata
    finally:
        _kill_cluster(temp)
        shutil.rmtree(temp, ignore_errors=True)


def _kill_cluster(temp: str) -> None:
    """SIGKILL every process of the cluster started with ``--temp-dir=temp`` (its GCS server and raylet
    ignored SIGTERM long enough to outlive the suite) and wait until they are gone."""
    import psutil

    def mine():
        return [p for p in psutil.process_iter(["cmdline"]) if temp in " ".join(p.info["cmdline"] or [])]

    for p in mine():
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(mine(), timeout=20)
