"""A Responses request served as a chat completion, and the chat answer read back as a response:
items to chat messages, the request's fields to the chat body's, the chat body to output items,
usage and the response object.

A conversation is a list of items (as /v1/responses/{id}/input_items lists them): messages,
function calls and their outputs. Function calls that follow an assistant message (or each
other) are one assistant turn of the chat; an output is a tool message answering its call.
"""

from __future__ import annotations

import uuid
from typing import Any

from pyserve.server.responses_schemas import (FunctionCallItem, FunctionCallOutputItem, MessageItem,
                                              ResponsesRequest)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def item_dicts(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input items as a stored conversation holds them: each with an id, a message's
    content as parts."""
    out = []
    for item in req.items():
        if isinstance(item, MessageItem):
            part = "output_text" if item.role == "assistant" else "input_text"
            content = [{"type": part, "text": item.content}] if isinstance(item.content, str) else \
                [p.model_dump(exclude_none=True) for p in item.content]
            out.append({"type": "message", "id": item.id or new_id("msg"), "role": item.role, "content": content,
                        "status": item.status or "completed"})
        elif isinstance(item, FunctionCallItem):
            out.append({"type": "function_call", "id": item.id or new_id("fc"), "call_id": item.call_id,
                        "name": item.name, "arguments": item.arguments, "status": item.status or "completed"})
        else:
            assert isinstance(item, FunctionCallOutputItem)
            out.append({"type": "function_call_output", "id": item.id or new_id("fco"), "call_id": item.call_id,
                        "output": item.text(), "status": item.status or "completed"})
    return out


def chat_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages of a conversation's items (item_dicts' shape, or output items)."""
    messages: list[dict[str, Any]] = []
    joinable = False  # the last message is an assistant's that a following call belongs to
    for item in items:
        kind = item["type"]
        if kind == "message":
            text = "".join(p["text"] for p in item["content"])
            messages.append({"role": item["role"], "content": text})
            joinable = item["role"] == "assistant"
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if joinable:
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                joinable = True
        else:
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
            joinable = False
    return messages


def chat_body(req: ResponsesRequest, conversation: list[dict[str, Any]],
              prompt_budget: int | None = None) -> dict[str, Any]:
    """The /v1/chat/completions body that answers `req` over `conversation` (earlier items, then
    the request's own); `instructions` come first as a system message; `prompt_budget`: the
    chat's max_prompt_tokens (truncation auto)."""
    messages = chat_messages(conversation)
    if req.instructions:
        messages.insert(0, {"role": "system", "content": req.instructions})
    body: dict[str, Any] = {"model": req.model, "messages": messages, "stream": req.stream}
    if prompt_budget is not None:
        body["max_prompt_tokens"] = prompt_budget
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                         for t in req.tools]
        body["parallel_tool_calls"] = req.parallel_tool_calls
    if req.tool_choice is not None:
        choice = req.tool_choice
        body["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                      "function": {"name": choice.name}}
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        schema = {"name": fmt.name or "response", "schema": fmt.json_schema or {}}
        if fmt.strict is not None:
            schema["strict"] = fmt.strict
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    for ours, theirs in (("max_output_tokens", "max_completion_tokens"), ("temperature", "temperature"),
                         ("top_p", "top_p")):
        value = getattr(req, ours)
        if value is not None:
            body[theirs] = value
    return body


def message_item(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    return {"type": "message", "id": item_id or new_id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(call_id: str, name: str, arguments: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id or new_id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def output_items(chat: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat body's answer as output items: its text (when it has some, or no calls), then its
    calls; an answer cut at max_tokens leaves its last item incomplete (as a stream closes the
    others when the next one starts)."""
    choice = chat["choices"][0]
    message = choice["message"]
    calls = message.get("tool_calls") or []
    items = [message_item(message["content"], "completed")] if message.get("content") or not calls else []
    items += [call_item(c["id"], c["function"]["name"], c["function"]["arguments"], "completed") for c in calls]
    items[-1]["status"] = item_status(choice["finish_reason"])
    return items


def item_status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    """A chat usage as the Responses API words it (the prompt budget's removed_tokens kept)."""
    return {"input_tokens": chat_usage["prompt_tokens"], "input_tokens_details": chat_usage["prompt_tokens_details"],
            "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}


def response_object(response_id: str, created_at: int, req: ResponsesRequest, model: str, stored: bool,
                    status: str = "in_progress", output: list[dict[str, Any]] | None = None,
                    usage_: dict[str, Any] | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
    """The response object; `status` completed, incomplete (its output cut at max_output_tokens),
    failed (with `error`) or in_progress (streaming)."""
    fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else \
        {"type": "text"}
    choice = req.tool_choice
    return {
        "id": response_id, "object": "response", "created_at": created_at, "status": status, "background": False,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": model,
        "output": output or [], "parallel_tool_calls": req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {"format": fmt}, "tool_choice": "auto" if choice is None else
        (choice if isinstance(choice, str) else choice.model_dump()),
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
        "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": req.truncation, "usage": usage_,
        "user": req.user, "metadata": req.metadata or {}, "store": stored,
    }


def response_status(output: list[dict[str, Any]]) -> str:
    return "incomplete" if any(item["status"] == "incomplete" for item in output) else "completed"
