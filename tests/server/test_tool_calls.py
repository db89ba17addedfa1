"""Tool calling over HTTP with the embedded model, through the official client: forced calls
(required, named, parallel) validate against their schemas, streamed arguments add up to the
non-streamed ones byte for byte, auto and none, multi-turn with tool results, the legacy
functions, and the bad-input cases."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from pyserve import LLM, SamplingParams
from pyserve.testing import start_server, stop_server

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Adds two numbers", "parameters": ADD}}]
SCHEMA = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]


@pytest.fixture(scope="module", params=["plain", "draft"])
def server(request, tmp_path_factory):
    flags = ["--served-model-name", "tiny"]
    if request.param == "draft":
        flags += ["--speculative-config", '{"method": "draft_model", "num_speculative_tokens": 3}']
    proc, base = start_server(None, *flags, workdir=tmp_path_factory.mktemp("tools"))
    yield base
    stop_server(proc)


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0)


def _valid(call) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA[call.function.name])


def _streamed(client, **kw) -> tuple[str | None, list[tuple[str, str, str]], str]:
    """(content, [(id, name, arguments)], finish_reason) of a streamed chat."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(**kw, stream=True):
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        content += ch.delta.content or ""
        for tc in ch.delta.tool_calls or []:
            entry = calls.setdefault(tc.index, ["", "", ""])
            entry[0] = tc.id or entry[0]
            entry[1] = (tc.function.name or "") if tc.function.name else entry[1]
            entry[2] += tc.function.arguments or ""
        finish = ch.finish_reason or finish
    return content or None, [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_validate_and_stream_the_same_bytes(client, parallel):
    for seed in range(4):
        kw = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel,
                  max_tokens=600, temperature=1.0, seed=seed)
        r = client.chat.completions.create(**kw)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        assert parallel or len(choice.message.tool_calls) == 1
        for call in choice.message.tool_calls:
            _valid(call)
        _, streamed, finish = _streamed(client, **kw)
        assert finish == "tool_calls"
        assert [(n, a) for _, n, a in streamed] == [(c.function.name, c.function.arguments)
                                                    for c in choice.message.tool_calls]
        assert all(i.startswith("call_") for i, _, _ in streamed)


def test_a_named_function_is_the_one_called(client):
    for seed in range(3):
        r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=120, seed=seed,
                                           tool_choice={"type": "function", "function": {"name": "add"}})
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "add"
        assert r.choices[0].finish_reason == "stop"  # OpenAI's for a function forced by name ("tool_calls" otherwise)
        _valid(call)


def test_a_call_cut_off_by_max_tokens_gives_the_arguments_written_so_far(client):
    """The whole call first, then the same request cut at every length from the end of the
    arguments to the closing marker: the arguments end where the model's JSON ended (never with
    the wrapper's brace or marker), or are its prefix where the cut fell inside them."""
    kw = dict(model="tiny", messages=ASK, tools=TOOLS, seed=0, temperature=0,
              tool_choice={"type": "function", "function": {"name": "add"}})
    whole = client.chat.completions.create(**kw, max_tokens=120)
    (call,) = whole.choices[0].message.tool_calls
    full_args, used = call.function.arguments, whole.usage.completion_tokens
    for max_tokens in range(used - 8, used):
        r = client.chat.completions.create(**kw, max_tokens=max_tokens)
        assert r.choices[0].finish_reason == "length"
        (cut,) = r.choices[0].message.tool_calls
        assert full_args.startswith(cut.function.arguments)
        if cut.function.arguments.endswith("}"):
            assert cut.function.arguments == full_args
        assert _streamed(client, **kw, max_tokens=max_tokens)[1][0][2] == cut.function.arguments


def test_a_strict_tool_without_arguments_is_called_with_none(client):
    ping = {"type": "function", "function": {"name": "ping", "strict": True,
                                             "parameters": {"type": "object", "properties": {}}}}
    for seed in range(4):
        r = client.chat.completions.create(model="tiny", messages=ASK, tools=[ping], max_tokens=60, seed=seed,
                                           temperature=1.0, tool_choice={"type": "function", "function": {"name": "ping"}})
        (call,) = r.choices[0].message.tool_calls
        assert json.loads(call.function.arguments) == {} and r.choices[0].finish_reason == "stop"


def test_auto_and_none(client):
    for seed in range(4):
        r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=80, seed=seed,
                                           temperature=1.0)
        choice = r.choices[0]
        if choice.message.tool_calls:  # the model chose to call (in its own words: not forced)
            assert choice.finish_reason == "tool_calls"
        else:
            assert choice.finish_reason in ("stop", "length") and choice.message.content is not None
        none = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="none",
                                              max_tokens=40, seed=seed)
        assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason in ("stop", "length")


def test_auto_with_a_strict_function_is_held_by_a_grammar_that_leaves_text_alone(client, server):
    """A strict function under "auto": calls are held to their schemas (the grammar's own tests,
    tests/tools, show which outputs it takes), while a text answer, the one this model gives, is
    what the same prompt gives without a grammar, token for token."""
    strict = [{"type": "function", "function": {**t["function"], "strict": True}} for t in TOOLS]
    prompt = httpx.post(server + "/tokenize", json={"model": "tiny", "messages": ASK, "tools": strict}).json()["tokens"]
    for seed in range(3):
        kw = dict(model="tiny", max_tokens=40, seed=seed, temperature=1.0)
        held = client.chat.completions.create(messages=ASK, tools=strict, **kw)
        free = client.completions.create(prompt=prompt, **kw)
        assert held.choices[0].message.content == free.choices[0].text and held.choices[0].message.tool_calls is None
        assert held.usage.prompt_tokens == len(prompt) and held.usage.completion_tokens == free.usage.completion_tokens
    r = httpx.post(server + "/v1/chat/completions", timeout=10, json={
        "model": "tiny", "messages": ASK, "tools": strict, "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"


def test_pydantic_tools_with_definitions_are_called_by_their_schema(client):
    """pydantic writes an Enum or a nested model as $defs with $ref pointers; `pydantic_function_tool`
    sends strict: true. The calls validate against the schema as sent."""
    from enum import Enum

    from pydantic import BaseModel

    class Unit(str, Enum):
        celsius = "celsius"
        fahrenheit = "fahrenheit"

    class Place(BaseModel):
        city: str
        country: str

    class GetWeather(BaseModel):
        place: Place
        unit: Unit

    tool = openai.pydantic_function_tool(GetWeather)
    schema = tool["function"]["parameters"]
    assert "$defs" in schema and tool["function"]["strict"] is True
    for choice in ("required", {"type": "function", "function": {"name": "GetWeather"}}):
        r = client.chat.completions.create(model="tiny", messages=ASK, tools=[tool], tool_choice=choice, max_tokens=200,
                                           temperature=0)
        calls = r.choices[0].message.tool_calls
        assert calls and r.choices[0].message.content is None
        for call in calls:
            assert call.function.name == "GetWeather"
            jsonschema.validate(json.loads(call.function.arguments), schema)


def test_a_forced_call_cut_before_its_name_leaves_no_markup_in_the_content(client):
    for max_tokens in (2, 5):
        r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=max_tokens, temperature=0)
        choice = r.choices[0]
        assert choice.finish_reason == "length" and choice.message.content is None
        _, _, finish = _streamed(client, model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                 max_tokens=max_tokens, temperature=0)
        content = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=max_tokens, temperature=0,
            stream=True) if c.choices)
        assert finish == "length" and content == ""


def test_multi_turn_with_tool_results(client):
    first = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=120, seed=1)
    msg = first.choices[0].message
    history = [*ASK, {"role": "assistant", "content": None,
                      "tool_calls": [c.model_dump() for c in msg.tool_calls]},
               {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": '{"temperature": 21}'}]
    second = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=30, seed=1)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens
    forced = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, tool_choice="required",
                                            max_tokens=120, seed=2)
    for call in forced.choices[0].message.tool_calls:
        _valid(call)


def test_legacy_functions(client):
    r = client.chat.completions.create(model="tiny", messages=ASK, functions=[t["function"] for t in TOOLS],
                                       function_call={"name": "get_weather"}, max_tokens=120, seed=3)
    choice = r.choices[0]
    assert choice.finish_reason == "stop"  # a function forced by name
    jsonschema.validate(json.loads(choice.message.function_call.arguments), WEATHER)
    # The call sent back in the legacy shapes renders as the same tool call and tool result.
    call = choice.message.function_call
    legacy = [*ASK, {"role": "assistant", "content": None, "function_call": {"name": call.name,
                                                                          "arguments": call.arguments}},
              {"role": "function", "name": call.name, "content": "18 C"}]
    tools = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": "18 C"}]
    base = str(client.base_url).removesuffix("/v1/")
    rendered = [httpx.post(base + "/tokenize", json={"model": "tiny", "messages": m}).json()["tokens"]
                for m in (legacy, tools)]
    assert rendered[0] == rendered[1] and len(rendered[0]) > 20
    again = client.chat.completions.create(model="tiny", messages=legacy, functions=[t["function"] for t in TOOLS],
                                           max_tokens=8, seed=3)
    assert again.choices[0].finish_reason in ("stop", "length", "function_call")


CALLS = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
    {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]}


@pytest.mark.parametrize("body, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"enum": list(range(1001))}}}]}, "tools"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ({"tools": TOOLS, "functions": [TOOLS[0]["function"]]}, "functions"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": []}, "tools"),
    ({"messages": [*ASK, {"role": "tool", "content": "18 C"}]}, "messages.1"),
    ({"messages": [*ASK, {"role": "tool", "tool_call_id": "call_9", "content": "18 C"}]}, "messages.1.tool_call_id"),
    ({"messages": [*ASK, CALLS, *ASK]}, "messages.1.tool_calls"),  # OpenAI's: every call answered
    ({"messages": [*ASK, CALLS, {"role": "tool", "tool_call_id": "call_0", "content": "18 C"}, *ASK]},
     "messages.1.tool_calls"),
    ({"messages": [*ASK, CALLS, {"role": "tool", "tool_call_id": "call_1", "content": "5"}]}, "messages.1.tool_calls"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"m": {"type": "object", "additionalProperties": True}}}}}]}, "tools"),
    ({"functions": [{"name": "f", "parameters": {"type": "object", "properties": {"x": {"$ref": "#/nowhere"}}}}],
      "function_call": {"name": "f"}}, "functions"),
    ({"tools": TOOLS, "tool_choice": "required", "stop": ["}"]}, "stop"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}}, "stop_token_ids": [5]},
     "stop_token_ids"),
])
def test_bad_tool_requests_are_400s_naming_the_field(server, body, param):
    r = httpx.post(server + "/v1/chat/completions", json={"model": "tiny", "messages": ASK, **body}, timeout=10)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_offline_chat_renders_the_tools():
    with LLM(num_kv_blocks=64) as llm:
        with_tools = llm.chat(ASK, SamplingParams(max_tokens=1), tools=TOOLS, use_tqdm=False)[0]
        without = llm.chat(ASK, SamplingParams(max_tokens=1), use_tqdm=False)[0]
    text = llm.tokenizer.decode(with_tools.prompt_token_ids)
    assert "get_weather" in text and "<tools>" in text
    assert len(with_tools.prompt_token_ids) > len(without.prompt_token_ids)


# A bare call object under "auto" (issue 43), through the server: the tiny random model is held to
# the exact answer by guided_choice, so the text is the one a real model wrote.
QWEN_ANSWER = '```json\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n```'


async def _chat(client, stream: bool, **body) -> tuple[str | None, list[tuple[str, str, str]], str]:
    """(content, [(id, name, arguments)], finish_reason) of one choice, streamed or not."""
    body = {"model": "tiny", "messages": ASK, "max_tokens": 200, "stream": stream, **body}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    if not stream:
        choice = r.json()["choices"][0]
        calls = [(c["id"], c["function"]["name"], c["function"]["arguments"])
                 for c in choice["message"].get("tool_calls") or []]
        return choice["message"]["content"], calls, choice["finish_reason"]
    content, calls, finish = "", {}, None
    for line in r.text.splitlines():
        if not line.startswith("data: {"):
            continue
        for ch in json.loads(line[6:])["choices"]:
            content += ch["delta"].get("content") or ""
            for tc in ch["delta"].get("tool_calls") or []:
                entry = calls.setdefault(tc["index"], ["", "", ""])
                entry[0] = tc.get("id") or entry[0]
                entry[1] = tc["function"].get("name") or entry[1]
                entry[2] += tc["function"]["arguments"]
            finish = ch["finish_reason"] or finish
    return content or None, [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.parametrize("answer, call", [
    (QWEN_ANSWER, ("get_weather", '{"city": "Paris", "unit": "celsius"}')),
    ('{"name": "add", "parameters": {"a": 2, "b": 3}}', ("add", '{"a": 2, "b": 3}')),
    ('{"name": "get_weather", "arguments": {"city": "Paris", "unit": "kelvin"}}', None),  # invalid arguments
    ('{"name": "get_time", "arguments": {"city": "Paris"}}', None),  # undeclared
    ("Sure.\n" + QWEN_ANSWER, None),  # text around the object
    ('```python\nget_weather(city="Paris", unit="celsius")\n```', None),  # code that calls the function
])
async def test_an_auto_answer_that_is_only_a_call_object_is_a_call(llama_dir, answer, call):
    from pyserve.testing.in_process import serving_models

    async with serving_models({"tiny": {"model": str(llama_dir), "num_kv_blocks": 128}},
                              tool_call_parser="hermes") as (_, c):
        for stream in (False, True):
            content, calls, finish = await _chat(c, stream, tools=TOOLS, guided_choice=[answer])
            if call is None:
                assert (content, calls, finish) == (answer, [], "stop")
            else:
                assert content is None and finish == "tool_calls"
                ((call_id, *got),) = calls
                assert tuple(got) == call and call_id.startswith("call_")
        # tool_choice "none" never reads calls, whatever the answer
        assert await _chat(c, False, tools=TOOLS, tool_choice="none", guided_choice=[answer]) == (answer, [], "stop")


async def test_a_call_is_forced_where_the_template_shows_no_tool_format_and_auto_is_refused(llama_dir):
    """The tiny model's chat template shows no tool-call format: a forced call's grammar writes
    the call all the same; under auto its own calls could not be read (400 naming the field)."""
    from pyserve.testing.in_process import serving_models

    async with serving_models({"tiny": {"model": str(llama_dir), "num_kv_blocks": 128}}) as (_, c):
        for stream in (False, True):
            for choice in ({"type": "function", "function": {"name": "add"}}, "required"):
                content, calls, finish = await _chat(c, stream, tools=TOOLS, tool_choice=choice, temperature=0,
                                                     parallel_tool_calls=False)
                assert content is None and len(calls) == 1 and finish == ("stop" if isinstance(choice, dict) else "tool_calls")
                for call_id, name, arguments in calls:
                    assert call_id.startswith("call_") and (name == "add" or choice == "required")
                    jsonschema.validate(json.loads(arguments), SCHEMA[name])
        r = await c.post("/v1/chat/completions", json={"model": "tiny", "messages": ASK, "tools": TOOLS})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
        assert "shows none" in r.json()["error"]["message"] and "--tool-call-parser" in r.json()["error"]["message"]
