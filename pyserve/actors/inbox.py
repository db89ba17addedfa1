"""An actor's inbox: a bounded FIFO for one reader on one asyncio loop.

A full inbox applies back-pressure: `put` waits for room, `post` queues a message past the bound
without waiting, and both go in the order they came, before any later message (`put_nowait`
raises InboxFull while one waits). A closed
inbox fails its waiting and later senders. A reader that finds it empty waits on one future that
the next message resolves: no extra pass of the loop per message (anyio's memory streams yield to
the loop once more on every wait, a scheduling round per message on the hot path of every step's
output). Not thread-safe: other threads hand messages to the inbox's loop (Actor does).
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any


class InboxFull(Exception):
    """put_nowait on a full inbox, or on one that senders wait for."""


class InboxClosed(Exception):
    """The inbox was closed: no message goes in, and a reader finds none once it is empty."""


class Inbox:
    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"inbox size must be at least 1, got {size}")
        self.size = size
        self._items: deque[Any] = deque()
        self._reader: asyncio.Future[None] | None = None  # the reader waiting for a message
        # Waiting for room, in order: a waiting put's turn, or a posted message.
        self._senders: deque[asyncio.Future[bool] | _Posted] = deque()
        self._reserved = 0  # slots freed for senders woken but not yet run
        self._closed = False

    def put_nowait(self, item: Any) -> None:
        if self._closed:
            raise InboxClosed
        if self._senders or len(self._items) + self._reserved >= self.size:
            raise InboxFull
        self._append(item)

    def post(self, item: Any) -> None:
        """Queues `item` without waiting: at once where there is room, else after the messages
        and senders already waiting, as soon as a slot frees."""
        try:
            self.put_nowait(item)
        except InboxFull:
            self._senders.append(_Posted(item))

    async def put(self, item: Any) -> None:
        try:
            self.put_nowait(item)
            return
        except InboxFull:
            pass
        turn: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._senders.append(turn)
        try:
            granted = await turn  # True: a slot was reserved for this sender; False: closed
        except BaseException:  # cancelled: leave the queue, or pass on the slot it was given
            if turn in self._senders:
                self._senders.remove(turn)
            elif turn.done() and not turn.cancelled() and turn.result():
                self._reserved -= 1
                self._wake_sender()
            raise
        if granted:
            self._reserved -= 1
        if self._closed:
            raise InboxClosed
        self._append(item)

    def get_nowait(self) -> Any:
        """The oldest message; IndexError when there is none (InboxClosed once closed)."""
        if self._items:
            item = self._items.popleft()
            self._wake_sender()
            return item
        if self._closed:
            raise InboxClosed
        raise IndexError("inbox is empty")

    async def get(self) -> Any:
        while not self._items and not self._closed:
            self._reader = asyncio.get_running_loop().create_future()
            try:
                await self._reader
            finally:
                self._reader = None
        return self.get_nowait()

    def close(self) -> None:
        self._closed = True
        self._items.clear()
        if self._reader is not None and not self._reader.done():
            self._reader.set_result(None)
        while self._senders:
            turn = self._senders.popleft()
            if isinstance(turn, asyncio.Future) and not turn.done():
                turn.set_result(False)

    def _append(self, item: Any) -> None:
        self._items.append(item)
        if self._reader is not None and not self._reader.done():
            self._reader.set_result(None)

    def _wake_sender(self) -> None:
        """Gives the slots free to the first waiting: a posted message goes in, a waiting put is
        woken with a slot reserved for it."""
        while self._senders and len(self._items) + self._reserved < self.size:
            turn = self._senders.popleft()
            if isinstance(turn, _Posted):
                self._append(turn.item)
            elif not turn.done():  # a cancelled sender's turn is skipped
                self._reserved += 1
                turn.set_result(True)


class _Posted:
    """A message `post` queued past the bound."""

    __slots__ = ("item",)

    def __init__(self, item: Any):
        self.item = item
