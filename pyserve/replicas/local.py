"""`pyserve serve --data-parallel-size N`: N replicas of the same `pyserve serve`, each a child
process on a loopback port of its own, started and kept running (one that exits is started
again) while the router serves in front of them."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

import structlog

from pyserve.server.loopback import free_port

log = structlog.get_logger("pyserve.router")

_OWN_FLAGS = ("--data-parallel-size", "--host", "--port")


def replica_argv(argv: list[str]) -> list[str]:
    """`argv` (of `pyserve serve ...`) without the flags that belong to the front: the data
    parallel size, the host and the port."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in _OWN_FLAGS:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


class LocalReplicas:
    def __init__(self, serve_argv: list[str], n: int):
        self.argv = replica_argv(serve_argv)
        self.ports = [free_port() for _ in range(n)]
        self.procs: list[subprocess.Popen | None] = [None] * n
        self._stopping = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="pyserve-replicas", daemon=True)

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{port}" for port in self.ports]

    def start(self) -> None:
        for i in range(len(self.ports)):
            self._spawn(i)
        self._watcher.start()

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM to every replica (each drains), then waits; kills those still running."""
        self._stopping.set()
        live = [p for p in self.procs if p is not None and p.poll() is None]
        for p in live:
            p.send_signal(signal.SIGTERM)
        for p in live:
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def _spawn(self, i: int) -> None:
        cmd = [sys.executable, "-m", "pyserve.cli", *self.argv, "--host", "127.0.0.1", "--port", str(self.ports[i])]
        self.procs[i] = subprocess.Popen(cmd)
        log.info("replica_started", replica=self.urls[i], pid=self.procs[i].pid)

    def _watch(self) -> None:
        while not self._stopping.wait(1.0):
            for i, p in enumerate(self.procs):
                if p is not None and p.poll() is not None and not self._stopping.is_set():
                    log.warning("replica_exited", replica=self.urls[i], returncode=p.returncode)
                    self._spawn(i)
