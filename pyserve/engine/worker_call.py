"""How actors call the ModelWorker's blocking methods (a step's forward, a draft proposal)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio

WorkerCall = Callable[..., Awaitable[Any]]


def worker_call(on_loop: bool) -> WorkerCall:
    """`call(fn, *args)`. With `on_loop` False (the server) fn runs in a worker thread, so the
    event loop keeps serving clients during a forward. With `on_loop` True (the offline LLM,
    where nothing else waits on the loop) fn runs on the loop thread after one yield that lets
    the other actors catch up: no thread hop and no GIL hand-offs between the forward's Python
    and the loop's, which cost 15-25% of a small model's step on 2 CPU cores."""
    if not on_loop:
        return anyio.to_thread.run_sync

    async def call(fn: Callable[..., Any], *args: Any) -> Any:
        await anyio.sleep(0)
        return fn(*args)

    return call
