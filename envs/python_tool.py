"""A sandboxed Python tool, and a math env that lets the policy use it.

:func:`run_python` runs model-written code in a separate process:

- limits: CPU seconds (``RLIMIT_CPU``), address space (``RLIMIT_AS``), size of any
  file it writes (``RLIMIT_FSIZE``), wall-clock time (the whole process group is
  killed), and captured output (truncated);
- isolation: a fresh work dir as cwd, ``python -I -S`` (no user site, no env vars),
  an empty environment, and an audit hook installed before the code runs that
  refuses network use (``socket.*``), new processes (``subprocess``, ``os.exec*``,
  ``os.fork``, ``os.system``), native code (``ctypes``), and any file write,
  rename, removal or directory change outside the temp dir. Audit hooks cannot be
  removed from inside the interpreter.

The hook guards against a policy's accidents; the boundary against deliberate escapes is
the OS sandbox around the process (``otray.sandbox``: bubblewrap namespaces, only a tmpfs
work dir writable, nothing of the host's files, network or processes visible). Without
bubblewrap the tool refuses to run (a ToolFailure), unless an admin set
``OTRAY_CODE_TOOL_UNSAFE=1``. Every failure comes back as a :class:`PythonResult` with
``ok=False`` and a one-line reason; nothing raises into the env.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

from envs.answers import ExactAnswer
from otray.env import Env, register
from otray.sandbox import WORKDIR, SandboxUnavailable, require_sandbox, run_python_sandboxed
from otray.tools import Tool, ToolEnv, ToolFailure

# Runs inside the child before the user's code; ``ROOT`` is the sandbox dir.
_BOOT = r'''
def _install(root):
    # Everything the hook uses is bound here, as locals of this call: user code cannot reach them
    # through module globals (the boot's globals are emptied below) or monkeypatch os.path to fool it.
    import os, sys
    realpath, fspath, sep = os.path.realpath, os.fspath, os.sep
    root = realpath(root)
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
    blocked = ("socket.", "subprocess.", "os.exec", "os.posix_spawn", "os.fork", "os.forkpty", "os.system",
               "os.spawn", "pty.", "ctypes.", "os.kill", "os.killpg", "signal.", "resource.setrlimit",
               "sys.addaudithook", "os.chroot", "os.setuid", "shutil.rmtree", "_posixsubprocess.",
               "sqlite3.")
    two_paths = frozenset(("os.rename", "os.replace", "os.link", "os.symlink"))
    path_events = frozenset(("os.remove", "os.rmdir", "os.rename", "os.replace", "os.mkdir", "os.chmod", "os.chown",
                             "os.link", "os.symlink", "os.truncate", "os.utime", "os.chdir", "os.unlink",
                             "os.listxattr", "os.setxattr", "os.removexattr"))
    startswith, isinstance_, str_, int_, any_ = str.startswith, isinstance, str, int, any

    def inside(path):
        try:
            p = realpath(fspath(path))
        except TypeError:
            return False
        return p == root or startswith(p, root + sep)

    def hook(event, args):
        if startswith(event, blocked):
            raise PermissionError("sandbox: " + event + " is not allowed")
        if event == "open":
            path, mode, flags = args
            writing = (isinstance_(mode, str_) and any_(c in mode for c in "wax+")) or (flags & write_flags)
            if writing and path is not None and not isinstance_(path, int_) and not inside(path):
                raise PermissionError("sandbox: writing " + repr(path) + " is not allowed (only inside the working dir)")
        elif event in path_events:
            for t in (args[:2] if event in two_paths else args[:1]):
                if not isinstance_(t, int_) and not inside(t):
                    raise PermissionError("sandbox: " + event + " on " + repr(t) + " is not allowed")

    os.chdir(root)
    sys.dont_write_bytecode = True
    sys.addaudithook(hook)
    return sys.stdin.read()

# the boot's own names are gone before the user's code runs (its globals are a fresh dict)
(lambda code, g: (globals().clear(), exec(compile(code, "<tool>", "exec"), g)))(
    _install(__import__("sys").argv[1]), {"__name__": "__main__", "__builtins__": __builtins__})
'''


@dataclass
class PythonResult:
    ok: bool
    output: str  # stdout (+ stderr), truncated to the output limit
    error: str | None = None  # one line: why it failed


def run_python(code: str, *, cpu_s: int = 2, wall_s: float = 5.0, memory_mb: int = 512, file_mb: int = 1,
               max_output: int = 2000) -> PythonResult:
    """Run ``code`` in the sandbox (``otray.sandbox``: bubblewrap + limits + the audit hook above);
    what it prints is the result, read up to ``max_output`` bytes."""
    if not isinstance(code, str):
        return PythonResult(False, "", f"code must be a string, got {type(code).__name__}")
    try:
        ran = run_python_sandboxed(_BOOT, [WORKDIR], code.encode(errors="replace"), wall_s=wall_s, cpu_s=cpu_s,
                                   memory_mb=memory_mb, file_mb=file_mb, max_output=max_output)
    except SandboxUnavailable as e:
        return PythonResult(False, "", str(e))
    text = ran.output.decode(errors="replace")
    if ran.timed_out:
        return PythonResult(False, text, f"timed out after {wall_s:g} s")
    if ran.truncated:
        text += f"\n... [output truncated at {max_output} bytes; the program was stopped there]"
    if ran.returncode == 0 or (ran.truncated and ran.returncode in (-signal.SIGKILL, None)):
        return PythonResult(True, text)
    return PythonResult(False, text, _why(ran.returncode, text, cpu_s))


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
        require_sandbox()  # no sandbox here: every episode fails at once, naming why (not tool errors)
        self.max_turns = max_turns


register("math_code", MathWithCode)
