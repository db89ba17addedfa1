"""`pyserve serve` (or `pyserve router`) as a child process on loopback: started on a free port (the
installed package, its log in a file in a work directory, an API key in its environment: see
pyserve.child_process), stopped the way an operator stops it (SIGTERM: the server drains). Used by
`pyserve eval` and by the tests and benchmarks."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from pyserve.child_process import module_command, split_secrets


def start_server(model_dir: Path | str | None, *flags: str, workdir: Path,
                 env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """Starts `pyserve serve MODEL FLAGS` (no MODEL when `model_dir` is None: the embedded default)
    on a free loopback port and returns once /health answers. `env`: variables set for it.

    It runs from `workdir` and logs to a file there: an unread pipe would fill up and block it.
    """
    model = [] if model_dir is None else [str(model_dir)]
    return _start(["serve", *model], flags, workdir, env)


def start_router(replicas: list[str], *flags: str, workdir: Path) -> tuple[subprocess.Popen, str]:
    """Starts `pyserve router --replica URL... FLAGS` as start_server starts a server; returns once
    its /health answers 200 (a replica is up)."""
    return _start(["router", *(f"--replica={url}" for url in replicas)], flags, workdir)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(args: list[str], flags: tuple[str, ...], workdir: Path,
           env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    import httpx

    port = free_port()
    flags, secrets = split_secrets(flags)
    cmd = [*module_command("pyserve.cli"), *args, "--port", str(port), *flags]
    log_path = Path(workdir) / f"{args[0]}-{port}.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=workdir,
                                env={**os.environ, **(env or {}), **secrets})
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{args[0]} exited with {proc.returncode}: {log_path.read_text()[-3000:]}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    stop_server(proc)
    raise RuntimeError(f"{args[0]} did not start within 120 s")


def stop_server(proc: subprocess.Popen) -> int:
    """SIGTERM (the server drains), then its exit code; killed if it does not stop in 60 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()
