"""Run an untrusted Python program in a bubblewrap sandbox: the OS boundary of the code tool.

:func:`run_python_sandboxed` starts ``bwrap`` (Debian's ``bubblewrap``; ``make`` installs it)
with every namespace unshared (network, PID, IPC, UTS, mount, user/cgroup where allowed), the
system's ``/usr`` and the interpreter's own prefix bound read-only, a fresh ``/proc`` and
``/dev``, a size-capped tmpfs as the only writable directory (``/sandbox``), an empty
environment, a new session and ``--die-with-parent``. Nothing else of the host's filesystem
exists inside: not the project, not the registry, not ``~/.ray``, not other processes'
``/proc`` entries. Inside, rlimits (CPU seconds, address space, file size) hold, the wall clock
kills the whole sandbox (its PID namespace dies with its first process), and output is read up
to a byte cap and never buffered past it.

Where bubblewrap cannot run, :func:`sandbox_problem` says why and the code tool refuses,
unless an admin set ``OTRAY_CODE_TOOL_UNSAFE=1`` on the cluster (then the program runs in a
plain child process with the same limits: a guard against accidents, not attacks).
"""

from __future__ import annotations

import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import lru_cache

UNSAFE_ENV = "OTRAY_CODE_TOOL_UNSAFE"
WORKDIR = "/sandbox"


class SandboxUnavailable(RuntimeError):
    """bubblewrap is missing or cannot create namespaces here, and unsafe mode is off."""


@dataclass
class Ran:
    """What came back: exit status (None: killed by the wall clock), output up to the cap."""

    returncode: int | None
    output: bytes
    truncated: bool
    timed_out: bool


def _interpreter() -> tuple[str, list[str]]:
    """The real Python binary and the directories it needs, bound read-only inside."""
    python = os.path.realpath(sys.executable)
    prefixes = {os.path.realpath(sys.base_prefix), os.path.realpath(sys.base_exec_prefix)}
    return python, sorted(p for p in prefixes if not p.startswith("/usr"))


def bwrap_argv(program: list[str], tmpfs_mb: int = 64) -> list[str]:
    """The ``bwrap`` command line that runs ``program`` (argv inside the sandbox) in ``/sandbox``."""
    _, prefixes = _interpreter()
    argv = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--clearenv",
            "--ro-bind", "/usr", "/usr", "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64",
            "--symlink", "usr/bin", "/bin", "--proc", "/proc", "--dev", "/dev",
            "--size", str(tmpfs_mb << 20), "--tmpfs", WORKDIR, "--chdir", WORKDIR]
    for p in prefixes:
        argv += ["--ro-bind", p, p]
    return argv + ["--", *program]


@lru_cache(maxsize=1)
def sandbox_problem() -> str | None:
    """None when bubblewrap runs here; else why not (checked once per process)."""
    if shutil.which("bwrap") is None:
        return "bubblewrap (bwrap) is not installed: `apt-get install bubblewrap` (make does it)"
    python, _ = _interpreter()
    try:
        probe = subprocess.run(bwrap_argv([python, "-I", "-S", "-c", "print('ok')"]), capture_output=True,
                               timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"bwrap did not run: {e}"
    if probe.returncode != 0 or probe.stdout.strip() != b"ok":
        return f"bwrap cannot create its namespaces here: {probe.stderr.decode(errors='replace').strip()[:300]}"
    return None


def require_sandbox() -> None:
    """Raise SandboxUnavailable unless code can run sandboxed here (or an admin allowed unsafe runs)."""
    problem = sandbox_problem()
    if problem is not None and os.environ.get(UNSAFE_ENV) != "1":
        raise SandboxUnavailable(f"the code tool refuses to run without its sandbox: {problem}. An admin who "
                                 f"accepts unsandboxed code on this cluster can set {UNSAFE_ENV}=1")


def _limits(cpu_s: int, memory_mb: int, file_mb: int):
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_mb << 20, file_mb << 20))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return apply


def _read_capped(proc: subprocess.Popen, cap: int, deadline: float) -> tuple[bytes, bool, bool]:
    """Read ``proc``'s stdout until it closes, ``cap`` bytes arrived, or ``deadline`` passes."""
    chunks, size, fd = [], 0, proc.stdout.fileno()
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return b"".join(chunks), False, True
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        data = os.read(fd, 65536)
        if not data:
            return b"".join(chunks), False, False
        chunks.append(data)
        size += len(data)
        if size > cap:
            return b"".join(chunks)[:cap], True, False


def run_python_sandboxed(boot: str, args: list[str], code: bytes, *, wall_s: float, cpu_s: int, memory_mb: int,
                         file_mb: int, max_output: int) -> Ran:
    """Run ``python -I -S -c boot *args`` with ``code`` on stdin, sandboxed (or, in unsafe mode, not)."""
    python, _ = _interpreter()
    require_sandbox()
    cwd = None
    if sandbox_problem() is not None:  # unsafe mode, set by an admin: a plain child process in a temp dir
        import tempfile

        cwd = tempfile.mkdtemp(prefix="otray-py-")
    program = [python, "-I", "-S", "-c", boot, *[cwd if cwd and a == WORKDIR else a for a in args]]
    argv = program if cwd else bwrap_argv(program, tmpfs_mb=max(16, 4 * file_mb))
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=cwd,
                            env={}, start_new_session=True, preexec_fn=_limits(cpu_s, memory_mb, file_mb))
    try:
        try:
            proc.stdin.write(code)
            proc.stdin.close()
        except BrokenPipeError:
            pass
        out, truncated, timed_out = _read_capped(proc, max_output, time.monotonic() + wall_s)
        if truncated or timed_out:
            os.killpg(proc.pid, signal.SIGKILL)  # the sandbox's PID namespace goes with its first process
        try:
            code_ = proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            code_ = proc.wait()
        if cwd is None and code_ is not None and code_ > 128:
            code_ = 128 - code_  # bwrap exits 128 + N when its child died of signal N: report it as -N
        return Ran(None if timed_out else code_, out, truncated, timed_out)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # detached children of an unsafe run die with the tool call
        except ProcessLookupError:
            pass
        if cwd is not None:
            shutil.rmtree(cwd, ignore_errors=True)
