"""A finished chat or text completion body sent as the SSE stream its request asked for (a
semantic-cache hit, a kept cascade answer)."""

from __future__ import annotations

from pyserve.http import sse


def finished_sse(body: dict, include_usage: bool) -> bytes:
    """The events a streamed request gets for a finished body: per choice, for chat the role,
    the content (with its logprobs), each tool call (indexed) and the finish reason, for text
    one chunk; then the usage when asked; then [DONE]."""
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
    return b"".join(map(sse.event, frames)) + sse.DONE


def replayed(body: dict, include_usage: bool, send_timeout: float,
             headers: dict[str, str]) -> sse.TimedStreamingResponse:
    payload = finished_sse(body, include_usage)

    async def once():
        yield payload

    return sse.TimedStreamingResponse(once(), send_timeout, lambda: None, headers)
