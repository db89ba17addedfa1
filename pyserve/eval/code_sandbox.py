"""The code scorer's sandbox: a program and its tests run in a subprocess that cannot hang the
harness, use the network or write outside its own temporary folder.

- Time: a wall-clock limit; past it the whole process group is killed (SIGKILL), and CPU time
  is capped too (RLIMIT_CPU).
- Memory: RLIMIT_AS; files it writes: RLIMIT_FSIZE (16 MiB). The guard script sets the limits
  in the child before the program runs (no preexec_fn: the harness has threads).
- Isolation: `python -I -B` (no user site, no PYTHON* variables, no bytecode written), an empty
  environment but PATH, HOME and TMPDIR in the folder, the folder as working directory, and an
  audit hook (installed before the program runs; Python offers no way to remove one) that
  refuses sockets, new processes (fork, exec, spawn, subprocess, os.system), ctypes, and
  opening a file for writing, or removing or renaming one, outside the folder.
The audit hook is Python-level: it holds against programs that use the standard library, not
against native code already loaded that calls the OS directly. It is what a scorer of model
output needs, not a boundary against an adversary.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

GUARD = Path(__file__).with_name("_sandbox_guard.py")
FILE_LIMIT = 16 << 20


@dataclass(slots=True)
class RunResult:
    passed: bool
    reason: str  # "passed", "failed", "timeout", "memory" or "refused"
    output: str  # the tail of stdout and stderr


def run_tests(program: str, tests: str, timeout_s: float = 10.0, memory_mb: int = 512) -> RunResult:
    """Runs `program` then `tests` (asserts) as one script in the sandbox; passed when it exits 0."""
    with tempfile.TemporaryDirectory(prefix="pyserve-eval-") as folder:
        script = Path(folder) / "solution.py"
        script.write_text(program + "\n\n" + tests + "\n", encoding="utf-8")
        env = {"PATH": os.defpath, "HOME": folder, "TMPDIR": folder, "PYTHONDONTWRITEBYTECODE": "1",
               "PYTHONIOENCODING": "utf-8"}
        cpu_s = max(1, int(timeout_s) + 1)
        # the limits are set by the guard itself, before the program: no preexec_fn (unsafe in a
        # process with threads, which the eval's event loop is)
        proc = subprocess.Popen([sys.executable, "-I", "-B", str(GUARD), folder, str(script), str(memory_mb << 20),
                                 str(cpu_s), str(FILE_LIMIT)], cwd=folder, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            return RunResult(False, "timeout", _tail(out))
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        text = _tail(out)
        if proc.returncode == 0:
            return RunResult(True, "passed", text)
        if "MemoryError" in text:
            return RunResult(False, "memory", text)
        if "SandboxRefused" in text:
            return RunResult(False, "refused", text)
        if proc.returncode == -signal.SIGXCPU or proc.returncode == -signal.SIGKILL:
            return RunResult(False, "timeout", text)
        return RunResult(False, "failed", text)


def _tail(data: bytes, limit: int = 2000) -> str:
    return data.decode("utf-8", "replace")[-limit:]


def program_of(output: str) -> str:
    """The code in a model's output: its first fenced block (```python or ```), else the output."""
    start = output.find("```")
    if start < 0:
        return output
    body = output[start + 3:]
    first_line, _, rest = body.partition("\n")
    if first_line.strip() and not first_line.strip().isidentifier():
        rest = body  # ```code on the same line
    end = rest.find("```")
    return rest if end < 0 else rest[:end]
