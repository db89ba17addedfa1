"""SSE responses with a deadline per chunk, so a client that stopped reading cannot hold a
request (and its KV blocks) forever."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable

import anyio
import structlog
from starlette.responses import StreamingResponse
from starlette.types import Message, Send

log = structlog.get_logger("pyserve.server")


class _SendTimeout(Exception):
    pass


class TimedStreamingResponse(StreamingResponse):
    """A StreamingResponse whose every send must complete within `send_timeout` seconds. When
    one does not (the client's socket buffers are full: it stopped reading), `on_timeout` runs,
    the body generator is closed (its cleanup aborts the engine requests) and the response ends
    unfinished, which makes the server drop the connection."""

    def __init__(self, content: AsyncGenerator[bytes, None], send_timeout: float, on_timeout: Callable[[], None],
                 **kwargs):
        super().__init__(content, **kwargs)
        self.send_timeout = send_timeout
        self.on_timeout = on_timeout

    async def stream_response(self, send: Send) -> None:
        async def timed_send(message: Message) -> None:
            try:
                with anyio.fail_after(self.send_timeout):
                    await send(message)
            except TimeoutError:
                raise _SendTimeout from None

        try:
            await super().stream_response(timed_send)
        except _SendTimeout:
            log.warning("slow_client_dropped", send_timeout_s=self.send_timeout)
            self.on_timeout()
            await self.body_iterator.aclose()
