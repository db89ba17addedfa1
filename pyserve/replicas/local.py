"""`pyserve serve --data-parallel-size N`: N replicas of the same `pyserve serve`, each a child
process on a loopback port of its own, started and kept running (one that exits after it once
answered /health is started again) while the router serves in front of them. One that exits
before it ever answered fails the start: the command would fail every time (a bad flag, a model
that does not load). On Linux a replica gets SIGTERM when its parent dies, so none is orphaned.
A replica runs the installed package whatever the working directory, and gets the API key in its
environment, never on its command line (pyserve.child_process)."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import urllib.request

import structlog

from pyserve.child_process import module_command, split_secrets
from pyserve.server.child_server import free_port

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
        self.argv, self.secrets = split_secrets(replica_argv(serve_argv))  # secrets: environment variables
        self.ports = [free_port() for _ in range(n)]
        self.procs: list[subprocess.Popen | None] = [None] * n
        self.ready = [False] * n  # answered /health once
        self.failed: str | None = None  # why the start failed: a replica exited before it was ready
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

    def command(self, i: int) -> list[str]:
        """Replica i's command line (what `ps` shows: no secret)."""
        return [*module_command("pyserve.cli"), *self.argv, "--host", "127.0.0.1", "--port", str(self.ports[i])]

    def _spawn(self, i: int) -> None:
        self.procs[i] = subprocess.Popen(self.command(i), env={**os.environ, **self.secrets},
                                         preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        log.info("replica_started", replica=self.urls[i], pid=self.procs[i].pid)

    def _watch(self) -> None:
        while not self._stopping.wait(1.0):
            for i, p in enumerate(self.procs):
                if p is None or self._stopping.is_set():
                    continue
                if p.poll() is None:
                    self.ready[i] = self.ready[i] or _healthy(self.urls[i])
                elif not self.ready[i]:
                    self.failed = f"replica {self.urls[i]} exited with {p.returncode} before it served"
                    log.error("replica_failed_to_start", replica=self.urls[i], returncode=p.returncode)
                    os.kill(os.getpid(), signal.SIGTERM)  # the router drains and stops; the caller reports
                    return
                else:
                    log.warning("replica_exited", replica=self.urls[i], returncode=p.returncode)
                    self.ready[i] = False
                    self._spawn(i)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=0.5) as r:
            return r.status == 200
    except OSError:
        return False


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent dies (Linux's PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
