"""A forwarded request's tie to its replica, so that a replica which stops answering (a process
stopped or wedged: its socket stays open, nothing comes back) cannot hold the request forever.

The pool calls `lose()` on every request in flight on a replica that has failed its health checks
for `lost_timeout` seconds. A request waits on the replica only inside `waiting()`; a loss there
cancels the wait and raises ReplicaLost, a loss between two waits raises it at the next one.
Cancelling only inside `waiting()` keeps the rest of the request (sending the client the chunk
already read, the error event) out of reach of the cancel.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator


class ReplicaLost(Exception):
    """The replica stopped answering while a request was in flight on it."""


class InFlight:
    def __init__(self, replica_url: str, registry: set[InFlight]):
        self.replica_url = replica_url
        self.lost = False
        self._registry = registry
        self._task: asyncio.Task | None = None  # the task inside waiting(), if any
        self._cancelling = 0
        registry.add(self)

    def lose(self) -> None:
        if self.lost:
            return
        self.lost = True
        if self._task is not None:
            self._task.cancel()

    def close(self) -> None:
        self._registry.discard(self)

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        if self.lost:
            raise ReplicaLost(self.replica_url)
        task = asyncio.current_task()
        self._task, self._cancelling = task, task.cancelling()
        try:
            yield
        except asyncio.CancelledError:
            # Ours only if nobody else cancelled the task too (a client gone, the server stopping).
            if self.lost and task.uncancel() <= self._cancelling:
                raise ReplicaLost(self.replica_url) from None
            raise
        finally:
            self._task = None
