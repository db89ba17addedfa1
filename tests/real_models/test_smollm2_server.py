"""The OpenAI server on SmolLM2-135M-Instruct's GGUF file, driven by the official client: a chat
answer, the same answer streamed, `parse()` with an unbounded int field, and forced calls, on a
named property and on an open schema (where this model invents keys and nests objects until its
budget closes them: structured/json_close.py)."""

from __future__ import annotations

import json

import openai
import pytest
from pydantic import BaseModel

from pyserve.testing import start_server, stop_server

MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def client(smollm2, tmp_path_factory):
    proc, base = start_server(smollm2, "--max-model-len", "2048", "--tool-call-parser", "hermes",
                              workdir=tmp_path_factory.mktemp("smol"))
    yield openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    stop_server(proc)


def test_chat_answers_and_streams_the_same_text(client):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=32)
    text = answer.choices[0].message.content
    assert "Paris" in text and answer.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=32, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == text


class Person(BaseModel):
    name: str
    age: int


def test_parse_with_an_unbounded_int_field_ends_with_a_valid_object(client):
    done = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Alice is 30 years old. Give her name and age as JSON."}],
        response_format=Person, temperature=0, max_tokens=64)
    choice = done.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Person) and choice.message.parsed.age >= 0


def test_a_forced_call_gives_the_arguments_the_question_holds(client):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tools = [{"type": "function", "function": {"name": "lookup", "description": "Look something up",
                                               "parameters": schema}}]
    done = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Look up the weather in Paris."}], tools=tools,
        tool_choice={"type": "function", "function": {"name": "lookup"}}, temperature=0, max_tokens=96)
    calls = done.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "lookup"
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert done.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("question", ["Look up the weather in Paris.", "Find flights from London to Rome tomorrow.",
                                      "What is 17 times 23?", "Who wrote Hamlet?"])
def test_a_call_forced_on_an_open_schema_is_valid(client, question):
    tools = [{"type": "function", "function": {"name": "lookup", "description": "Look something up",
                                               "parameters": {"type": "object"}}}]
    done = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], tools=tools,
        tool_choice={"type": "function", "function": {"name": "lookup"}}, temperature=0, max_tokens=96)
    choice = done.choices[0]
    calls = choice.message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "lookup"
    assert isinstance(json.loads(calls[0].function.arguments), dict), calls[0].function.arguments
    assert choice.finish_reason in ("stop", "length") and done.usage.completion_tokens <= 96
