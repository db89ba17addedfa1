"""The Responses API over HTTP with the embedded model, through the official client: a response
is the chat completion it amounts to (same tokens, same usage), streamed events add up byte for
byte to the non-streamed output, tools and text formats, stored responses continued with
previous_response_id (their prefix cached), retrieved, listed, deleted, kept across a restart and
scoped to their tenant, and the refusals."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pydantic
import pytest

from pyserve.testing import start_server, stop_server
from pyserve.testing.metrics import parse_metrics

ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "add", "description": "Adds two numbers", "parameters": ADD}]
QUESTION = "def fib(n):"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("responses-data")


@pytest.fixture(scope="module")
def server(tmp_path_factory, data_dir):
    proc, base = start_server(None, "--served-model-name", "tiny", "--data-dir", str(data_dir),
                              "--responses-max-stored", "6", "--lora-modules", "docstrings", "--max-lora-rank", "8",
                              workdir=tmp_path_factory.mktemp("responses"))
    yield base
    stop_server(proc)


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0)


def _chat(client, messages, **kw):
    return client.chat.completions.create(model="tiny", messages=messages, temperature=0, **kw)


def test_a_response_is_the_chat_completion_it_amounts_to(client):
    r = client.responses.create(model="tiny", input=QUESTION, instructions="You write Python.", temperature=0,
                                max_output_tokens=24, store=False)
    chat = _chat(client, [{"role": "system", "content": "You write Python."}, {"role": "user", "content": QUESTION}],
                 max_tokens=24)
    assert r.output_text == chat.choices[0].message.content and r.output_text
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert r.id.startswith("resp_") and r.object == "response" and r.store is False
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    if chat.choices[0].finish_reason == "length":
        assert (r.status, r.incomplete_details.reason, item.status) == ("incomplete", "max_output_tokens", "incomplete")
    else:
        assert (r.status, r.incomplete_details, item.status) == ("completed", None, "completed")
    short = client.responses.create(model="tiny", input=QUESTION, temperature=0, max_output_tokens=2, store=False)
    assert (short.status, short.incomplete_details.reason, short.usage.output_tokens) == (
        "incomplete", "max_output_tokens", 2)


def test_an_adapter_answers_as_it_does_over_chat(client):
    r = client.responses.create(model="docstrings", input=QUESTION, temperature=0, max_output_tokens=16, store=False)
    chat = client.chat.completions.create(model="docstrings", messages=[{"role": "user", "content": QUESTION}],
                                          temperature=0, max_tokens=16)
    base = _chat(client, [{"role": "user", "content": QUESTION}], max_tokens=16)
    assert r.model == "docstrings" and r.output_text == chat.choices[0].message.content
    assert chat.choices[0].message.content != base.choices[0].message.content  # the adapter changes the answer


def test_streamed_events_add_up_to_the_non_streamed_output(client):
    kw = {"model": "tiny", "input": QUESTION, "temperature": 0, "max_output_tokens": 40, "store": False}
    whole = client.responses.create(**kw)
    types, text = [], ""
    with client.responses.stream(**kw) as stream:
        for event in stream:
            types.append(event.type)
            if event.type == "response.output_text.delta":
                text += event.delta
        final = event.response  # the last event's (get_final_response wants response.completed)
    assert text == whole.output_text == final.output[0].content[0].text and text
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete" if whole.status == "incomplete" else "response.completed"]
    assert final.usage.output_tokens == whole.usage.output_tokens
    # sequence numbers count up from 0, one per event
    raw = httpx.post(f"{client.base_url}responses", json={**kw, "stream": True}, timeout=60).text
    numbers = [json.loads(line[6:])["sequence_number"] for line in raw.splitlines() if line.startswith("data: ")]
    assert numbers == list(range(len(numbers))) and len(numbers) == len(types)


def test_a_stream_read_to_its_end_counts_as_served_and_names_its_log_id(server):
    def outcomes():
        metrics = parse_metrics(httpx.get(server + "/metrics").text)
        return {k: v for k, v in metrics.items() if k.startswith("pyserve:request_outcomes_total")}

    before = outcomes()
    body = {"model": "tiny", "input": QUESTION, "max_output_tokens": 8, "store": False, "stream": True}
    r = httpx.post(server + "/v1/responses", json=body, timeout=60)
    assert "response.completed" in r.text or "response.incomplete" in r.text
    assert r.headers["x-pyserve-request-id"].startswith("chatcmpl-")  # the id its log lines carry
    after = outcomes()
    grown = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    assert len(grown) == 1 and next(iter(grown)).endswith('outcome="ok"}') and list(grown.values()) == [1]
    chat = httpx.post(server + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 4})
    assert chat.headers["x-pyserve-request-id"] == chat.json()["id"]


def test_a_forced_function_call_and_its_streamed_arguments(client):
    kw = {"model": "tiny", "input": "What is 2 + 3?", "tools": TOOLS, "tool_choice": "required", "temperature": 0,
          "store": False}
    r = client.responses.create(**kw)
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls and all(c.name == "add" and c.call_id.startswith("call_") for c in calls)
    for c in calls:
        jsonschema.validate(json.loads(c.arguments), ADD)
    args = {}
    with client.responses.stream(**kw) as stream:
        for event in stream:
            if event.type == "response.function_call_arguments.delta":
                args[event.output_index] = args.get(event.output_index, "") + event.delta
    streamed = [a for _, a in sorted(args.items())]
    assert streamed == [c.arguments for c in calls]
    # the call's output sent back: the next turn answers in text
    follow = [*({"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments}
                for c in calls),
              *({"type": "function_call_output", "call_id": c.call_id, "output": "5"} for c in calls)]
    r2 = client.responses.create(model="tiny", input=[{"role": "user", "content": "What is 2 + 3?"}, *follow],
                                 tools=TOOLS, tool_choice="none", temperature=0, max_output_tokens=8, store=False)
    assert r2.output[0].type == "message"


class Pair(pydantic.BaseModel):
    a: int
    b: int


def test_text_format_json_schema_and_parse(client):
    r = client.responses.parse(model="tiny", input="Two numbers as JSON:", text_format=Pair, temperature=0,
                               max_output_tokens=60, store=False)
    assert isinstance(r.output_parsed, Pair)
    assert json.loads(r.output_text) == r.output_parsed.model_dump()


def test_previous_response_id_continues_a_stored_conversation_from_the_prefix_cache(client, server):
    first = client.responses.create(model="tiny", input=QUESTION, temperature=0, max_output_tokens=12,
                                    metadata={"run": "1"})
    assert first.store is True and first.metadata == {"run": "1"}
    second = client.responses.create(model="tiny", input="Now in one line.", previous_response_id=first.id,
                                     temperature=0, max_output_tokens=12)
    chat = _chat(client, [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": first.output_text},
                          {"role": "user", "content": "Now in one line."}], max_tokens=12)
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    # the earlier turn's prompt and answer are cached (whole blocks of them)
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens + first.usage.output_tokens - 16
    got = client.responses.retrieve(second.id)
    assert got.output_text == second.output_text and got.previous_response_id == first.id
    items = client.responses.input_items.list(second.id, order="asc")
    texts = [(i.type, i.role, i.content[0].text) for i in items.data if i.type == "message"]
    assert texts == [("message", "user", QUESTION), ("message", "assistant", first.output_text),
                     ("message", "user", "Now in one line.")]
    newest = client.responses.input_items.list(second.id, limit=1)
    assert newest.data[0].content[0].text == "Now in one line." and newest.has_more
    # another tenant sees none of it
    r = httpx.get(f"{server}/v1/responses/{second.id}", headers={"X-Tenant": "other"}, timeout=30)
    assert r.status_code == 404
    r = httpx.post(f"{server}/v1/responses", headers={"X-Tenant": "other"}, timeout=30,
                   json={"model": "tiny", "input": "x", "previous_response_id": second.id})
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)


def test_stored_responses_are_bounded_in_count(client):
    ids = [client.responses.create(model="tiny", input=f"n{i}", max_output_tokens=1).id for i in range(7)]
    with pytest.raises(openai.NotFoundError):  # --responses-max-stored 6: the oldest went
        client.responses.retrieve(ids[0])
    assert client.responses.retrieve(ids[-1]).id == ids[-1]


def test_a_stored_response_survives_a_restart(tmp_path):
    data = tmp_path / "data"
    proc, base = start_server(None, "--served-model-name", "tiny", "--data-dir", str(data), workdir=tmp_path)
    try:
        made = httpx.post(base + "/v1/responses", json={"model": "tiny", "input": QUESTION, "max_output_tokens": 4,
                                                        "temperature": 0}, timeout=60).json()
    finally:
        stop_server(proc)
    proc, base = start_server(None, "--served-model-name", "tiny", "--data-dir", str(data), workdir=tmp_path)
    try:
        assert httpx.get(f"{base}/v1/responses/{made['id']}", timeout=30).json() == made
        r = httpx.post(base + "/v1/responses", json={"model": "tiny", "input": "More.", "max_output_tokens": 2,
                                                     "previous_response_id": made["id"]}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["input_tokens"] > made["usage"]["input_tokens"]
    finally:
        stop_server(proc)


@pytest.mark.parametrize("body, param, words", [
    ({"reasoning": {"effort": "high"}}, "reasoning", "not supported"),
    ({"include": ["file_search_call.results"]}, "include", "not supported"),
    ({"background": True}, "background", "not supported"),
    ({"truncation": "middle"}, "truncation", None),
    ({"frequency_penalty": 1}, "frequency_penalty", "unknown field"),
    ({"tools": [{"type": "web_search"}]}, "tools", "function tools only"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input", "'reasoning'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input", None),
    ({"input": [{"type": "function_call_output", "call_id": "c9", "output": "1"}]}, "input", "c9"),
    ({"input": [{"type": "function_call", "call_id": "c7", "name": "add", "arguments": "{}"},
                {"role": "user", "content": "and?"}]}, "input", "'c7'"),  # a call without its output
    ({"max_output_tokens": 0}, "max_output_tokens", None),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, "text.format", None),
])
def test_what_is_not_served_is_refused_naming_the_field(server, body, param, words):
    r = httpx.post(server + "/v1/responses", json={"model": "tiny", "input": "hi", **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"].startswith(param), err
    if words is not None:
        assert words in err["message"], err


def test_without_a_data_dir_nothing_is_stored_and_continuing_says_how(tmp_path):
    proc, base = start_server(None, "--served-model-name", "tiny", workdir=tmp_path)
    try:
        r = httpx.post(base + "/v1/responses", json={"model": "tiny", "input": "hi", "max_output_tokens": 1},
                       timeout=30).json()
        assert r["store"] is False
        r = httpx.post(base + "/v1/responses", json={"model": "tiny", "input": "hi", "previous_response_id": r["id"]},
                       timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
        assert "--data-dir" in r.json()["error"]["message"]
        assert httpx.get(f"{base}/v1/responses/resp_x", timeout=30).status_code == 404
    finally:
        stop_server(proc)


@pytest.mark.asyncio
async def test_truncation_auto_drops_the_oldest_turns_to_fit_the_models_length():
    from pyserve.default_model import TARGET_DIR
    from pyserve.testing.in_process import serving_models

    turns = [{"role": r, "content": f"{r} message {i}: " + "word " * 12} for i in range(8) for r in ("user", "assistant")]
    body = {"model": "tiny", "instructions": "You write Python.", "input": turns[:-1], "max_output_tokens": 8,
            "temperature": 0, "store": False}
    async with serving_models({"tiny": {"model": str(TARGET_DIR), "max_model_len": 160, "block_size": 4,
                                        "num_kv_blocks": 256}}) as (_, client):
        r = await client.post("/v1/responses", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text  # too long as it is
        r = await client.post("/v1/responses", json={**body, "truncation": "auto"})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["truncation"] == "auto" and out["usage"]["input_tokens"] <= 160 - 8
        assert out["usage"]["input_tokens_details"]["removed_tokens"] > 0
        assert r.headers["x-pyserve-prompt-policy"] == "turns"
        r = await client.post("/v1/responses", json={**body, "truncation": "auto", "max_output_tokens": 160})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_output_tokens", r.text
