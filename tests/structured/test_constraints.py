"""Constraints before any model runs: their checks and limits, the compiler and its cache, the
matchers' masks (drafts included) and the mask applied to logits."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from pyserve.default_model import TARGET_DIR
from pyserve.model.tokenizer import Tokenizer
from pyserve.model.token_masks import BANNED, apply_token_masks
from pyserve.structured import compiler as compiler_module
from pyserve.structured.compiler import GrammarCompiler
from pyserve.structured.matchers import GrammarMatchers, MaskRow, TokenMasks
from pyserve.structured.params import GrammarError, StructuredOutputsParams

VOCAB = 4096
EOS = [0, 4]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(TARGET_DIR)


@pytest.fixture
def compiler(tok) -> GrammarCompiler:
    return GrammarCompiler(tok.inner.to_str, VOCAB, EOS)


def allowed(bits: np.ndarray) -> set[int]:
    return set(np.flatnonzero(np.unpackbits(bits.view(np.uint8), bitorder="little")).tolist())


def test_exactly_one_constraint_is_given():
    with pytest.raises(GrammarError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(GrammarError, match="got json, regex"):
        StructuredOutputsParams(json={"type": "object"}, regex="a+")
    with pytest.raises(GrammarError, match="choice"):
        StructuredOutputsParams(choice=[])


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


@pytest.mark.parametrize("schema, message", [
    (_nested(11), "deeper than 10"),
    ({"anyOf": [{"anyOf": [{"anyOf": [_nested(9)]}]}]}, "deeper than 10"),
    ({"enum": list(range(1001))}, "more than 1000 enum"),
    ({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(5001)}}, "more than 5000"),
    ("{not json", "not valid JSON"),
    ([1, 2], "must be a JSON object"),
    ({"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 7}}}, "multipleOf is not supported"),
    ({"items": {"anyOf": [{"type": "number", "multipleOf": 0.5}]}}, "multipleOf is not supported"),
])
def test_schemas_over_the_limits_are_refused_before_compiling(schema, message):
    start = time.perf_counter()
    with pytest.raises(GrammarError, match=message):
        StructuredOutputsParams(json=schema)
    assert time.perf_counter() - start < 0.5


def test_the_limits_themselves_are_allowed():
    StructuredOutputsParams(json=_nested(10))
    StructuredOutputsParams(json={"enum": list(range(1000))})
    StructuredOutputsParams(json={"type": "object", "properties": {"multipleOf": {"type": "integer"}}})  # a name


@pytest.mark.parametrize("regex, ascii", [
    (r"\d{4}-\d{2}", "[0-9]{4}-[0-9]{2}"), (r"[\d.]+\w", "[0-9.]+[0-9A-Za-z_]"), (r"[^\d\]]", r"[^0-9\]]"),
    (r"[]\d]", "[]0-9]"), (r"\D\W", "[^0-9][^0-9A-Za-z_]"), (r"\\d\p{L}", r"\\d\p{L}"),
])
def test_a_regexs_digit_and_word_classes_are_ascii(regex, ascii):
    assert compiler_module.ascii_classes(regex) == ascii


def test_a_regex_digit_is_an_ascii_digit_only(compiler, tok):
    """As in JSON Schema's patterns: `\\d` takes 7, not another script's digit (U+0661)."""
    for text, taken in (("7", True), ("\u0661", False)):
        ids = tok.inner.encode(text, add_special_tokens=False).ids
        matcher = compiler.compile(StructuredOutputsParams(regex=r"\d")).matcher()
        assert (matcher.try_consume_tokens(ids) == len(ids)) is taken, text


@pytest.mark.parametrize("spec, message", [
    (StructuredOutputsParams(regex="(a"), "unclosed group"),
    (StructuredOutputsParams(json={"type": "foo"}), "foo"),
    (StructuredOutputsParams(grammar="start: undefined_rule"), "undefined_rule"),
    (StructuredOutputsParams(json={"$ref": "#/$defs/missing"}), "missing"),
    (StructuredOutputsParams(json={"oneOf": [{"type": "integer"}, {"type": "number"}]}),  # not llguidance's option
     "a oneOf whose branches may both match is not supported here"),
])
def test_invalid_constraints_fail_to_compile_with_the_engines_message(compiler, spec, message):
    with pytest.raises(GrammarError, match=message):
        compiler.compile(spec)


def test_compiled_grammars_are_cached_and_the_cache_is_bounded(compiler, monkeypatch):
    monkeypatch.setattr(compiler_module, "CACHE_SIZE", 3)
    first = compiler.compile(StructuredOutputsParams(regex="a+"))
    assert compiler.compile(StructuredOutputsParams(regex="a+")) is first
    for pattern in ("b+", "c+", "d+"):
        compiler.compile(StructuredOutputsParams(regex=pattern))
    assert len(compiler._cache) == 3
    assert compiler.cached(StructuredOutputsParams(regex="a+")) is None  # least recently used went first


def test_hostile_constraints_are_refused_or_compile_quickly(compiler):
    """Exponential regexes, recursive references and deep alternations: llguidance's automata
    and limits make each a bounded compile, never a runaway one."""
    specs = [
        StructuredOutputsParams(regex="(a*)*b"),
        StructuredOutputsParams(regex="(a|aa)+$"),
        StructuredOutputsParams(regex="([a-z]{1,20}){1,20}x"),
        StructuredOutputsParams(json={"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}},
                                      "$ref": "#/$defs/n"}),
        StructuredOutputsParams(json={"oneOf": [{"oneOf": [{"oneOf": [{"type": "integer"}, {"type": "string"}]}] * 30}] * 30}),
        StructuredOutputsParams(json={"enum": [f"value-{i}" * 20 for i in range(1000)]}),
    ]
    for spec in specs:
        start = time.perf_counter()
        try:
            compiler.compile(spec)
        except GrammarError:
            pass
        assert time.perf_counter() - start < 1.0, spec


def test_masks_follow_the_matcher_through_drafts_and_leave_it_where_it_was(compiler, tok):
    grammar = compiler.compile(StructuredOutputsParams(json={"type": "object", "properties": {"n": {"type": "integer"}},
                                                             "required": ["n"], "additionalProperties": False}))
    matchers = GrammarMatchers(VOCAB, EOS)
    matchers.add(7, grammar)
    text_ids = tok.encode('{"n": 12}', add_special_tokens=False)
    assert matchers.valid_drafts(7, text_ids + [text_ids[0]]) == text_ids  # cut at the first refused token
    masks = matchers.start_masks([MaskRow(7, 2, text_ids[:3])]).result()
    assert masks.rows.tolist() == [2, 3, 4, 5]
    reference = grammar.matcher()
    for i in range(4):  # row i: as the matcher stands after the first i drafts
        bits = np.zeros(matchers.words, dtype=np.int32)
        reference.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        assert allowed(masks.bits[i]) == allowed(bits)
        if i < 3:
            assert text_ids[i] in allowed(masks.bits[i])
            reference.consume_token(text_ids[i])
    # Rolled back: the first row is computed again from the start.
    again = matchers.start_masks([MaskRow(7, 0, [])]).result()
    assert allowed(again.bits[0]) == allowed(masks.bits[0])
    assert matchers.advance(7, text_ids) is None and matchers.advance(7, [EOS[1]]) is None  # EOS after a complete output
    matchers.close()


def test_a_matcher_that_cannot_follow_says_why(compiler, tok):
    matchers = GrammarMatchers(VOCAB, EOS)
    matchers.add(1, compiler.compile(StructuredOutputsParams(regex="a{1000000}")))
    matchers.add(2, compiler.compile(StructuredOutputsParams(choice=["yes"])))
    a = tok.encode("a", add_special_tokens=False)
    assert allowed(matchers.start_masks([MaskRow(1, 0, [])]).result().bits[0]) == set(a)  # a mask a step, as the engine
    # llguidance's lexer gives up on the million-fold repeat as it takes the first "a".
    assert "too many expressions" in matchers.advance(1, a)
    assert "doesn't satisfy the grammar" in matchers.advance(2, tok.encode("no", add_special_tokens=False))
    matchers.close()


def test_forced_tokens_are_what_the_grammar_allows_alone(compiler, tok):
    matchers = GrammarMatchers(VOCAB, EOS)
    matchers.add(1, compiler.compile(StructuredOutputsParams(choice=["hello world"])))
    forced = matchers.forced_tokens(1)
    assert forced and tok.decode(forced) == "hello world"[: len(tok.decode(forced))]
    matchers.close()


def test_apply_token_masks_leaves_exactly_the_allowed_tokens():
    logits = torch.randn(3, 70)
    before = logits.clone()
    bits = np.zeros((1, 3), dtype=np.int32)
    for t in (0, 31, 32, 69):
        bits[0, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    apply_token_masks(logits, TokenMasks(np.array([1]), bits))
    assert torch.equal(logits[[0, 2]], before[[0, 2]])
    kept = (logits[1] > BANNED / 2).nonzero().flatten().tolist()
    assert kept == [0, 31, 32, 69]
    assert torch.equal(logits[1, kept], before[1, kept])
    assert logits[1].softmax(-1)[[t for t in range(70) if t not in kept]].sum() == 0
    every = torch.randn(2, 70)
    apply_token_masks(every, TokenMasks(np.array([0, 1]), np.repeat(bits, 2, axis=0)))  # all rows: one add
    assert (every > BANNED / 2).nonzero()[:, 1].tolist() == kept * 2


def test_a_draft_is_certain_only_where_the_mask_allows_that_draft_alone(compiler, tok):
    """Where a grammar forces bytes, llguidance's mask keeps only their canonical token, while
    consuming accepts any token spelling them: '"' passes the matcher where the mask holds '":'
    alone. Such a draft must be verified (and rejected), not kept."""
    matchers = GrammarMatchers(VOCAB, EOS)
    matchers.add(3, compiler.compile(StructuredOutputsParams(choice=['": 1'])))
    quote, canonical = tok.inner.token_to_id('"'), tok.inner.token_to_id('":')
    assert matchers.valid_drafts(3, [quote]) == [quote]  # the bytes check passes it
    masks = matchers.start_masks([MaskRow(3, 0, [quote])]).result()
    assert allowed(masks.bits[0]) == {canonical} and masks.certain == frozenset()
    forced = matchers.forced_tokens(3)
    masks = matchers.start_masks([MaskRow(3, 0, forced[:1])]).result()
    assert masks.certain == frozenset({0})
    matchers.close()
