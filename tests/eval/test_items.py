"""The eval set's format: every scorer's item parses, and a malformed line is refused naming the
file's line and the field before anything runs."""

from __future__ import annotations

import json

import pytest

from pyserve.eval.items import ChoiceItem, CodeItem, EvalSetError, JsonSchemaItem, load_eval_set

GOOD = [
    {"id": "a", "prompt": "2+2=", "scorer": "exact", "reference": "4"},
    {"id": "b", "messages": [{"role": "user", "content": "hi"}], "scorer": "contains", "reference": "hello"},
    {"id": "c", "prompt": "x", "scorer": "regex", "pattern": r"\d+"},
    {"id": "d", "prompt": "x", "scorer": "json_schema", "schema": {"type": "object"}},
    {"id": "e", "prompt": "pi=", "scorer": "numeric", "reference": 3.14159, "tolerance": 0.01},
    {"id": "f", "prompt": "import", "scorer": "choice", "choices": [" os", " sys"], "answer": 1},
    {"id": "g", "prompt": "def f(x):\n", "scorer": "code", "tests": "assert f(1) == 2", "with_prompt": True},
    {"id": "h", "prompt": "text:", "scorer": "perplexity", "reference": " hello world"},
]


def write(tmp_path, rows) -> object:
    path = tmp_path / "eval.jsonl"
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_every_scorer_parses(tmp_path):
    items = load_eval_set(write(tmp_path, GOOD[:4] + [""] + GOOD[4:]))
    assert [i.id for i in items] == list("abcdefgh")
    assert isinstance(items[3], JsonSchemaItem) and items[3].schema_ == {"type": "object"}
    assert isinstance(items[5], ChoiceItem) and not items[5].generates and items[0].generates
    assert isinstance(items[6], CodeItem) and items[6].timeout_s == 10.0 and items[6].with_prompt


@pytest.mark.parametrize("row, message", [
    ('{"id": "x", "prompt": ', r"eval\.jsonl line 2: not valid JSON"),
    ({"id": "x", "prompt": "p"}, r"line 2: scorer: missing"),
    ({"id": "x", "prompt": "p", "scorer": "bleu"}, r"line 2: scorer: 'bleu' is not one of"),
    ({"id": "x", "scorer": "exact", "reference": "r"}, r"line 2: give exactly one of prompt and messages"),
    ({"id": "x", "prompt": "p", "scorer": "exact"}, r"line 2: reference: Field required"),
    ({"id": "x", "prompt": "p", "scorer": "regex", "pattern": "(a"}, r"line 2: pattern: not a valid regular expression"),
    ({"id": "x", "prompt": "p", "scorer": "line_prefix", "reference": "a\nb"}, r"line 2: reference: .*must be one non-blank line"),
    ({"id": "x", "prompt": "p", "scorer": "json_schema", "schema": {"type": "nope"}}, r"line 2: schema: not a valid JSON schema"),
    ({"id": "x", "prompt": "p", "scorer": "choice", "choices": ["a", "b"], "answer": 2}, r"line 2: answer 2 is not an index"),
    ({"id": "x", "prompt": "p", "scorer": "code", "tests": "assert 1", "timeout_s": 0}, r"line 2: timeout_s: Input should be greater than 0"),
    ({"id": "x", "prompt": "p", "scorer": "exact", "reference": "r", "temperature": 1}, r"line 2: temperature: Extra inputs"),
    ({"id": "a", "prompt": "p", "scorer": "exact", "reference": "r"}, r"line 2: id: 'a' is already the id of line 1"),
])
def test_a_malformed_line_names_the_line_and_the_field(tmp_path, row, message):
    with pytest.raises(EvalSetError, match=message):
        load_eval_set(write(tmp_path, [GOOD[0], row]))


def test_an_empty_set_is_refused(tmp_path):
    with pytest.raises(EvalSetError, match="no items"):
        load_eval_set(write(tmp_path, [""]))
