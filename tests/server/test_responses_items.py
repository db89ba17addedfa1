"""The Responses API's translation, without a server: a conversation's items as chat messages,
and a chat stream's chunks read as Responses events whose output is the one the same answer,
not streamed, gives."""

from __future__ import annotations

from pyserve.server.responses_items import chat_messages, output_items
from pyserve.server.responses_stream import ResponseEvents


def test_calls_join_the_assistant_turn_before_them_and_outputs_answer_them():
    items = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "2+3 and 4+5?"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Adding."}]},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 2, "b": 3}'},
        {"type": "function_call", "call_id": "c2", "name": "add", "arguments": '{"a": 4, "b": 5}'},
        {"type": "function_call_output", "call_id": "c1", "output": "5"},
        {"type": "function_call_output", "call_id": "c2", "output": "9"},
        {"type": "function_call", "call_id": "c3", "name": "add", "arguments": '{"a": 5, "b": 9}'},
    ]
    call = lambda i, a: {"id": i, "type": "function", "function": {"name": "add", "arguments": a}}  # noqa: E731
    assert chat_messages(items) == [
        {"role": "user", "content": "2+3 and 4+5?"},
        {"role": "assistant", "content": "Adding.",
         "tool_calls": [call("c1", '{"a": 2, "b": 3}'), call("c2", '{"a": 4, "b": 5}')]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
        {"role": "tool", "tool_call_id": "c2", "content": "9"},
        {"role": "assistant", "content": None, "tool_calls": [call("c3", '{"a": 5, "b": 9}')]},
    ]


def _shell(status, output=None, usage_=None, error=None):
    return {"status": status, "output": output or [], "usage": usage_, "error": error}


def test_streamed_events_add_up_to_the_output_of_the_same_answer_not_streamed():
    chunks = [
        {"model": "m", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"index": 0, "delta": {"content": "Let me "}}]},
        {"choices": [{"index": 0, "delta": {"content": "add."}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": '}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "2}"}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 1, "id": "c2", "type": "function", "function": {"name": "add", "arguments": '{"a"'}}]}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
        {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 9, "total_tokens": 16,
                                  "prompt_tokens_details": {"cached_tokens": 4}}},
    ]
    body = {"choices": [{"finish_reason": "length", "message": {"content": "Let me add.", "tool_calls": [
        {"id": "c1", "function": {"name": "add", "arguments": '{"a": 2}'}},
        {"id": "c2", "function": {"name": "add", "arguments": '{"a"'}}]}}]}
    events = ResponseEvents(_shell)
    seen = events.start()
    for chunk in chunks:
        seen += events.chunk(chunk)
    closing, response = events.end()
    seen += closing
    assert [e["sequence_number"] for e in seen] == list(range(len(seen)))
    assert [e["type"] for e in seen] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.incomplete"]
    added = [e["item"] for e in seen if e["type"] == "response.output_item.added"]
    assert added[0]["content"] == [] and added[1]["arguments"] == ""  # as they were when added
    strip = [{k: v for k, v in item.items() if k != "id"} for item in response["output"]]
    want = [{k: v for k, v in item.items() if k != "id"} for item in output_items(body)]
    assert strip == want
    assert [i["status"] for i in response["output"]] == ["completed", "completed", "incomplete"]
    assert response["usage"]["input_tokens_details"] == {"cached_tokens": 4}
