"""A daemon thread running an event loop of its own, for an actor whose work blocks (the
EngineCore, which runs the model's forwards inline): the caller's loop keeps serving meanwhile,
and the actor's steps follow one another without a thread hop each."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    def call(self, fn: Callable[[], T]) -> T:
        """Runs `fn` on the thread's loop and returns its result (blocking the caller meanwhile:
        only for short work, such as creating a task)."""
        done: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            try:
                done.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller
                done.set_exception(e)

        self.loop.call_soon_threadsafe(run)
        return done.result()

    def close(self) -> None:
        """Stops the loop (its tasks must have ended) and lets the thread end. A loop whose
        thread is stuck in blocking work stops once that work returns."""
        if not self.loop.is_closed():
            try:
                self.loop.call_soon_threadsafe(self.loop.stop)
            except RuntimeError:  # closed meanwhile
                pass


class SharedLoopThread:
    """One LoopThread for every holder: started by the first `acquire`, closed by the last
    `release`."""

    def __init__(self, name: str):
        self.name = name
        self._thread: LoopThread | None = None
        self._holders = 0
        self._lock = threading.Lock()

    @property
    def holders(self) -> int:
        return self._holders

    def acquire(self) -> LoopThread:
        with self._lock:
            if self._thread is None:
                self._thread = LoopThread(self.name)
            self._holders += 1
            return self._thread

    def release(self) -> None:
        with self._lock:
            self._holders -= 1
            if self._holders == 0 and self._thread is not None:
                self._thread.close()
                self._thread = None


def resolve(future: asyncio.Future[Any], error: BaseException | None = None) -> None:
    """Sets `future`'s result (None) or `error` from any thread, on the future's own loop; a
    future already done is left as it is."""

    def settle() -> None:
        if future.done():
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)

    loop = future.get_loop()
    try:
        here = asyncio.get_running_loop() is loop
    except RuntimeError:
        here = False
    if here:
        settle()
    else:
        try:
            loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the future's loop is closed: nobody waits on it any more
            pass
