"""A bare call object under tool_choice "auto" (issue 43): which whole answers are calls, with
their exact names and arguments, which stay content, and how streaming holds an answer that may
still become one (server/tool_calls.ChoiceCalls), ending as the whole answer's parse does."""

from __future__ import annotations

import random

import pytest

from pyserve.server.tool_calls import ChoiceCalls
from pyserve.tools.fallback import JsonCallFallback
from pyserve.tools.formats import FORMATS
from pyserve.tools.parser import ParsedCall

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
           "required": ["city"], "additionalProperties": False}
FUNCTIONS = [{"name": "get_weather", "parameters": WEATHER},
             {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}},
                                            "required": ["a"]}}]
QWEN = '```json\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n```'
PARIS = ParsedCall("get_weather", '{"city": "Paris", "unit": "C"}')

CALLS = [
    (QWEN, [PARIS]),  # issue 43's answer, as Qwen2.5-Coder-1.5B-Instruct wrote it
    ('\n  {"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}  \n', [PARIS]),  # bare
    ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}', [PARIS]),  # Llama-3's key
    ('```\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n```', [PARIS]),  # no language
    ('```JSON {"name": "add", "arguments": {"a": 2}}```', [ParsedCall("add", '{"a": 2}')]),  # one line
    ('{"name": "get_weather", "arguments": {"city": "Zürich"}}', [ParsedCall("get_weather", '{"city": "Zürich"}')]),
    ('```json\n[{"name": "add", "arguments": {"a": 1}}, {"name": "get_weather", "arguments": {"city": "Oslo"}}]\n```',
     [ParsedCall("add", '{"a": 1}'), ParsedCall("get_weather", '{"city": "Oslo"}')]),  # parallel calls
]
CONTENT = [
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "kelvin"}}',  # arguments the schema rejects
    '{"name": "get_weather", "arguments": {"unit": "C"}}',  # a required argument missing
    '{"name": "get_time", "arguments": {"city": "Paris"}}',  # an undeclared function
    'Sure!\n' + QWEN,  # text before the object
    QWEN + '\nThis calls the weather tool.',  # text after it
    '```python\nget_weather(city="Paris", unit="C")\n```',  # code that calls the function
    '```python\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n```',  # a python fence
    '{"name": "get_weather", "arguments": {"city": "Paris"}, "id": 1}',  # keys beyond name and arguments
    '{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}',  # arguments that are no object
    '{"name": "add", "arguments": {"a": 1}}\n{"name": "add", "arguments": {"a": 2}}',  # two values, no list
    '[]', '{"city": "Paris"}', 'The weather in Paris is mild.', '```json\n{"name": "add", "arguments": {"a": 1}}',
    QWEN + '\n' + QWEN,  # two fences
]


@pytest.mark.parametrize("text, calls", CALLS)
def test_an_answer_that_is_only_a_declared_call_is_read_as_calls(text, calls):
    assert JsonCallFallback(FUNCTIONS, parallel=True).calls(text) == calls


@pytest.mark.parametrize("text", CONTENT)
def test_anything_else_stays_content(text):
    assert JsonCallFallback(FUNCTIONS, parallel=True).calls(text) == []


def test_a_list_of_calls_needs_parallel_calls():
    text = '[{"name": "add", "arguments": {"a": 1}}]'
    assert JsonCallFallback(FUNCTIONS, parallel=False).calls(text) == []
    assert JsonCallFallback(FUNCTIONS, parallel=True).calls(text) == [ParsedCall("add", '{"a": 1}')]


def test_the_message_of_a_fallback_answer_has_the_call_and_no_content():
    msg = ChoiceCalls(FORMATS["hermes"].parser(), False, fallback=JsonCallFallback(FUNCTIONS, True)).message(QWEN)
    assert msg["content"] is None
    ((call),) = msg["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}
    without = ChoiceCalls(FORMATS["hermes"].parser(), False).message(QWEN)  # tool_choice "none" plans no fallback
    assert without == {"role": "assistant", "content": QWEN}


def _stream(text: str, fmt: str, pieces: list[int]) -> tuple[str, list[tuple[str, str]], list[str]]:
    """(content, [(name, arguments)], the content of each chunk) of `text` streamed in `pieces`."""
    calls = ChoiceCalls(FORMATS[fmt].parser(), False, fallback=JsonCallFallback(FUNCTIONS, True))
    content, found, chunks, at = "", {}, [], 0
    for end in [*pieces, len(text)]:
        delta, _ = calls.delta(text[at:end], final=end == len(text))
        at = end
        chunks.append(delta.get("content", ""))
        content += delta.get("content", "")
        for c in delta.get("tool_calls", []):
            entry = found.setdefault(c["index"], ["", ""])
            entry[0] = c["function"].get("name") or entry[0]
            entry[1] += c["function"]["arguments"]
    return content, [tuple(found[i]) for i in sorted(found)], chunks


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json"])
@pytest.mark.parametrize("text", [t for t, _ in CALLS] + CONTENT + [
    'Hi <tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>',
    '{"name": "add", "parameters": {"a": 1}}; {"name": "nope", "parameters": {}}'])
def test_streaming_ends_as_the_whole_answer_reads(fmt, text):
    whole = ChoiceCalls(FORMATS[fmt].parser(), False, fallback=JsonCallFallback(FUNCTIONS, True)).message(text)
    want_calls = [(c["function"]["name"], c["function"]["arguments"]) for c in whole.get("tool_calls", [])]
    rng = random.Random(len(text))
    for trial in range(12):
        pieces = list(range(1, len(text))) if trial == 0 else \
            sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
        content, calls, _ = _stream(text, fmt, pieces)
        assert calls == want_calls
        assert (content or None) == whole["content"]


def test_ordinary_text_streams_unheld_and_a_python_fence_once_its_language_is_read():
    text = "The weather in Paris is mild today."
    _, _, chunks = _stream(text, "hermes", list(range(1, len(text))))
    assert chunks == list(text)  # every character as it comes
    code = '```python\nget_weather(city="Paris")\n```'
    _, _, chunks = _stream(code, "hermes", list(range(1, len(code))))
    assert chunks[:9] == [""] * 9 and chunks[9] == "```python\n"  # held only until its tag ended
    _, _, chunks = _stream(QWEN, "hermes", list(range(1, len(QWEN))))
    assert chunks == [""] * len(QWEN)  # a call after all: nothing went out as content
