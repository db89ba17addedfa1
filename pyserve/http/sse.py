"""Server-sent events as the OpenAI streaming APIs frame them: one `data: <json>` event per
chunk, an error as an event of its own, `[DONE]` last; a streaming response with a deadline per
send; and where an event ends in a byte stream (for a proxy that must not cut one)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable

import orjson
import structlog
from starlette.responses import StreamingResponse
from starlette.types import Message, Send

log = structlog.get_logger("pyserve.http")

DONE = b"data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
WATCH_PERIOD = 0.25  # of send_timeout: how often a response's pending send is looked at


def event(obj: dict) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def raw_event(payload: bytes) -> bytes:
    """An event of JSON already serialized (an error body)."""
    return b"data: " + payload + b"\n\n"


def whole_events(data: bytes) -> tuple[bytes, bytes]:
    """`data` split after its last complete event (a blank line ends one): (events, the rest)."""
    lf, crlf = data.rfind(b"\n\n"), data.rfind(b"\r\n\r\n")
    end = max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)
    return data[:end], data[end:]


class TimedStreamingResponse(StreamingResponse):
    """An event stream whose every send must complete within `send_timeout` seconds. When one
    does not (the client's socket buffers are full: it stopped reading), `on_timeout` runs, the
    body generator is closed (its cleanup aborts the engine requests) and the response ends
    unfinished, which makes the server drop the connection.

    A single timer per response looks at the send in progress every WATCH_PERIOD x
    send_timeout, so a stuck send is cut between 1 and 1 + WATCH_PERIOD times send_timeout after
    it began; a timeout around every send (a timer armed and cancelled per chunk) cost a stream
    at batch 1 a few percent of its tokens per second here (measured when this went in; see git log).
    """

    def __init__(self, content: AsyncGenerator[bytes, None], send_timeout: float, on_timeout: Callable[[], None],
                 headers: dict[str, str] | None = None):
        super().__init__(content, media_type="text/event-stream", headers={**HEADERS, **(headers or {})})
        self.send_timeout = send_timeout
        self.on_timeout = on_timeout

    async def stream_response(self, send: Send) -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        sending_since: float | None = None  # when the send in progress began
        timed_out = False

        async def watched_send(message: Message) -> None:
            nonlocal sending_since
            sending_since = loop.time()
            await send(message)
            sending_since = None

        def watch() -> None:
            nonlocal timed_out, timer
            if sending_since is not None and loop.time() - sending_since >= self.send_timeout:
                timed_out = True
                task.cancel()
            else:
                timer = loop.call_later(self.send_timeout * WATCH_PERIOD, watch)

        timer = loop.call_later(self.send_timeout * WATCH_PERIOD, watch)
        try:
            await super().stream_response(watched_send)
        except asyncio.CancelledError:
            if not timed_out:  # the server's or the task group's own cancellation
                raise
            task.uncancel()
            log.warning("slow_client_dropped", send_timeout_s=self.send_timeout)
            self.on_timeout()
            await self.body_iterator.aclose()
        finally:
            timer.cancel()
