"""SSE responses with a deadline per chunk, so a client that stopped reading cannot hold a
request (and its KV blocks) forever; and a finished body replayed as SSE (a cache hit, a kept
cascade answer)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable

import orjson
import structlog
from starlette.responses import StreamingResponse
from starlette.types import Message, Send

log = structlog.get_logger("pyserve.server")


WATCH_PERIOD = 0.25  # of send_timeout: how often a response's pending send is looked at


class TimedStreamingResponse(StreamingResponse):
    """A StreamingResponse whose every send must complete within `send_timeout` seconds. When
    one does not (the client's socket buffers are full: it stopped reading), `on_timeout` runs,
    the body generator is closed (its cleanup aborts the engine requests) and the response ends
    unfinished, which makes the server drop the connection.

    A single timer per response looks at the send in progress every WATCH_PERIOD x
    send_timeout, so a stuck send is cut between 1 and 1 + WATCH_PERIOD times send_timeout after
    it began; a timeout around every send (a timer armed and cancelled per chunk) cost a stream
    at batch 1 a few percent of its tokens per second here (measured when this went in; see git log).
    """

    def __init__(self, content: AsyncGenerator[bytes, None], send_timeout: float, on_timeout: Callable[[], None],
                 **kwargs):
        super().__init__(content, **kwargs)
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


def finished_sse(body: dict, include_usage: bool) -> bytes:
    """The SSE stream a streamed request gets for a finished chat or text completion body: per
    choice, for chat the role, the content (with its logprobs), each tool call (indexed) and the
    finish reason, for text one chunk; then the usage when asked; then [DONE]."""
    chat = body["object"] == "chat.completion"
    head = {"id": body["id"], "object": "chat.completion.chunk" if chat else "text_completion",
            "created": body["created"], "model": body["model"], "system_fingerprint": body["system_fingerprint"]}
    chunks = []
    for c in body["choices"]:
        if not chat:
            chunks.append([{"index": c["index"], "text": c["text"], "logprobs": c.get("logprobs"),
                            "finish_reason": c["finish_reason"]}])
            continue
        message, i = c["message"], c["index"]
        deltas = [({"role": "assistant", "content": "", "refusal": None}, None, None)]
        if message.get("content"):
            deltas.append(({"content": message["content"]}, c.get("logprobs"), None))
        deltas += [({"tool_calls": [{"index": k, **call}]}, None, None)
                   for k, call in enumerate(message.get("tool_calls") or [])]
        deltas.append(({}, None, c["finish_reason"]))
        chunks += [[{"index": i, "delta": d, "logprobs": lp, "finish_reason": f}] for d, lp, f in deltas]
    frames = [head | {"choices": choices} for choices in chunks]
    if include_usage:
        frames.append(head | {"choices": [], "usage": body["usage"]})
    return b"".join(b"data: " + orjson.dumps(f) + b"\n\n" for f in frames) + b"data: [DONE]\n\n"


def replayed(body: dict, include_usage: bool, send_timeout: float,
             headers: dict[str, str]) -> TimedStreamingResponse:
    """A finished body sent as the SSE stream its request asked for."""
    payload = finished_sse(body, include_usage)

    async def once():
        yield payload

    return TimedStreamingResponse(once(), send_timeout, lambda: None, media_type="text/event-stream",
                                  headers={"Cache-Control": "no-cache", **headers})
