"""Shared fixtures: the tiny model (built once per machine), a local Ray cluster; the suite's markers.

Markers are applied here, so a test cannot forget one: ``ray`` to every test that uses the shared
local Ray (``ray_local``, directly or through another fixture), ``cluster`` to ``tests/cluster/``
(tests that start clusters of their own: two nodes, ``ray job submit``), ordered apart, ``service``
to tests that talk to servers they start in other processes (the OpenReward env servers: the
``servers`` fixture). ``make test-pure`` runs the rest, in-process only, without vLLM either.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray's log monitor globs the log folder every 0.1 s while it holds under this many files, else every 0.5 s:
# the suite's clusters (every one its tests start inherits this) take the slower pace (~1% of a core each)
os.environ.setdefault("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "0")
# names this pytest run (its xdist workers inherit it, and so does every process its tests start): the clusters
# it may judge as left behind are its own, never a demo's or a benchmark's running beside it
os.environ.setdefault("OTRAY_PYTEST_RUN", str(os.getpid()))


def pytest_collection_modifyitems(config, items):
    """Mark Ray tests (``ray``) and cluster tests (``cluster``), and put the cluster tests last: they
    start clusters of their own, which the shared local Ray must not outlive (it ends with the session). Under
    pytest-xdist (``make test``) they go first instead: they run in processes of their own, and two of the
    longest files left for the end would keep one worker busy while the other waits."""
    cluster_dir = ROOT / "tests" / "cluster"
    for item in items:
        if Path(str(item.fspath)).is_relative_to(cluster_dir):
            item.add_marker(pytest.mark.cluster)
        elif "ray_local" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.ray)
        if "servers" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.service)
    last = not os.environ.get("PYTEST_XDIST_WORKER")  # one process: cluster files last; `make test`'s workers: first
    items.sort(key=lambda item: (item.get_closest_marker("cluster") is not None) == last)  # stable otherwise


def cpu_probe_s(n: int = 4_000_000) -> float:
    """Seconds this machine takes for a fixed piece of single-threaded Python work (``n`` = 4M: ~0.18 s on an
    idle core here): a run's test times read against it, since this shared machine's speed swings (a CI whose
    job tests took 2.7x their time of an hour later, on identical code and packages: NOTES.md, issue 56)."""
    import time

    t, x = time.perf_counter(), 0
    for i in range(n):
        x += i * i % 7
    return round(time.perf_counter() - t, 3)


def _xml(config):
    """pytest's junitxml writer: only where --junitxml is given (not in xdist's workers)."""
    from _pytest.junitxml import xml_key

    return config.stash.get(xml_key, None)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    if _xml(session.config) is not None:  # the probe as the run starts and as it ends: benchmarks/test_times.py
        _xml(session.config).add_global_property("cpu_probe_start_s", cpu_probe_s())


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session):
    if _xml(session.config) is not None:
        _xml(session.config).add_global_property("cpu_probe_end_s", cpu_probe_s())


@pytest.fixture(autouse=True, scope="module")
def _cpu_probe_per_module(request):
    """A short probe (1M: ~0.045 s) as each test module starts, where the run keeps test times (one process:
    ``make test``'s second stage), named ``cpu_probe_module_s:<module>``."""
    if _xml(request.config) is not None:
        name = f"cpu_probe_module_s:{request.module.__name__}"
        _xml(request.config).add_global_property(name, cpu_probe_s(1_000_000))
    yield


_TINKER_CLIENTS: list = []  # weak references to every tinker ServiceClient the suite made


@pytest.fixture(scope="session", autouse=True)
def _tinker_clients_tracked():
    """Remember every tinker ``ServiceClient`` a test makes (itself or through tinker-cookbook), so that
    :func:`close_tinker_clients` can close them before their server stops: an open one keeps sending
    session heartbeats, which failed loudly after the server was gone and after pytest closed its output."""
    try:
        import tinker
    except ImportError:
        yield
        return
    import weakref

    from tinker.lib.internal_client_holder import InternalClientHolder

    made = {cls: cls.__init__ for cls in (tinker.ServiceClient, InternalClientHolder)}

    def tracking(cls):
        def tracked(self, *args, **kwargs):
            made[cls](self, *args, **kwargs)
            _TINKER_CLIENTS.append(weakref.ref(self))
        return tracked

    for cls in made:  # the holders too: one outlives its ServiceClient, and its heartbeats go on
        cls.__init__ = tracking(cls)
    yield
    for cls, init in made.items():
        cls.__init__ = init
    close_tinker_clients()


def close_tinker_clients() -> int:
    """Close every tinker ServiceClient still open (its session ends on the server) and then every client
    holder left (its heartbeats stop); returns how many were open."""
    import tinker

    live = [c for c in (ref() for ref in _TINKER_CLIENTS) if c is not None and not getattr(c, "_closed", True)]
    _TINKER_CLIENTS.clear()
    for client in sorted(live, key=lambda c: not isinstance(c, tinker.ServiceClient)):  # sessions first
        try:
            done = client.close("success") if isinstance(client, tinker.ServiceClient) else client.close()
            if done is not None:
                done.result(timeout=10)
        except Exception:  # noqa: BLE001 - its server may be gone already: the local side is closed anyway
            pass
    return len(live)


@pytest.fixture(scope="session")
def tiny_path() -> str:
    from otray.models import resolve_model_path

    return resolve_model_path("tiny", ROOT / ".cache" / "models")


@pytest.fixture(scope="session")
def vl_path() -> str:
    """otray's tiny vision-language model (a Qwen2-VL), built once into the model cache."""
    from otray.models import resolve_model_path

    return resolve_model_path("tiny-vl", ROOT / ".cache" / "models")


@pytest.fixture(scope="session")
def tokenizer(tiny_path):
    from otray.models import load_tokenizer

    return load_tokenizer(tiny_path)


@pytest.fixture(scope="session")
def ray_local():
    import ray

    # "local": always a cluster of its own; with no address Ray connects to the last `ray start`
    # recorded in /tmp/ray/ray_current_cluster, a file a stopped cluster leaves behind (CI failed so)
    # no runtime_env: the variables above are inherited (one would start every actor through setup_worker.py)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def kill_resource_manager() -> None:
    """Kill the cluster's ResourceManager, if any, and wait until its name is free.

    It is a detached actor: one a test leaves behind outlives the test, and the next
    ``get_or_create`` would hand it (with its registry) to a test that asked for another.
    """
    import time

    import ray

    from otray.actors.control.resource_manager import NAME, NAMESPACE

    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            ray.kill(ray.get_actor(NAME, namespace=NAMESPACE))
        except ValueError:
            return
        time.sleep(0.1)
    raise AssertionError("the ResourceManager's name was not released 30 s after ray.kill")


def fresh_resource_manager(db_path, **kwargs):
    """A new ResourceManager on ``db_path`` (any earlier one killed first), ready for calls."""
    import ray

    from otray.actors.control.resource_manager import get_or_create

    kill_resource_manager()
    rm = get_or_create(str(db_path), **kwargs)
    ray.get(rm.ping.remote())
    return rm


def _ray_cluster_processes() -> dict[int, str]:
    """PID -> command of the root processes (GCS servers, raylets) of the Ray clusters this pytest process's
    tests started: under pytest-xdist (`make test`'s first stage) a cluster started by the other worker's test
    is not this worker's to judge (their environments name different ``PYTEST_XDIST_WORKER``s, which the
    cluster's processes inherit from whoever started them, a subprocess's included), nor one that another
    program started (no ``OTRAY_PYTEST_RUN`` of this run: a benchmark beside a test run lost its clusters so)."""
    import psutil

    worker, run = os.environ.get("PYTEST_XDIST_WORKER"), os.environ["OTRAY_PYTEST_RUN"]
    out = {}
    for p in psutil.process_iter(["pid", "name", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if p.info["name"] in ("gcs_server", "raylet") or "/ray/gcs/gcs_server" in cmd or "/raylet/raylet" in cmd:
            try:
                env = p.environ()
                if env.get("PYTEST_XDIST_WORKER") != worker or env.get("OTRAY_PYTEST_RUN") != run:
                    continue
            except (psutil.Error, OSError):  # gone meanwhile, or not readable: not this worker's to kill
                continue
            out[p.info["pid"]] = cmd
    return out


@pytest.fixture(autouse=True, scope="module")
def no_ray_cluster_left_behind(request):
    """A test module that starts a Ray cluster of its own (``ray start``, ``Cluster``, a subprocess's
    ``ray.init``) and leaves its processes running fails here; the suite's shared cluster
    (``ray_local``, started before or during the module and stopped at the end) is exempt."""
    import time

    before = _ray_cluster_processes()
    yield
    import ray

    session = ""
    if ray.is_initialized():  # the cluster this process is connected to: its processes name its session dir
        session = os.path.basename(ray._private.worker._global_node.get_session_dir_path())
    deadline = time.time() + 15
    while True:
        left = {pid: cmd for pid, cmd in _ray_cluster_processes().items()
                if pid not in before and not (session and session in cmd)}
        if not left or time.time() > deadline:
            break
        time.sleep(0.5)
    if left:
        import signal

        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        pytest.fail(f"{request.module.__name__} left Ray cluster processes running (killed now): "
                    f"{ {pid: cmd[:160] for pid, cmd in left.items()} }")


@pytest.fixture(autouse=True, scope="module")
def no_resource_manager_left_behind(request):
    """A test module that leaves a ResourceManager running fails here (and the manager is killed)."""
    yield
    import ray

    from otray.actors.control.resource_manager import NAME, NAMESPACE

    if not ray.is_initialized():
        return
    try:
        ray.get_actor(NAME, namespace=NAMESPACE)
    except ValueError:
        return
    kill_resource_manager()
    pytest.fail(f"{request.module.__name__} left a ResourceManager running: kill it in the test's teardown "
                "(tests.conftest.kill_resource_manager), or the next module's get_or_create hands it out")


def heavy_imports_of(*modules: str) -> list[str]:
    """Which of torch, vllm and transformers a fresh interpreter has imported after importing ``modules``:
    for modules that processes other than the learner and the workers import (each heavy import costs a
    process seconds of CPU as it starts)."""
    import subprocess
    import sys

    code = (f"import sys; import {', '.join(modules)};"
            " print(','.join(m for m in ('torch', 'vllm', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return [m for m in out.stdout.strip().split(",") if m]


# Ray Serve's one HTTP port in this pytest process (each xdist worker has its own local Ray, and so its own
# Serve): the tinker and serve test modules all use it, so Serve is started once per worker, not once per module
# (a module's apps are deleted when it ends; Serve's controller and proxy stay for the next module)
SERVE_PORT = 8020 + 10 * int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)


def tinker_service(ray_local, tmp: Path, port: int, tiny_path: str, model: Optional[dict] = None, **overrides):
    """Start ``otray tinker`` on ``port`` with auth on and users alice, bob and carol (made by alice, an admin).

    The base model is offered as ``Qwen/Qwen3-8B`` (a cookbook registry name) mapped to the tiny
    model, sampled by its learner, with ``model``'s settings (tests/tinker/test_engines.py passes ``models`` with vLLM
    samplers). Returns ``(keys, stop)``: the users' ``tml-`` keys and a function that stops it all.
    """
    from ray import serve

    from otray.actors.control.registry import tinker_key
    from otray.tinker.gateway.app import run
    from otray.tinker.config import load_tinker
    from otray.tinker.service.tinker_service import NAME, NAMESPACE

    rm = fresh_resource_manager(tmp / "registry.db", auth_enabled=True)
    alice = ray_local.get(rm.add_user.remote("alice"))
    bob = ray_local.get(rm.add_user.remote("bob", False, alice))
    carol = ray_local.get(rm.add_user.remote("carol", False, alice))
    models = [{"name": "Qwen/Qwen3-8B", "path": tiny_path, "sampler": {"engine": "learner"}, **(model or {})}]
    run(load_tinker({"port": port, "storage": str(tmp / "store"), "long_poll_s": 5, "models": models, **overrides}))

    def stop() -> None:
        from otray.tinker.gateway.app import APP_NAME

        close_tinker_clients()  # before the server goes: their sessions end cleanly
        for app in (APP_NAME, f"{APP_NAME}-openai"):  # Serve itself stays up for the next module (SERVE_PORT)
            serve.delete(app)
        try:
            ray_local.kill(ray_local.get_actor(NAME, namespace=NAMESPACE))
        except ValueError:
            pass
        kill_resource_manager()

    return {"alice": tinker_key(alice), "bob": tinker_key(bob), "carol": tinker_key(carol), "store": tmp / "store"}, stop


def tinker_fixture(port: int, name: str, **overrides):
    """A module-scoped ``svc`` fixture: :func:`tinker_service` on ``port`` (its store under a temporary
    directory named ``name``) with ``overrides`` of the service config, stopped after the module."""

    @pytest.fixture(scope="module")
    def svc(ray_local, tmp_path_factory, tiny_path):
        keys, stop = tinker_service(ray_local, tmp_path_factory.mktemp(name), port, tiny_path, **overrides)
        yield keys
        stop()

    return svc
