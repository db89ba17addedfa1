"""Actors: asyncio tasks with one job and a bounded inbox, and the system that supervises them.

An actor shares nothing mutable; others talk to it by sending small messages to its bounded
inbox (pyserve.actors.inbox: a full inbox applies back-pressure). An actor may run on a loop of
its own thread (pyserve.actors.loop_thread): a message sent from another thread is handed to the
actor's loop, in order, and never blocks the sender. A crashed actor is never silent: the system
records the failure, tells every registered listener (which fail their waiting requests), and
stops the other actors.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from pyserve.actors.inbox import Inbox, InboxClosed
from pyserve.actors.loop_thread import LoopThread

log = structlog.get_logger("pyserve.actors")

class EngineDeadError(RuntimeError):
    """An actor crashed; the engine cannot serve any more requests."""


class Actor:
    """Subclasses implement `run`, reading messages with `receive` / `receive_nowait`."""

    def __init__(self, name: str, inbox_size: int = 1024):
        self.name = name
        self._inbox = Inbox(inbox_size)
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop `run` runs on, once started
        self._closed = False

    def bind(self) -> None:
        """Called on the loop the actor will run on, before its task starts."""
        self._loop = asyncio.get_running_loop()

    def _dead(self) -> EngineDeadError:
        """What a send to or a receive from the closed actor raises."""
        return EngineDeadError(f"actor {self.name} is closed")

    def _elsewhere(self) -> bool:
        """Whether the caller runs outside the actor's loop (another thread's loop, or none)."""
        return self._loop is not None and asyncio._get_running_loop() is not self._loop

    def _hand_over(self, message: Any) -> None:
        """Queues a message sent from another thread: the actor's loop posts it, in order."""
        if self._closed:
            raise self._dead()
        try:
            self._loop.call_soon_threadsafe(self._post_here, message)
        except RuntimeError as e:  # the actor's loop is closed
            raise self._dead() from e

    def _post_here(self, message: Any) -> None:
        try:
            self.post(message)
        except EngineDeadError:  # closed while the message was on its way: the engine is dead
            pass

    async def send(self, message: Any) -> None:
        """Queues a message, waiting while the inbox is full; EngineDeadError once the actor is
        closed (a sender blocked on a full inbox is woken up by that too). With room in the inbox
        it returns without yielding to the loop: the engine's step loop sends each step's output
        and yields once per step elsewhere. From another thread it never waits (see `post`)."""
        if self._elsewhere():
            self._hand_over(message)
            return
        try:
            await self._inbox.put(message)
        except InboxClosed as e:
            raise self._dead() from e

    def send_nowait(self, message: Any) -> None:
        """Queues a message from synchronous code; raises InboxFull when the inbox is full (or
        senders wait for it) and EngineDeadError once the actor is closed. From another thread it
        never raises InboxFull (see `post`)."""
        if self._elsewhere():
            self._hand_over(message)
            return
        try:
            self._inbox.put_nowait(message)
        except InboxClosed as e:
            raise self._dead() from e

    def post(self, message: Any) -> None:
        """Queues a message from synchronous code without ever failing on a full inbox: past the
        bound it waits in the inbox's order for a slot (from another thread: handed to the
        actor's loop first, in order). Raises EngineDeadError once the actor is closed."""
        if self._elsewhere():
            self._hand_over(message)
            return
        try:
            self._inbox.post(message)
        except InboxClosed as e:
            raise self._dead() from e

    def close(self) -> None:
        """Stops accepting messages: pending and future sends fail with EngineDeadError."""
        self._closed = True
        if not self._elsewhere():
            self._inbox.close()
            return
        try:
            self._loop.call_soon_threadsafe(self._inbox.close)
        except RuntimeError:  # its loop is closed already
            pass

    async def receive(self) -> Any:
        """The next message; waits (yielding to the loop) only when the inbox is empty.
        EngineDeadError once the actor is closed."""
        try:
            return await self._inbox.get()
        except InboxClosed as e:
            raise self._dead() from e

    def receive_nowait(self) -> Any | None:
        try:
            return self._inbox.get_nowait()
        except IndexError:
            return None
        except InboxClosed as e:
            raise self._dead() from e

    async def run(self) -> None:
        raise NotImplementedError


@dataclass(slots=True)
class _Running:
    actor: Actor
    task: asyncio.Task[None]
    loop: asyncio.AbstractEventLoop

    def cancel(self) -> None:
        if self.task.done():
            return
        try:
            self.loop.call_soon_threadsafe(self.task.cancel)
        except RuntimeError:  # its loop is closed: the task cannot run again
            pass


class ActorSystem:
    """Starts actors as tasks, on the running loop or on a LoopThread's, and supervises them from
    the loop that started them (its failure listeners run there)."""

    def __init__(self) -> None:
        self._running: list[_Running] = []
        self._failure_listeners: list[Callable[[BaseException], None]] = []
        self._home: asyncio.AbstractEventLoop | None = None
        self.error: BaseException | None = None

    @property
    def alive(self) -> bool:
        return self.error is None and bool(self._running)

    def on_failure(self, listener: Callable[[BaseException], None]) -> None:
        self._failure_listeners.append(listener)

    def start(self, *actors: Actor, thread: LoopThread | None = None) -> None:
        """Starts `actors` on the running loop, or with `thread` on that thread's loop."""
        self._home = asyncio.get_running_loop()
        for actor in actors:
            self._running.append(self._spawn(actor) if thread is None else thread.call(lambda a=actor: self._spawn(a)))

    def _spawn(self, actor: Actor) -> _Running:
        actor.bind()
        loop = asyncio.get_running_loop()
        task = loop.create_task(actor.run(), name=actor.name)
        if loop is self._home:
            task.add_done_callback(lambda t: self._on_done(actor, t))
        else:
            task.add_done_callback(lambda t: self._home.call_soon_threadsafe(self._on_done, actor, t))
        return _Running(actor, task, loop)

    def check_alive(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"engine is dead: {self.error!r}") from self.error

    async def stop(self) -> None:
        """Cancels every actor and waits until each has ended (an actor stuck in blocking work on
        its own thread ends once that work returns)."""
        for running in self._running:
            running.cancel()
        for running in self._running:
            if running.loop is self._home:
                await _ended(running.task)
            elif not running.loop.is_closed():
                await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(_ended(running.task), running.loop))
        self._running.clear()

    def fail_threadsafe(self, error: BaseException) -> None:
        """Fails the system from any thread, as an actor crashing with `error` would (something
        the actors depend on broke outside them)."""
        if self._home is not None and not self._home.is_closed():
            self._home.call_soon_threadsafe(self._fail, error, "external")

    def _on_done(self, actor: Actor, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            exc = EngineDeadError(f"actor {actor.name} stopped unexpectedly")
        self._fail(exc, actor.name)

    def _fail(self, exc: BaseException, source: str) -> None:
        if self.error is not None:
            return
        self.error = exc
        log.error("actor_crashed", actor=source, error=repr(exc))
        for listener in self._failure_listeners:
            listener(exc)
        for running in self._running:
            running.actor.close()
            running.cancel()


async def _ended(task: asyncio.Task[None]) -> None:
    try:
        await task
    except asyncio.CancelledError:
        pass
    except Exception:  # noqa: BLE001 - already recorded by the supervisor
        pass
