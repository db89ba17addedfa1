"""Each scorer on known answers, passing and failing, and the code sandbox's limits: a hanging
program is killed, a memory hog stops, the network and writes outside its folder are refused."""

from __future__ import annotations

import math
import time

import pytest

from pyserve.eval.code_sandbox import program_of, run_tests
from pyserve.eval.items import parse_item
from pyserve.eval.scorers import score_choice, score_perplexity, score_text


def item(**fields):
    return parse_item(__import__("json").dumps({"id": "t", "prompt": "p", **fields}), "test")


@pytest.mark.parametrize("fields, output, want", [
    ({"scorer": "exact", "reference": "42"}, " 42\n", 1.0),
    ({"scorer": "exact", "reference": "42"}, "42.0", 0.0),
    ({"scorer": "contains", "reference": "return a + b"}, "    return a + b\n", 1.0),
    ({"scorer": "contains", "reference": "return a + b"}, "return a - b", 0.0),
    ({"scorer": "regex", "pattern": r"^\s*def \w+\("}, "def go(x):", 1.0),
    ({"scorer": "regex", "pattern": r"^\s*def \w+\("}, "class Go:", 0.0),
    ({"scorer": "line_prefix", "reference": "x = f(a)"}, "\n\n    x = f(a)\n    return x", 1.0),
    ({"scorer": "line_prefix", "reference": "x = f(a)"}, "\n    x = g(a)", 0.5),
    ({"scorer": "line_prefix", "reference": "x = f(a)"}, "\n    y = f(a)\nx = f(a)", 0.0),
    ({"scorer": "line_prefix", "reference": "x = f(a)"}, "", 0.0),
    ({"scorer": "json_schema", "schema": {"type": "object", "required": ["a"]}}, '{"a": 1}', 1.0),
    ({"scorer": "json_schema", "schema": {"type": "object", "required": ["a"]}}, '{"b": 1}', 0.0),
    ({"scorer": "json_schema", "schema": {"type": "object"}}, "{not json", 0.0),
    ({"scorer": "numeric", "reference": 3.14159, "tolerance": 0.01}, "about 3.14 I think", 1.0),
    ({"scorer": "numeric", "reference": 3.14159, "tolerance": 0.001}, "3.13", 0.0),
    ({"scorer": "numeric", "reference": 1000, "relative": 0.05}, "-> 1040", 1.0),
    ({"scorer": "numeric", "reference": 1000, "relative": 0.05}, "no idea", 0.0),
    ({"scorer": "code", "tests": "assert add(2, 3) == 5"}, "```python\ndef add(a, b):\n    return a + b\n```", 1.0),
    ({"scorer": "code", "tests": "assert add(2, 3) == 5"}, "def add(a, b):\n    return a - b", 0.0),
    ({"scorer": "code", "tests": "assert add(2, 3) == 5", "with_prompt": True, "prompt": "def add(a, b):\n"},
     "    return a + b\n", 1.0),
])
def test_text_scorers_on_known_answers(fields, output, want):
    assert score_text(item(**fields), output).value == want


def test_choice_and_perplexity():
    choice = item(scorer="choice", choices=["a", "b", "c"], answer=1)
    assert score_choice(choice, [-3.0, -1.0, -2.0]).value == 1.0
    assert score_choice(choice, [-0.5, -1.0, -2.0]).value == 0.0
    assert score_choice(choice, [-1.0, -1.0, -2.0]).value == 0.0  # a tie goes to the lowest index
    with pytest.raises(ValueError, match="2 loglikelihoods for 3 choices"):
        score_choice(choice, [-1.0, -2.0])
    ppl = score_perplexity(item(scorer="perplexity", reference="x y"), [math.log(0.5), math.log(0.25)])
    assert ppl.value is None and ppl.tokens == 2 and math.isclose(ppl.nll, math.log(8))


def test_program_of_takes_the_first_fenced_block():
    assert program_of("intro\n```python\nx = 1\n```\nmore ```y```") == "x = 1\n"
    assert program_of("```\nx = 2\n```") == "x = 2\n"
    assert program_of("x = 3") == "x = 3"


@pytest.mark.parametrize("program, reason", [
    ("import socket\nsocket.create_connection(('127.0.0.1', 9))", "refused"),
    ("open('/tmp/pyserve-sandbox-escape.txt', 'w').write('x')", "refused"),
    ("import os\nos.system('true')", "refused"),
    ("import subprocess\nsubprocess.run(['true'])", "refused"),
    ("x = bytearray(1 << 31)", "memory"),
    ("raise SystemExit(3)", "failed"),
])
def test_the_sandbox_refuses_what_it_must(program, reason, tmp_path):
    result = run_tests(program, "", timeout_s=20, memory_mb=256)
    assert (result.passed, result.reason) == (False, reason), result.output


def test_the_sandbox_writes_inside_its_folder_and_kills_a_hang():
    assert run_tests("open('out.txt', 'w').write('ok')\nassert open('out.txt').read() == 'ok'", "").passed
    start = time.perf_counter()
    result = run_tests("import time\nwhile True:\n    time.sleep(0.01)", "", timeout_s=1.0)
    assert result.reason == "timeout" and time.perf_counter() - start < 5
