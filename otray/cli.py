"""The ``otray`` command.

    otray train CONFIG [key=value ...]   submit, stream the per-step table, exit 0 on success
    otray jobs | status JOB | metrics JOB | cancel JOB
    otray users add NAME [--admin] | delete NAME | rotate [NAME] | list   (keys are printed once)
    otray modules allow MODULE ... | list  the code users' configs may name besides the bundled envs
    otray urls allow URL ... | list        the addresses users' envs may reach (an OpenReward server)
    otray tiny-model DIR [--seed N]
    otray serve [CONFIG] [key=value ...]  the OpenAI-compatible app (+ dashboard), until Ctrl-C
    otray tinker [CONFIG] [key=value ...] the Tinker-compatible training API (tinker SDK), until Ctrl-C
    otray infer CONFIG [--checkpoint REF] [--split eval] [--limit N] [--out FILE] [key=value ...]

``--address`` (or ``RAY_ADDRESS``) joins a running cluster (``auto``: the last ``ray start`` on this
machine); without it a local Ray starts for the command. ``OTRAY_API_KEY`` carries the key when auth is on.
Exit codes: 0 success, 1 the job failed or was cancelled, 2 bad input (also when the cluster
found it: a job that failed with a config, dataset, model-path or permission error).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from otray import metric_keys as K
from otray.records import JobState, JobStatus
from otray.types import ConfigError, OtrayError

# a job that failed with one of these (its stored error starts with the type) failed on bad input: exit 2
INPUT_ERRORS = ("ConfigError", "ForbiddenConfigError", "DatasetError", "ModelLoadError", "AuthError")


def innermost(e: BaseException) -> BaseException:
    """The exception an actor raised, out of Ray's wrapper (``cause``) or a chain of re-raises."""
    seen = set()
    while id(e) not in seen:
        seen.add(id(e))
        inner = getattr(e, "cause", None)
        if isinstance(inner, BaseException) and inner is not e:
            e = inner
        else:
            break
    return e


def error_line(e: BaseException) -> str:
    """What was wrong, on one line (a multi-line message's lines joined; ``e`` is the actor's own
    exception, :func:`innermost`, so no remote traceback comes with it)."""
    text = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
    return " ".join(line.strip() for line in str(text).splitlines() if line.strip()) or type(e).__name__


def report_failure(job_id: str, st: JobStatus) -> int:
    """Print why a job ended unsuccessfully; its exit code: 2 for bad input (config, data, model, key), else 1."""
    print(f"job {job_id} {st.state.value}: {st.error}", file=sys.stderr)
    return 2 if (st.error or "").split(":", 1)[0] in INPUT_ERRORS else 1


def _connect(args: argparse.Namespace):
    from otray.client import connect

    return connect(args.address, args.api_key)


def cmd_train(args: argparse.Namespace) -> int:
    from otray import config as config_mod
    from otray.actors.job.run import HEADER, table_row

    config_mod.load(args.config, args.overrides)  # fail before touching a cluster
    client = _connect(args)
    job = client.submit(args.config, args.overrides)
    print(f"submitted job {job.id}", flush=True)
    tag_ray_job(job.id)
    cursor, state, told = -1, None, Told()
    while True:
        st = job.status()
        page = job.metrics_after(cursor)
        rows, cursor = page.rows, page.cursor
        if st.state != state and not st.terminal:
            state = st.state
            print(f"[{job.id}] {state.value}", flush=True)
            if state is JobState.RUNNING:
                print(HEADER, flush=True)
        if st.waiting and told.due(st.waiting):
            print(f"[{job.id}] QUEUED: {st.waiting}", flush=True)
        for row in rows:
            print(table_row(row), flush=True)
        if st.terminal and not rows:
            print(f"[{job.id}] {st.state.value}", flush=True)
            break
        time.sleep(0.5)
    if not st.succeeded:
        return report_failure(job.id, st)
    evals = [r for r in job.metrics() if K.EVAL_ACCURACY in r]
    start = next((r for r in evals if r.get(K.PHASE) in (K.PHASE_SFT, K.PHASE_INIT)), evals[0] if evals else None)
    if start is not None:
        change, se = evals[-1][K.EVAL_ACCURACY] - start[K.EVAL_ACCURACY], start.get(K.EVAL_STDERR)
        print(f"held-out accuracy: {start[K.EVAL_ACCURACY]:.3f} before RL -> {evals[-1][K.EVAL_ACCURACY]:.3f} after"
              + (f" ({100 * change:+.1f} points; standard error {100 * se:.1f})" if se is not None else ""))
    return 0


class Told:
    """When to print why a queued job waits: after it has waited ``first_s``, then when the reason
    changes, at most every ``every_s`` (the free resources it names change often)."""

    def __init__(self, first_s: float = 10.0, every_s: float = 60.0):
        self.start, self.first_s, self.every_s = time.monotonic(), first_s, every_s
        self.last: tuple[float, str] | None = None

    def due(self, reason: str) -> bool:
        now = time.monotonic()
        if now - self.start < self.first_s or (self.last and (self.last[1] == reason or now - self.last[0] < self.every_s)):
            return False
        self.last = (now, reason)
        return True


def tag_ray_job(job_id: str) -> str | None:
    """When this process is the entrypoint of a ``ray job submit``, add ``otray_job_id`` to that Ray job's
    metadata, so the Ray dashboard's job list leads to the otray job. Returns the Ray submission id
    (None outside a Ray job). Ray has no public call to change a submitted job's metadata; this writes
    its job record the way Ray's job manager does (which keeps the metadata on every later status
    change), and only logs if that record's format ever changes."""
    import asyncio
    import os

    submission = (json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR") or "{}").get("metadata") or {}).get(
        "job_submission_id")
    if not submission:
        return None
    try:
        import ray
        from ray.dashboard.modules.job.common import JobInfoStorageClient

        store = JobInfoStorageClient(ray._private.worker.global_worker.gcs_client)

        async def tag() -> None:
            info = await store.get_info(submission)
            if info is not None:
                info.metadata = {**(info.metadata or {}), "otray_job_id": job_id}
                await store.put_info(submission, info)

        asyncio.run(tag())
    except Exception as e:  # noqa: BLE001 - a label for the dashboard, never a reason to fail the job
        print(f"note: could not add otray_job_id to Ray job {submission}'s metadata ({type(e).__name__}: {e})",
              file=sys.stderr)
    return submission


def cmd_jobs(args: argparse.Namespace) -> int:
    jobs = _connect(args).jobs()
    print(f"{'id':<24} {'owner':<10} {'name':<20} {'state':<10} {'step':>5} {'reward':>7}  (loss for sft/tinker)")
    for j in jobs:
        reward = K.headline_reward(j.progress)
        print(f"{j.id:<24} {j.owner:<10} {j.name[:20]:<20} {j.state.value:<10} {j.progress.get(K.STEP, ''):>5} "
              f"{'' if reward is None else f'{reward:.3f}':>7}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    print(json.dumps(_connect(args).job(args.job).status().to_json(), indent=1))
    return 0


def cmd_metrics(args: argparse.Namespace) -> int:
    rows = _connect(args).job(args.job).metrics()
    if args.breakdown:
        from otray.timing import breakdown_table

        print(breakdown_table(rows))
        return 0
    for row in rows:
        print(json.dumps(row))
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    print(_connect(args).job(args.job).cancel().state.value)
    return 0


def cmd_users(args: argparse.Namespace) -> int:
    import ray

    client = _connect(args)
    rm, key = client.rm, client.api_key
    if args.users_cmd == "list":
        for u in ray.get(rm.users.remote(api_key=key)):
            print(f"{u.name}{'  (admin)' if u.admin else ''}")
    elif args.users_cmd == "quota":
        if args.jobs is not None:
            ray.get(rm.set_job_quota.remote(args.name, args.jobs, api_key=key))
        print(f"{args.name}: {ray.get(rm.job_quota.remote(args.name, api_key=key))} jobs queued or running at once")
    elif args.users_cmd == "delete":
        ray.get(rm.delete_user.remote(args.name, api_key=key))
        print(f"deleted {args.name}; their key no longer works")
    else:
        new = (client.add_user(args.name, args.admin) if args.users_cmd == "add"
               else ray.get(rm.rotate_key.remote(args.name, api_key=key)))
        from otray.actors.control.registry import tinker_key

        print(f"API key for {args.name or 'you'} (shown once, store it now):\n{new}\n"
              f"the same key for the Tinker API (TINKER_API_KEY, `otray tinker`):\n{tinker_key(new)}")
    return 0


def cmd_allow(args: argparse.Namespace) -> int:
    """``otray modules ...`` / ``otray urls ...``: list what users' configs may name besides the bundled
    code (modules) or reach (addresses), or, as an admin, add to it."""
    import ray

    client = _connect(args)
    rm = client.rm
    allow, allowed = ((rm.allow_modules, rm.allowed_modules) if args.allow_what == "modules"
                      else (rm.allow_urls, rm.allowed_urls))
    if args.allow_cmd == "allow":
        ray.get(allow.remote(args.items, api_key=client.api_key))
    print("\n".join(ray.get(allowed.remote())))
    return 0


def cmd_tiny(args: argparse.Namespace) -> int:
    from otray.models import build_tiny_model

    print(f"built tiny model in {build_tiny_model(args.dir, args.seed)}")
    return 0


def _until_interrupted() -> int:
    """Keep a Serve app up until Ctrl-C, then shut Serve down."""
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        from ray import serve

        serve.shutdown()
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from otray.serve.app import run
    from otray.serve.config import load_serve

    cfg = load_serve(args.config, args.overrides)  # fail before touching a cluster
    _connect(args)  # joins (or starts) the cluster and its ResourceManager, which holds the checkpoints
    run(cfg)
    print(f"serving on http://{cfg.host}:{cfg.port}/v1 (models: {', '.join(m.name for m in cfg.models)}); "
          f"dashboard at http://{cfg.host}:{cfg.port}/dashboard; Ctrl-C stops", flush=True)
    return _until_interrupted()


def cmd_tinker(args: argparse.Namespace) -> int:
    from otray.tinker.gateway.app import ROUTE_PREFIX, run
    from otray.tinker.config import load_tinker

    cfg = load_tinker(args.config, args.overrides)  # fail before touching a cluster
    _connect(args)  # the ResourceManager checks keys when auth is on
    run(cfg)
    print(f"Tinker API on http://{cfg.host}:{cfg.port}{ROUTE_PREFIX} (base models: "
          f"{', '.join(m.name for m in cfg.models)}): TINKER_BASE_URL=http://{cfg.host}:{cfg.port}; OpenAI-compatible "
          f"at http://{cfg.host}:{cfg.port}/oai/api/v1; Ctrl-C stops", flush=True)
    return _until_interrupted()


def cmd_infer(args: argparse.Namespace) -> int:
    """Submit an inference job (``job.kind: infer``) to the ResourceManager, follow it, write its rows."""
    from pathlib import Path

    from otray import config as config_mod

    overrides = [*args.overrides, "job.kind=infer", f"infer.split={args.split}"]
    if args.checkpoint:
        local = Path(args.checkpoint)  # a directory here: the job driver reads it by its absolute path
        overrides.append(f"infer.checkpoint={local.absolute() if local.exists() else args.checkpoint}")
    if args.limit is not None:
        overrides.append(f"infer.limit={args.limit}")
    if args.sample is not None:
        overrides.append(f"infer.greedy={str(not args.sample).lower()}")
    cfg = config_mod.load(args.config, overrides)  # fail before touching a cluster
    out = Path(args.out or f"runs/infer/{cfg.job.name}-{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
    client = _connect(args)
    job = client.submit(cfg)
    print(f"submitted inference job {job.id}", flush=True)
    st = job.wait()
    if not st.succeeded:
        return report_failure(job.id, st)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = job.outputs()
    with out.open("w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    summary = {k: v for k, v in job.metrics()[-1].items() if k not in (K.STEP, K.PHASE)}
    print(json.dumps({"job": job.id, **summary, "output": str(out)}, indent=1))
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="otray", description="RL for LLM agents on Ray")
    p.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS, else a local Ray)")
    p.add_argument("--api-key", default=None, help="API key (default: OTRAY_API_KEY)")
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="submit a training job and follow it")
    t.add_argument("config")
    t.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    t.set_defaults(fn=cmd_train)
    sub.add_parser("jobs", help="list jobs").set_defaults(fn=cmd_jobs)
    for name, fn in (("status", cmd_status), ("metrics", cmd_metrics), ("cancel", cmd_cancel)):
        s = sub.add_parser(name)
        s.add_argument("job")
        if name == "metrics":
            s.add_argument("--breakdown", action="store_true",
                           help="a table of each RL step's time parts and the actors' idle fractions")
        s.set_defaults(fn=fn)
    users = sub.add_parser("users", help="API keys (auth on): add, delete, rotate, list; job quotas")
    users_sub = users.add_subparsers(dest="users_cmd", required=True)
    u = users_sub.add_parser("add")
    u.add_argument("name")
    u.add_argument("--admin", action="store_true")
    users_sub.add_parser("delete").add_argument("name")
    users_sub.add_parser("rotate").add_argument("name", nargs="?", default=None, help="default: yourself")
    users_sub.add_parser("list")
    q = users_sub.add_parser("quota", help="a user's jobs queued or running at once (admin: set it)")
    q.add_argument("name", help="a user, or * for everyone's default")
    q.add_argument("--jobs", type=int, default=None)
    users.set_defaults(fn=cmd_users)
    for what, helps in (("modules", "code users may name in configs (admin)"),
                        ("urls", "addresses users' envs may reach, e.g. an OpenReward server (admin)")):
        allow = sub.add_parser(what, help=helps)
        allow_sub = allow.add_subparsers(dest="allow_cmd", required=True)
        allow_sub.add_parser("allow").add_argument("items", nargs="+", metavar=what[:-1].upper())
        allow_sub.add_parser("list")
        allow.set_defaults(fn=cmd_allow, allow_what=what)
    v = sub.add_parser("serve", help="serve base models and trained checkpoints over an OpenAI-compatible API")
    v.add_argument("config", nargs="?", default=None, help="serve config YAML (default: the tiny model)")
    v.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    v.set_defaults(fn=cmd_serve)
    t = sub.add_parser("tinker", help="serve the Tinker-compatible training API to the tinker SDK")
    t.add_argument("config", nargs="?", default=None, help="tinker config YAML (default: the tiny model)")
    t.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    t.set_defaults(fn=cmd_tinker)
    i = sub.add_parser("infer", help="run a config's envs (or game) over a split with a model or checkpoint")
    i.add_argument("config")
    i.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    i.add_argument("--checkpoint", default=None, help="JOB_ID[:STEP], a checkpoint dir or a model dir "
                                                       "(default: the config's model.path)")
    i.add_argument("--split", default="eval")
    i.add_argument("--limit", type=int, default=None, help="at most N tasks per env (games: per role and opponent)")
    i.add_argument("--out", default=None, help="JSONL file (default: runs/infer/<job name>-<time>.jsonl)")
    i.add_argument("--sample", action=argparse.BooleanOptionalAction, default=None,
                   help="sample instead of greedy decoding (default: the config's eval.greedy)")
    i.set_defaults(fn=cmd_infer)
    m = sub.add_parser("tiny-model", help="build the tiny Qwen2 model + tokenizer into DIR")
    m.add_argument("dir")
    m.add_argument("--seed", type=int, default=0)
    m.set_defaults(fn=cmd_tiny)
    return p


def config_and_overrides(config: str | None, overrides: list[str], *, required: bool) -> tuple[str | None, list[str]]:
    """An argument with ``=`` is an override, never a file name: ``otray serve port=8001`` has no config
    file and one override. A command that needs a config file gets a ConfigError saying so."""
    if config is not None and "=" in config:
        config, overrides = None, [config, *overrides]
    if required and config is None:
        raise ConfigError(f"this command needs a config file before its overrides ({' '.join(overrides)}): "
                          "e.g. otray train conf/arithmetic_grpo.yaml " + " ".join(overrides))
    return config, overrides


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args, extra = p.parse_known_args(argv)
    # key=value overrides may also come after the options (argparse stops a positional list at an option)
    if hasattr(args, "overrides") and all("=" in x and not x.startswith("-") for x in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        if hasattr(args, "config"):
            args.config, args.overrides = config_and_overrides(args.config, args.overrides,
                                                               required=args.cmd in ("train", "infer"))
        return args.fn(args)
    except Exception as e:  # noqa: BLE001 - bad input and refused keys get one line; anything else is a bug
        inner = innermost(e)
        if not isinstance(inner, (OtrayError, KeyError, PermissionError)):
            raise
        print(f"error: {error_line(inner)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
