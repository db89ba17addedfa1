"""json_rules: an object never repeats a key and a number's digits end where a machine number's
do; the rules as a JsonTrack follows bytes, as masks of the embedded vocabulary, and end to end
on the embedded model (whose greedy outputs broke both before)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from pyserve import SamplingParams, StructuredOutputsParams
from pyserve.default_model import TARGET_DIR
from pyserve.model.tokenizer import Tokenizer
from pyserve.structured.compiler import GrammarCompiler
from pyserve.structured.json_rules import JsonTrack, JsonVocab
from pyserve.structured.matchers import GrammarMatchers, MaskRow

VOCAB = 4096
EOS = [0, 4]
TOY = JsonVocab([b"a", b'"', b'": ', b"12", b"1234", b'b"', b"x", b'\\"', b"5}"])


def test_a_track_bans_closing_a_key_its_object_holds():
    track = JsonTrack.start(text_around=False)
    track.feed(b'{"a": 1, "b": {"a": [{"b": 2}], "')
    assert track.banned(TOY) is None  # no key of the inner object is "" (what `"` would close)
    track.feed(b"a")
    assert track.banned(TOY).tolist() == [1, 2]  # `"` and `": ` would close "a" a second time
    track.feed(b"a")
    assert track.banned(TOY) is None  # "aa" is new
    track = JsonTrack.start(text_around=False)
    track.feed(b'{"a": 1, "b": {"a": [{"b": 2}], "')
    assert track.banned(TOY) is None and TOY.closing[b"b"] == [5]
    track.feed(b'b": 3, "')  # "b" was the list's object's key, not this one's: it could close
    assert track.banned(TOY).tolist() == [5]  # now it is this object's: `b"` would repeat it
    track.feed(b"\\")  # an escape pending: whatever comes is the key's
    assert track.banned(TOY) is None


def test_a_track_bans_digits_past_a_machine_numbers():
    track = JsonTrack.start(text_around=False)
    track.feed(b"[" + b"1" * 17)
    assert track.banned(TOY).tolist() == [4]  # 2 digits left: "12" may follow, "1234" not
    track.feed(b"12")
    assert set(track.banned(TOY).tolist()) == {3, 4, 8}  # 19 written: no digit may follow
    track.feed(b".")
    assert track.banned(TOY) is None  # the fraction has its own 17
    track.feed(b"1" * 17 + b"e-")
    assert track.banned(TOY).tolist() == [4]  # an exponent of 4 digits is past a double's
    track.feed(b"12")
    assert set(track.banned(TOY).tolist()) == {3, 4}  # one digit left: "5}" may end it, "12" not


def test_around_text_the_rules_hold_inside_each_json_value_only():
    track = JsonTrack.start(text_around=True)
    track.feed(b'"a": 12345678901234567890 ')  # text: no rule
    assert track.banned(TOY) is None and track.in_text
    track.feed(b'<tool_call>\n{"a": 1, "a')
    assert set(track.banned(TOY).tolist()) == {1, 2}
    track.feed(b'b": 2}\n</tool_call>\n<tool_call>\n{"a')
    assert track.banned(TOY) is None  # a new call, a new object


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(TARGET_DIR)


def _allowed(bits: np.ndarray) -> set[int]:
    return set(np.flatnonzero(np.unpackbits(bits.view(np.uint8), bitorder="little")).tolist())


def test_masks_of_an_open_schema_leave_out_a_repeated_key(tok):
    compiler = GrammarCompiler(tok.inner.to_str, VOCAB, EOS)
    matchers = GrammarMatchers(VOCAB, EOS)
    matchers.add(1, compiler.compile(StructuredOutputsParams(json={"type": "object"})))
    for t in tok.encode('{"s": "s", "s', add_special_tokens=False):
        matchers.start_masks([MaskRow(1, 0, [])]).result()
        assert matchers.advance(1, [t]) is None
    closing = {t for t in range(VOCAB) if tok.decode([t]).startswith('"')}
    s = tok.encode("s", add_special_tokens=False)
    rows = matchers.start_masks([MaskRow(1, 0, s)]).result()  # row 1: after the draft "s"
    first, after_draft = _allowed(rows.bits[0]), _allowed(rows.bits[1])
    assert not first & closing and s[0] in first  # the key "s" may not close; "ss" may go on
    assert closing & after_draft  # "ss" is a new key: it may close
    matchers.close()


def test_a_token_trees_rows_are_masked_as_each_ones_own_path(tok):
    """Rows of a tree (its last token, then drafts "s" and a closing quote after it and "s" after
    "s"): each row's mask is the one its path gives as a chain, JSON's rules included."""
    compiler = GrammarCompiler(tok.inner.to_str, VOCAB, EOS)
    grammar = compiler.compile(StructuredOutputsParams(json={"type": "object"}))
    matchers = GrammarMatchers(VOCAB, EOS)
    matchers.add(1, grammar)
    for t in tok.encode('{"s": "s", "s', add_special_tokens=False):
        matchers.start_masks([MaskRow(1, 0, [])]).result()
        assert matchers.advance(1, [t]) is None
    s, x = tok.encode("s", add_special_tokens=False)[0], tok.encode('"', add_special_tokens=False)[0]
    tree = matchers.start_masks([MaskRow(1, 0, [s, x, s], parents=[-1, 0, 0, 1])]).result()
    via_s = matchers.start_masks([MaskRow(1, 0, [s, s])]).result()
    via_x = matchers.start_masks([MaskRow(1, 0, [x])]).result()
    np.testing.assert_array_equal(tree.bits[[0, 1, 3]], via_s.bits)
    np.testing.assert_array_equal(tree.bits[2], via_x.bits[1])
    assert not np.array_equal(tree.bits[1], tree.bits[2])  # the branches differ
    assert tree.certain == frozenset()  # a tree's drafts are always verified
    matchers.close()


def _pairs_unique(pairs):
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)), keys
    return dict(pairs)


@pytest.mark.parametrize("schema", [{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
                                    {"type": "object", "additionalProperties": {"type": "integer"}}])
def test_greedy_open_objects_never_repeat_a_key(llm, json_prompts, schema):
    params = SamplingParams(max_tokens=150, temperature=0, structured_outputs=StructuredOutputsParams(json=schema))
    for out in llm.generate(json_prompts, params, use_tqdm=False):
        text = out.outputs[0].text
        if out.outputs[0].finish_reason == "stop":
            json.loads(text, object_pairs_hook=_pairs_unique)
        keys = re.findall(r'"([^"\\]*)": ', text)  # a flat object's keys, however far it got
        assert len(keys) == len(set(keys)), text


@pytest.mark.parametrize("kind, most_digits", [("integer", 19), ("number", 19)])
def test_unbounded_numbers_end_within_a_machine_numbers_digits(llm, json_prompts, kind, most_digits):
    params = SamplingParams(max_tokens=150, temperature=0, structured_outputs=StructuredOutputsParams(json={"type": kind}))
    outs = llm.generate(json_prompts, params, use_tqdm=False)
    for out in outs:
        c = out.outputs[0]
        assert c.finish_reason == "stop", c.text
        whole, frac, exp = re.fullmatch(r"-?(\d+)(?:\.(\d+))?(?:[eE][+-]?(\d+))?", c.text).groups()
        assert len(whole) <= most_digits and len(frac or "") <= 17 and len(exp or "") <= 3, c.text
    assert max(len(o.outputs[0].text) for o in outs) >= 19  # the model does run to the cap here
