"""json_close: JSON that runs out of tokens is closed, not cut. The phases a JsonTrack gives, the
cost bound each closing token lowers and no guarded token raises, masks that narrow only at the
budget's end, and the embedded model's open JSON ending valid with finish_reason "length"."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from pyserve import SamplingParams, StructuredOutputsParams
from pyserve.default_model import TARGET_DIR
from pyserve.model.tokenizer import Tokenizer
from pyserve.structured.compiler import GrammarCompiler
from pyserve.structured.json_close import GUARD, PHASES, ClosingTokens, hold_to_budget, phase, tokens_to_close
from pyserve.structured.json_rules import JsonTrack

TOKENS = [b'"', b'"}', b'"]}', b"}", b"]", b"}}", b" }", b":", b": ", b': "', b": null", b"null", b"true}",
          b"5", b"-12]", b'""', b'"a"', b'"ab": ', b'"k', b'abc"', b'abc": ', b"x", b",", b', "', b"{", b"[",
          b"1}", b"0", b"e", b'\\"', b'"a', b"ab"]
WORDS = (len(TOKENS) + 31) // 32
CLOSING = ClosingTokens(TOKENS, WORDS)


def _track(text: bytes, text_around: bool = False) -> JsonTrack:
    track = JsonTrack.start(text_around)
    track.feed(text)
    return track


def _allowed(name: str | None, guarded: bool = False) -> list[bytes]:
    masks = CLOSING.guarded if guarded else CLOSING.closing
    bits = np.unpackbits(masks[name].view(np.uint8), bitorder="little")
    return [TOKENS[i] for i in np.flatnonzero(bits[: len(TOKENS)])]


def test_phases_follow_what_must_come_next():
    assert tokens_to_close(_track(b'{"a": 1}'), None) == 0  # nothing open: nothing to close
    assert phase(_track(b"{")) == "close" and phase(_track(b"[")) == "close"
    assert phase(_track(b'{"ke')) == "key_end" and phase(_track(b'{"a": "va')) == "string_end"
    assert phase(_track(b'{"a": "v\\')) is None  # an escape pending
    assert phase(_track(b'{"a"')) == "colon" and phase(_track(b'{"a": ')) == "value"
    assert phase(_track(b"[1, ")) == "value" and phase(_track(b'{"a": 1, ')) == "new_key"
    assert phase(_track(b'{"a": 12')) == "number_end" and phase(_track(b'{"a": -')) is None
    assert phase(_track(b'{"a": [true, {"b": null}]')) == "close"
    assert phase(_track(b'{"a": nu')) is None  # a literal half written
    assert phase(_track(b'<tool_call>\n{"a": "x', text_around=True)) == "string_end"
    assert tokens_to_close(_track(b'<tool_call>\n{"a": "x', text_around=True), "string_end") == 1 + 1 + 8 + 1
    # before any JSON: a value that closes at once, its two tokens and the end
    assert phase(_track(b"")) == phase(_track(b" \n")) == "start" and tokens_to_close(_track(b""), "start") == 3
    assert phase(_track(b"", text_around=True)) == "close" and tokens_to_close(_track(b"", text_around=True), "close") == 0
    # a string at the top level: its quote and the end; once closed, nothing
    assert phase(_track(b'"ab')) == "string_end" and tokens_to_close(_track(b'"ab'), "string_end") == 2
    assert tokens_to_close(_track(b'"ab"'), phase(_track(b'"ab"'))) == 0


def test_each_phase_allows_its_closing_tokens_only():
    assert _allowed("close") == [b"}", b"]", b"}}", b" }"]
    # in a string, `: "` and `, "` end it too (": " and ", " its last bytes)
    assert _allowed("string_end") == [b'"', b'"}', b'"]}', b': "', b'abc"', b', "']
    assert _allowed("key_end") == [b'"', b': "', b'abc"', b'abc": ', b', "']
    assert _allowed("colon") == [b":", b": ", b': "', b": null"]
    assert _allowed("value") == [b'"', b"null", b"true}", b"5", b"-12]", b'""', b'"a"', b"1}", b"0"]
    assert _allowed("new_key") == [b'"', b'"}', b'"]}', b'""', b'"a"', b'"ab": ', b'"k', b'"a']
    assert _allowed("number_end") == [b"}", b"]", b"}}", b" }", b"1}"]
    assert _allowed("start") == [b'"', b"null", b"true}", b"5", b"-12]", b'""', b'"a"', b"{", b"[", b"1}", b"0"]
    assert set(PHASES) == set(CLOSING.closing)
    # the guard adds the tokens that open nothing; after digits, only digits
    assert set(_allowed("close", guarded=True)) - set(_allowed("close")) == {b"null", b"true}", b"5", b"-12]", b"x",
                                                                            b"1}", b"0", b"e", b"ab"}
    assert _allowed("number_end", guarded=True) == [b"}", b"]", b"}}", b" }", b"5", b"1}", b"0"]


def _values(rng: random.Random, depth: int) -> str:
    kind = rng.choice(["obj", "arr", "str", "num", "lit"] if depth < 3 else ["str", "num", "lit"])
    if kind == "obj":
        return "{" + ", ".join(f'"k{i}": {_values(rng, depth + 1)}' for i in range(rng.randint(0, 3))) + "}"
    if kind == "arr":
        return "[" + ", ".join(_values(rng, depth + 1) for _ in range(rng.randint(0, 3))) + "]"
    if kind == "str":
        return json.dumps("".join(rng.choice('ab "\\') for _ in range(rng.randint(0, 4))))
    return rng.choice(["0", "-17", "3.5e2", "true", "false", "null"])


def _cost(track: JsonTrack) -> int:
    return tokens_to_close(track, phase(track))


@pytest.fixture(scope="module")
def any_json():
    """Whether JSON (as the masks write it: ", " and ": ", no other whitespace) may go on with
    given bytes after a prefix: llguidance's matcher on the embedded vocabulary."""
    tok = Tokenizer.from_dir(TARGET_DIR)
    grammar = GrammarCompiler(tok.inner.to_str, 4096, [0, 4]).compile(StructuredOutputsParams(json={}))

    def allows(prefix: bytes, more: list[bytes]) -> list[bool]:
        m = grammar.matcher()
        ids = tok.encode(prefix.decode(), add_special_tokens=False)
        assert m.try_consume_tokens(ids) == len(ids), prefix
        out = []
        for b in more:
            ids = tok.encode(b.decode(), add_special_tokens=False)
            n = m.try_consume_tokens(ids)
            out.append(n == len(ids) and not m.is_error())
            m.rollback(n)
        return out

    return allows


def test_closing_tokens_lower_the_cost_and_guarded_ones_never_raise_it_from_every_prefix(any_json):
    rng, closing, guarded = random.Random(7), 0, 0
    for _ in range(60):
        text = ("{" + f'"x": {_values(rng, 1)}' + "}").encode()
        for cut in range(1, len(text)):
            track = _track(text[:cut])
            at = phase(track)
            candidates = _allowed(at, guarded=True) if at is not None else []  # no mask applies there
            for token, ok in zip(candidates, any_json(text[:cut], candidates)):
                if not ok:
                    continue
                after = track.copy()
                after.feed(token)
                assert _cost(after) <= _cost(track), (text[:cut], token)
                guarded += 1
                if at is not None and token in _allowed(at):
                    assert not after.stack or phase(after) is not None, (text[:cut], token)
                    assert _cost(after) < _cost(track), (text[:cut], token)
                    closing += 1
    assert closing > 500 and guarded > 1000, (closing, guarded)


def test_a_mask_narrows_only_when_the_budget_is_down_to_closing():
    track = _track(b'{"a": "some')  # string_end: the quote, the brace, the end: 1 + 1 + 1
    assert tokens_to_close(track, "string_end") == 3
    everything = np.full(WORDS, 0xFFFFFFFF, dtype=np.uint32)
    words = everything.copy()
    assert hold_to_budget(track, 4 + GUARD, words, lambda: CLOSING) is None and (words == everything).all()
    assert hold_to_budget(track, 3 + GUARD, words, lambda: CLOSING) == "guard"
    assert (words == CLOSING.guarded["string_end"]).all()
    assert hold_to_budget(track, 4, words, lambda: CLOSING) == "guard"
    words = everything.copy()
    assert hold_to_budget(track, 3, words, lambda: CLOSING) == "closing" and (words == CLOSING.closing["string_end"]).all()
    nothing_closes = np.zeros(WORDS, dtype=np.uint32)
    nothing_closes[0] = 1 << TOKENS.index(b"x") | 1 << TOKENS.index(b",")  # the grammar allows no closing token
    for left in (1, 3 + GUARD):
        words = nothing_closes.copy()
        assert hold_to_budget(track, left, words, lambda: CLOSING) is None and (words == nothing_closes).all()


@pytest.mark.parametrize("schema", [{"type": "object"}, {"type": "object", "additionalProperties": {"type": "string"}}])
def test_open_objects_out_of_tokens_end_valid_with_length(llm, json_prompts, schema):
    for max_tokens in (12, 40):
        params = SamplingParams(max_tokens=max_tokens, temperature=0,
                                structured_outputs=StructuredOutputsParams(json=schema))
        outs = [o.outputs[0] for o in llm.generate(json_prompts, params, use_tqdm=False)]
        for c in outs:
            assert isinstance(json.loads(c.text), dict), c.text
            assert len(c.token_ids) <= max_tokens
            assert c.finish_reason in ("stop", "length") and (c.text != "{}" or c.finish_reason == "stop")
        assert sum(c.finish_reason == "length" for c in outs) >= 4  # these ran out and were closed


@pytest.mark.parametrize("spec", [StructuredOutputsParams(json_object=True), StructuredOutputsParams(json={}),
                                  StructuredOutputsParams(json={"type": "string"})])
def test_a_budget_of_a_few_tokens_still_ends_valid(llm, json_prompts, spec):
    """Under 12 tokens the first one may open only what closes at once: `{`, `[`, a scalar, a
    string's quote (a Qwen model answered `{"":` at 3 tokens and `"Hello! How` at 4)."""
    for max_tokens in (3, 4, 6, 9):
        params = [SamplingParams(max_tokens=max_tokens, temperature=t, seed=i, structured_outputs=spec)
                  for i, t in enumerate((0.0, 1.0, 1.0))]
        for out in llm.generate(json_prompts[:4] * 3, params * 4, use_tqdm=False):
            c = out.outputs[0]
            json.loads(c.text)  # whole JSON, whichever way it finished
            assert len(c.token_ids) <= max_tokens


def test_json_the_model_ends_near_its_budget_stops(llm, json_prompts):
    """`[0]` ends in 4 tokens of 6: under the guard (the last tokens), not closed by it."""
    params = SamplingParams(max_tokens=6, temperature=0,
                            structured_outputs=StructuredOutputsParams(json={"type": "array"}))
    c = llm.generate(json_prompts[:2], params, use_tqdm=False)[0].outputs[0]
    assert (c.text, c.finish_reason) == ("[0]", "stop")
