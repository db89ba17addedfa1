"""Tool calls read out of text: each format's parser on whole outputs, and fed in every possible
split, the streamed pieces adding up to the whole-output parse byte for byte."""

from __future__ import annotations

import random

import llguidance
import pytest

from pyserve.default_model import TARGET_DIR
from pyserve.model.tokenizer import Tokenizer
from pyserve.tools.formats import FORMATS, detect
from pyserve.tools.parser import ParsedCall

HERMES = FORMATS["hermes"]
LLAMA = FORMATS["llama3_json"]

CASES = [
    (HERMES, 'Sure. <tool_call>\n{"name": "f", "arguments": {"a": {"b": [1, "}"]}}}\n</tool_call>',
     "Sure. ", [ParsedCall("f", '{"a": {"b": [1, "}"]}}')]),
    (HERMES, '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n<tool_call>\n'
             '{"name": "g", "arguments": {"x": "</tool"}}\n</tool_call>',
     "", [ParsedCall("f", "{}"), ParsedCall("g", '{"x": "</tool"}')]),
    (HERMES, '<tool_call>{ "name" : "h",  "arguments":{"k": 1} }</tool_call>', "", [ParsedCall("h", '{"k": 1}')]),
    # Cut off by max_tokens: the arguments as far as they were written, never the wrapper's text.
    (HERMES, '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</', "", [ParsedCall("f", '{"a": 1}')]),
    (HERMES, '<tool_call>\n{"name": "f", "arguments": {"a": "x}', "", [ParsedCall("f", '{"a": "x}')]),
    (HERMES, '<tool_call>\n{"name": "f", "arguments": {"s": "</tool_call><tool_call>"}}\n</tool_call>', "",
     [ParsedCall("f", '{"s": "</tool_call><tool_call>"}')]),  # markers inside a string are the value's
    (LLAMA, '{"name": "f", "parameters": {"q": [1, {"r": 2', "", [ParsedCall("f", '{"q": [1, {"r": 2')]),
    (LLAMA, '{"name": "f", "parameters": 5}', "", [ParsedCall("f", "5")]),
    (HERMES, "plain text with a < sign and <tool", "plain text with a < sign and <tool", []),
    (HERMES, "<tool_call> not json at all", "<tool_call> not json at all", []),
    (HERMES, '<tool_call>\n{"name": "f", "arguments": {"a": 1}}', "", [ParsedCall("f", '{"a": 1}')]),  # no close: EOS
    (LLAMA, '{"name": "f", "parameters": {"q": "a; b"}}; {"name": "g", "parameters": {}}', "",
     [ParsedCall("f", '{"q": "a; b"}'), ParsedCall("g", "{}")]),
    (LLAMA, '<|python_tag|>{"name": "f", "arguments": {"n": 2}}', "", [ParsedCall("f", '{"n": 2}')]),
    (LLAMA, '{"answer": 42}', '{"answer": 42}', []),
    (LLAMA, "The answer is 42.", "The answer is 42.", []),
    (HERMES, '<tool_call>\n{"name": "\\u0064o_it", "arguments": {}}\n</tool_call>', "",
     [ParsedCall("do_it", "{}")]),  # a name's JSON escapes are read as JSON
]


@pytest.mark.parametrize("fmt, text, content, calls", CASES)
def test_whole_outputs(fmt, text, content, calls):
    assert fmt.parser().parse(text) == (content, calls)


@pytest.mark.parametrize("fmt, text, content, calls", CASES)
def test_streamed_pieces_add_up_to_the_whole_parse(fmt, text, content, calls):
    rng = random.Random(len(text))
    for trial in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))) if trial else \
            list(range(1, len(text)))  # the first trial: one character at a time
        parser = fmt.parser()
        got_content, names, args = "", {}, {}
        for end in [*cuts, len(text)]:
            delta = parser.feed(text[:end], final=end == len(text))
            got_content += delta.content
            for c in delta.calls:
                if c.name is not None:
                    assert c.index not in names  # a header goes out once
                    names[c.index] = c.name
                args[c.index] = args.get(c.index, "") + c.arguments
        assert got_content == content
        assert [ParsedCall(names[i], args[i]) for i in sorted(args)] == calls


def test_the_format_is_read_from_the_chat_template():
    assert detect(Tokenizer.from_dir(TARGET_DIR).chat_template) is HERMES
    assert detect("{{ '<|python_tag|>' }}") is LLAMA
    assert detect("{{ messages }}") is None and detect(None) is None


@pytest.mark.parametrize("fmt", [HERMES, LLAMA])
def test_forcing_grammars_accept_what_the_parser_reads_and_nothing_else(fmt):
    tok = Tokenizer.from_dir(TARGET_DIR)
    lltok = llguidance.LLTokenizer(tok.inner.to_str(), n_vocab=4096, eos_token=[0, 4])
    functions = [{"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"], "additionalProperties": False}},
                 {"name": "noop"}]
    key = fmt.args_key
    call = f'{{"name": "get_weather", "{key}": {{"city": "Oslo"}}}}'
    one = f"<tool_call>\n{call}\n</tool_call>" if fmt.open else call
    two = one + (f"\n<tool_call>\n{{\"name\": \"noop\", \"{key}\": {{}}}}\n</tool_call>" if fmt.open
                 else f'; {{"name": "noop", "{key}": {{}}}}')

    def accepts(grammar: str, text: str) -> bool:
        m = llguidance.LLMatcher(lltok, llguidance.grammar_from("lark", grammar), log_level=0)
        ids = lltok.tokenize_str(text)
        return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()

    assert accepts(fmt.grammar(functions, parallel=False), one)
    assert not accepts(fmt.grammar(functions, parallel=False), two)
    if fmt.open:  # calls may end with a newline (Qwen2.5 writes `</tool_call>\n` before its end of text)
        assert accepts(fmt.grammar(functions, parallel=True), one + "\n")
        assert accepts(fmt.grammar(functions, parallel=False), two.split("<tool_call>\n{\"name\": \"noop")[0])
        assert not accepts(fmt.grammar(functions, parallel=True), one + "\n\n")
    assert accepts(fmt.grammar(functions, parallel=True), two)
    assert not accepts(fmt.grammar(functions[1:], parallel=True), one)  # only the named function
    bad = one.replace('"Oslo"', "7")
    assert not accepts(fmt.grammar(functions, parallel=False), bad)  # arguments follow the schema
    assert fmt.parser().parse(two)[1] == [ParsedCall("get_weather", '{"city": "Oslo"}'), ParsedCall("noop", "{}")]


@pytest.mark.parametrize("fmt", [HERMES, LLAMA])
def test_free_text_grammars_take_text_or_valid_calls(fmt):
    """tool_choice "auto" with strict functions: text that never opens a call, or calls that
    validate (after text, where the format writes text before calls)."""
    tok = Tokenizer.from_dir(TARGET_DIR)
    lltok = llguidance.LLTokenizer(tok.inner.to_str(), n_vocab=4096, eos_token=[0, 4])
    functions = [{"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"], "additionalProperties": False}}]
    call = f'{{"name": "get_weather", "{fmt.args_key}": {{"city": "Oslo"}}}}'
    one = f"<tool_call>\n{call}\n</tool_call>" if fmt.open else call
    two = f"{one}\n{one}" if fmt.open else f"{one}; {one}"

    def accepts(parallel: bool, text: str) -> bool:
        grammar = fmt.grammar(functions, parallel, free_text=True)
        m = llguidance.LLMatcher(lltok, llguidance.grammar_from("lark", grammar), log_level=0)
        ids = lltok.tokenize_str(text)
        return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()

    assert accepts(False, "It is sunny.") and accepts(False, "a <tool_call but no call")
    assert accepts(False, one) and accepts(True, two) and not accepts(False, two)
    assert not accepts(False, one.replace('"Oslo"', "7"))  # arguments follow the schema
    assert not accepts(False, one.replace("get_weather", "get_time"))
    if fmt.open:
        assert accepts(False, "Let me look.\n" + one) and accepts(True, one + "\n")
        assert not accepts(False, "an opening <tool_call> that is no call")
    else:
        assert not accepts(False, ' {"city": "Oslo"}')  # JSON that opens like a call must be one


@pytest.mark.parametrize("fmt", [HERMES, LLAMA])
def test_local_references_in_parameters_point_into_the_call(fmt):
    """pydantic writes enums and nested models as $defs and $ref "#/$defs/..."; placed under the
    call's arguments, the references must still resolve (and "#", the parameters themselves)."""
    tok = Tokenizer.from_dir(TARGET_DIR)
    lltok = llguidance.LLTokenizer(tok.inner.to_str(), n_vocab=4096, eos_token=[0, 4])
    params = {"type": "object", "$defs": {"Unit": {"enum": ["celsius", "fahrenheit"], "type": "string"}},
              "properties": {"unit": {"$ref": "#/$defs/Unit"},
                             "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
              "required": ["unit", "next"], "additionalProperties": False}
    key = fmt.args_key

    def accepts(args: str) -> bool:
        text = f'{{"name": "f", "{key}": {args}}}'
        text = f"<tool_call>\n{text}\n</tool_call>" if fmt.open else text
        grammar = fmt.grammar([{"name": "f", "parameters": params}], parallel=False)
        m = llguidance.LLMatcher(lltok, llguidance.grammar_from("lark", grammar), log_level=0)
        ids = lltok.tokenize_str(text)
        return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()

    assert accepts('{"unit": "celsius", "next": {"unit": "fahrenheit", "next": null}}')
    assert not accepts('{"unit": "kelvin", "next": null}')
    assert not accepts('{"unit": "celsius", "next": {"unit": "celsius"}}')  # the nested one is the whole schema
