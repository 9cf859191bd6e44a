"""A sandboxed Python tool, and a math env that lets the policy use it.

:func:`run_python` runs model-written code in a separate process:

- limits: CPU seconds (``RLIMIT_CPU``), address space (``RLIMIT_AS``), size of any
  file it writes (``RLIMIT_FSIZE``), wall-clock time (the whole process group is
  killed), and captured output (truncated);
- isolation: a fresh temp dir as cwd, ``python -I -S`` (no user site, no env vars),
  an empty environment, and an audit hook installed before the code runs that
  refuses network use (``socket.*``), new processes (``subprocess``, ``os.exec*``,
  ``os.fork``, ``os.system``), native code (``ctypes``), and any file write,
  rename, removal or directory change outside the temp dir. Audit hooks cannot be
  removed from inside the interpreter.

It is a guard against the mistakes and accidents of a policy under training, not
a boundary against a determined attacker (that needs OS isolation: containers,
seccomp, a VM). Every failure comes back as a :class:`PythonResult` with ``ok=False``
and a one-line reason; nothing raises into the env.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from envs.answers import ExactAnswer
from otray.env import Env, register
from otray.tools import Tool, ToolEnv, ToolFailure

# Runs inside the child before the user's code; ``ROOT`` is the sandbox dir.
_BOOT = r'''
import os, sys
ROOT = os.path.realpath(sys.argv[1])
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
_BLOCKED = ("socket.", "subprocess.", "os.exec", "os.posix_spawn", "os.fork", "os.forkpty", "os.system",
            "os.spawn", "pty.", "ctypes.", "os.kill", "os.killpg", "signal.", "resource.setrlimit", "sys.addaudithook",
            "os.chroot", "os.setuid", "shutil.rmtree")
_PATH_EVENTS = {"os.remove": 0, "os.rmdir": 0, "os.rename": 0, "os.replace": 0, "os.mkdir": 0, "os.chmod": 0,
                "os.chown": 0, "os.link": 1, "os.symlink": 1, "os.truncate": 0, "os.utime": 0, "os.chdir": 0,
                "os.unlink": 0}

def _inside(path):
    try:
        p = os.path.realpath(os.fspath(path))
    except TypeError:
        return False
    return p == ROOT or p.startswith(ROOT + os.sep)

def _hook(event, args):
    if event.startswith(_BLOCKED):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "open":
        path, mode, flags = args
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (flags & _WRITE_FLAGS)
        if writing and path is not None and not isinstance(path, int) and not _inside(path):
            raise PermissionError(f"sandbox: writing {path!r} is not allowed (only inside the working dir)")
    elif event in _PATH_EVENTS:
        if event in ("os.rename", "os.replace", "os.link", "os.symlink"):
            targets = args[:2]
        else:
            targets = args[:1]
        for t in targets:
            if not isinstance(t, int) and not _inside(t):
                raise PermissionError(f"sandbox: {event} on {t!r} is not allowed (only inside the working dir)")

os.chdir(ROOT)
sys.dont_write_bytecode = True
sys.addaudithook(_hook)
del _hook
code = sys.stdin.read()
exec(compile(code, "<tool>", "exec"), {"__name__": "__main__"})
'''


@dataclass
class PythonResult:
    ok: bool
    output: str  # stdout (+ stderr), truncated to the output limit
    error: str | None = None  # one line: why it failed


def _limits(cpu_s: int, memory_mb: int, file_mb: int):
    def apply() -> None:
        os.setsid()
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_mb << 20, file_mb << 20))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return apply


def run_python(code: str, *, cpu_s: int = 2, wall_s: float = 5.0, memory_mb: int = 512, file_mb: int = 1,
               max_output: int = 2000) -> PythonResult:
    """Run ``code`` in the sandbox; what it prints is the result."""
    if not isinstance(code, str):
        return PythonResult(False, "", f"code must be a string, got {type(code).__name__}")
    workdir = tempfile.mkdtemp(prefix="otray-py-")
    try:
        proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _BOOT, workdir], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=workdir, env={},
                                preexec_fn=_limits(cpu_s, memory_mb, file_mb))
        try:
            out, _ = proc.communicate(code.encode(errors="replace"), timeout=wall_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return PythonResult(False, "", f"timed out after {wall_s:g} s")
        text = out.decode(errors="replace")
        if len(text) > max_output:
            text = text[:max_output] + f"\n... [output truncated at {max_output} characters]"
        if proc.returncode == 0:
            return PythonResult(True, text)
        return PythonResult(False, text, _why(proc.returncode, text, cpu_s))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _why(code: int, text: str, cpu_s: int) -> str:
    if code == -signal.SIGXCPU or code == -signal.SIGKILL:
        return f"killed: CPU time limit ({cpu_s} s)"
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    last = lines[-1] if lines else ""
    if "MemoryError" in last:
        return "MemoryError: memory limit exceeded"
    if code < 0:
        return f"killed by signal {signal.Signals(-code).name}"
    return last[:300] or f"exited with status {code}"


def python_tool(code: str) -> str:
    result = run_python(code)
    if not result.ok:
        raise ToolFailure(f"{result.error}" + (f"\n{result.output[-500:]}" if result.output else ""))
    return result.output.strip() or "(no output; print the result)"


class MathWithCode(ExactAnswer, ToolEnv, Env):
    """Math word problems (dataset: ``envs.math_word:make_dataset``); the policy may run Python."""

    system_prompt = ('You may run Python: <tool_call>{"name": "python", "arguments": {"code": "print(6*7)"}}'
                     '</tool_call>. Put the final answer in \\boxed{}.')
    tools = {"python": Tool(python_tool, ("code",), "runs Python in a sandbox; returns what it prints")}

    def __init__(self, max_turns: int = 3):
        self.max_turns = max_turns


register("math_code", MathWithCode)
