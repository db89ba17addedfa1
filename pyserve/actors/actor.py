"""Actors: asyncio tasks with one job and a bounded inbox, and the system that supervises them.

An actor shares nothing mutable; others talk to it by sending small messages to its inbox (an
anyio memory object stream, so a full inbox applies back-pressure). A crashed actor is never
silent: the system records the failure, tells every registered listener (which fail their waiting
requests), and stops the other actors.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import anyio
import structlog

log = structlog.get_logger("pyserve.actors")

# Posted sends waiting on a full inbox; kept referenced until they finish.
_background: set[asyncio.Task[None]] = set()


class EngineDeadError(RuntimeError):
    """An actor crashed; the engine cannot serve any more requests."""


class Actor:
    """Subclasses implement `run`, reading messages with `receive` / `receive_nowait`."""

    def __init__(self, name: str, inbox_size: int = 1024):
        self.name = name
        self._inbox_send, self._inbox_recv = anyio.create_memory_object_stream[Any](inbox_size)

    async def send(self, message: Any) -> None:
        """Queues a message, waiting while the inbox is full; EngineDeadError once the actor is
        closed (a sender blocked on a full inbox is woken up by that too). With room in the inbox
        it returns without yielding to the loop: the engine's step loop sends each step's output
        and yields once per step elsewhere."""
        try:
            self.send_nowait(message)
            return
        except anyio.WouldBlock:
            pass
        try:
            await self._inbox_send.send(message)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError) as e:
            raise EngineDeadError(f"actor {self.name} is closed") from e

    def send_nowait(self, message: Any) -> None:
        """Queues a message from synchronous code; raises anyio.WouldBlock when the inbox is full
        and EngineDeadError once the actor is closed."""
        try:
            self._inbox_send.send_nowait(message)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError) as e:
            raise EngineDeadError(f"actor {self.name} is closed") from e

    def post(self, message: Any) -> None:
        """Queues a message from synchronous code without ever failing on a full inbox: the send
        then waits in a task of its own. Raises EngineDeadError once the actor is closed."""
        try:
            self.send_nowait(message)
        except anyio.WouldBlock:
            task = asyncio.get_running_loop().create_task(self.send(message))
            _background.add(task)
            task.add_done_callback(_background.discard)

    def close(self) -> None:
        """Stops accepting messages: pending and future sends fail with EngineDeadError."""
        self._inbox_recv.close()

    async def receive(self) -> Any:
        """The next message; waits (yielding to the loop) only when the inbox is empty."""
        try:
            return self._inbox_recv.receive_nowait()
        except anyio.WouldBlock:
            return await self._inbox_recv.receive()

    def receive_nowait(self) -> Any | None:
        try:
            return self._inbox_recv.receive_nowait()
        except anyio.WouldBlock:
            return None

    async def run(self) -> None:
        raise NotImplementedError

    async def on_stop(self) -> None:
        """Called once when the system stops (after `run` ended or was cancelled)."""


class ActorSystem:
    """Starts actors as tasks on the running loop and supervises them."""

    def __init__(self) -> None:
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._actors: list[Actor] = []
        self._failure_listeners: list[Callable[[BaseException], None]] = []
        self.error: BaseException | None = None

    @property
    def alive(self) -> bool:
        return self.error is None and bool(self._tasks)

    def on_failure(self, listener: Callable[[BaseException], None]) -> None:
        self._failure_listeners.append(listener)

    def start(self, *actors: Actor) -> None:
        for actor in actors:
            task = asyncio.get_running_loop().create_task(actor.run(), name=actor.name)
            task.add_done_callback(lambda t, a=actor: self._on_done(a, t))
            self._tasks[actor.name] = task
            self._actors.append(actor)

    def check_alive(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"engine is dead: {self.error!r}") from self.error

    async def stop(self) -> None:
        tasks = [t for t in self._tasks.values() if not t.done()]
        for task in tasks:
            task.cancel()
        for task in tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
            except Exception:  # noqa: BLE001 - already recorded by the supervisor
                pass
        for actor in self._actors:
            await actor.on_stop()
        self._tasks.clear()

    def _on_done(self, actor: Actor, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            exc = EngineDeadError(f"actor {actor.name} stopped unexpectedly")
        if self.error is not None:
            return
        self.error = exc
        log.error("actor_crashed", actor=actor.name, error=repr(exc))
        for listener in self._failure_listeners:
            listener(exc)
        for other in self._actors:
            other.close()
        for task in self._tasks.values():
            if not task.done():
                task.cancel()
