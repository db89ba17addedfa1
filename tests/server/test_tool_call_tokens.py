"""A vocabulary that holds the call markers as tokens of their own, as Qwen's does (`<tool_call>`,
`</tool_call>`: added tokens that llguidance reads as special): forced and strict calls are
written with those tokens, the ones the model was trained to write (a grammar's quoted text
"<tool_call>" would match only the text spelled out in other tokens, and llguidance's forced
tokens for it hold the marker token its matcher then refuses)."""

from __future__ import annotations

import json

import jsonschema
import llguidance
import openai
import pytest

from pyserve import LLM
from pyserve.testing import build_model, start_server, stop_server
from pyserve.tools.formats import FORMATS

MARKERS = ("<tool_call>", "</tool_call>")
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a"], "additionalProperties": False}


def _tools(strict: bool = False) -> list[dict]:
    return [{"type": "function", "function": {"name": "add", "description": "Adds", "parameters": ADD,
                                               **({"strict": True} if strict else {})}}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("marker-tokens"), "qwen2", added_tokens=MARKERS)


@pytest.fixture(scope="module")
def client(model_dir, tmp_path_factory):
    proc, base = start_server(model_dir, "--served-model-name", "tiny", "--tool-call-parser", "hermes",
                              workdir=tmp_path_factory.mktemp("marker-server"))
    yield openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    stop_server(proc)


@pytest.mark.parametrize("parallel", [False, True])
def test_a_forced_call_is_written_with_the_marker_tokens(client, parallel):
    for seed in range(3):
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "add"}],
                                           tools=_tools(), tool_choice="required", parallel_tool_calls=parallel,
                                           max_tokens=200, temperature=1.0, seed=seed, logprobs=True)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        for call in choice.message.tool_calls:
            assert call.function.name == "add"
            jsonschema.validate(json.loads(call.function.arguments), ADD)
        tokens = [t.token for t in choice.logprobs.content]
        assert tokens[:2] == ["<tool_call>", "\n"]  # one token, not "<", "tool", ... spelled out
        assert tokens.count("<tool_call>") == tokens.count("</tool_call>") == len(choice.message.tool_calls)


def test_strict_auto_answers_in_text_or_calls_with_the_marker_tokens(client):
    finishes = []
    for seed in range(8):
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "add"}],
                                           tools=_tools(strict=True), max_tokens=200, temperature=1.0, seed=seed,
                                           logprobs=True)
        choice = r.choices[0]
        tokens = [t.token for t in choice.logprobs.content]
        finishes.append(choice.finish_reason)
        if choice.finish_reason == "tool_calls":
            assert tokens.count("<tool_call>") == len(choice.message.tool_calls) >= 1
            for call in choice.message.tool_calls:
                jsonschema.validate(json.loads(call.function.arguments), ADD)
        else:  # text, never a call's opening spelled out in pieces
            assert "<tool_call>" not in tokens and "<tool_call>" not in choice.message.content
    assert "tool_calls" in finishes and set(finishes) != {"tool_calls"}, finishes


def test_grammar_names_the_marker_tokens_by_id(model_dir):
    with LLM(model=str(model_dir)) as llm:
        ids = llm.tokenizer.encode("".join(MARKERS), add_special_tokens=False)
        marker_ids = llm.tokenizer.single_tokens(MARKERS + ("hello world",))
        assert marker_ids == dict(zip(MARKERS, ids))
        grammar = FORMATS["hermes"].grammar([{"name": "add", "parameters": ADD}], True, marker_ids=marker_ids)
        body = llm.tokenizer.encode('\n{"name": "add", "arguments": {"a": 5}}\n', add_special_tokens=False)
        newline = llm.tokenizer.encode("\n", add_special_tokens=False)
        for tail, accepted in (([], True), (newline, True), (newline + newline, False)):  # a newline may end the calls
            m = llguidance.LLMatcher(llm.engine.grammar_compiler.tokenizer, llguidance.grammar_from("lark", grammar), log_level=0)
            tokens = [ids[0], *body, ids[1], *tail]
            assert (m.try_consume_tokens(tokens) == len(tokens) and m.is_accepting()) == accepted
