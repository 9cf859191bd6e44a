"""Two nodes (ray.cluster_utils.Cluster): learner and rollout worker on different
nodes, weight sync between them, and a resume whose checkpoint can only come
through Ray. The scenario runs in its own process (tests/fixtures/two_nodes.py)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT  # noqa: E402 (the repository root)


@pytest.fixture(scope="module")
def seen(tmp_path_factory, tiny_path):
    tmp = tmp_path_factory.mktemp("two_nodes")
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "fixtures" / "two_nodes.py"), str(tmp), tiny_path],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_learner_and_rollout_worker_on_different_nodes(seen):
    assert seen["nodes"] == 2
    nodes = seen["direct_nodes"]
    assert nodes["learner"] and nodes["rollout"][0] and nodes["learner"] != nodes["rollout"][0]


def test_weight_sync_crosses_nodes(seen):
    assert seen["gap_at_start"] < 1e-3  # same initial weights on both nodes
    assert seen["gap_before_sync"] > 1e-2  # the learner moved; the worker has not seen it
    assert seen["gap_after_sync"] < 1e-3  # after the sync the worker samples the learner's policy


def test_job_through_the_resource_manager_spreads_and_resumes_through_ray(seen):
    assert seen["first"]["state"] == "SUCCEEDED", seen["first"]["error"]
    nodes = seen["first_summary"]["nodes"]
    assert nodes["learner"] != nodes["rollout"][0]
    # the first job's own checkpoint copy was deleted; the second got it from the ResourceManager's store
    assert seen["second"]["state"] == "SUCCEEDED", seen["second"]["error"]
    assert seen["second_batches"] == {"2": seen["first_batches"]["2"]}


def test_a_sharded_learner_with_its_two_ranks_on_different_nodes(seen):
    sharded = seen["sharded"]
    first, second = sharded["rank_nodes"]
    assert first and second and first != second
    assert sharded["gap_after_sync"] < 1e-3  # gathered weights reached the worker
    assert sharded["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # rank 1's shard crossed nodes
    assert sharded["reload_gap"] < 1e-5
