"""A streamed chat completion's chunks read as the Responses API's event sequence:
`response.created`, `response.in_progress`; per output item `response.output_item.added`, its
deltas (`response.output_text.delta` within a content part, or
`response.function_call_arguments.delta`) and their `...done` events, `response.output_item.done`;
then `response.completed` (or `response.incomplete`, or `error` and `response.failed`) with the
whole response, whose output is what the deltas added up to."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from pyserve.server.responses_items import call_item, item_status, message_item, new_id, response_status, usage


def event_bytes(event: dict[str, Any]) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


def _copy(obj: dict[str, Any]) -> dict[str, Any]:
    """An event's own copy of an item or part that later deltas change."""
    return orjson.loads(orjson.dumps(obj))


class ResponseEvents:
    """Events of one streamed response; `shell(status, output, usage, error)` builds its object."""

    def __init__(self, shell: Callable[..., dict[str, Any]]):
        self.shell = shell
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item receiving deltas
        self.calls: dict[int, dict[str, Any]] = {}  # a chat tool call's index -> its item
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        response = self.shell("in_progress")
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]

    def chunk(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if chunk.get("usage"):
            self.usage = usage(chunk["usage"])
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                events += self._text(delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self._call(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return events

    def _text(self, text: str) -> list[dict[str, Any]]:
        events = []
        if self.open is None or self.open["type"] != "message":
            events += self._close() + self._open_message()
        part = self.open["content"][0]
        part["text"] += text
        events.append(self._event("response.output_text.delta", item_id=self.open["id"], output_index=self._index(),
                                  content_index=0, delta=text, logprobs=[]))
        return events

    def _open_message(self) -> list[dict[str, Any]]:
        item = message_item("", "in_progress")
        part = item["content"].pop()
        events = self._add(item)
        item["content"].append(part)
        events.append(self._event("response.content_part.added", item_id=item["id"], output_index=self._index(),
                                  content_index=0, part=_copy(part)))
        return events

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        events = []
        item = self.calls.get(call["index"])
        fn = call.get("function") or {}
        if item is None:
            events += self._close()
            item = call_item(call.get("id") or new_id("call"), fn.get("name", ""), "", "in_progress")
            self.calls[call["index"]] = item
            events += self._add(item)
        if fn.get("arguments"):
            item["arguments"] += fn["arguments"]
            events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=self._index(), delta=fn["arguments"]))
        return events

    def _index(self) -> int:
        return len(self.output) - 1

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.output.append(item)
        self.open = item
        return [self._event("response.output_item.added", output_index=self._index(), item=_copy(item))]

    def _close(self) -> list[dict[str, Any]]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = self.output.index(item)
        item["status"] = item_status(self.finish_reason)
        events = []
        if item["type"] == "message":
            part = item["content"][0]
            events.append(self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                      content_index=0, text=part["text"], logprobs=[]))
            events.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                      content_index=0, part=_copy(part)))
        else:
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=index, name=item["name"], arguments=item["arguments"]))
        events.append(self._event("response.output_item.done", output_index=index, item=_copy(item)))
        return events

    def end(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The closing events, and the finished response (as the last of them carries it)."""
        events = [] if self.output else self._open_message()  # an empty answer is still a message
        events += self._close()
        status = response_status(self.output)
        response = self.shell(status, self.output, self.usage)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        events.append(self._event(kind, response=response))
        return events, response

    def failed(self, error: dict[str, Any]) -> list[dict[str, Any]]:
        """An error the chat stream ended with: an `error` event, then `response.failed`."""
        err = error.get("error", error)
        body = {"code": err.get("code") or err.get("type") or "server_error", "message": err.get("message", "")}
        return [self._event("error", code=body["code"], message=body["message"], param=err.get("param")),
                self._event("response.failed", response=self.shell("failed", self.output, self.usage, body))]
