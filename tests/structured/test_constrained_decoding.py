"""Constrained decoding end to end on the embedded model: every output matches its constraint,
speculation changes no token, unconstrained neighbours are untouched, matchers are freed."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time

import jsonschema
import pytest

from pyserve import LLM, SamplingParams, StructuredOutputsParams
from pyserve.engine.output_processor import ConstraintFailed
from pyserve.structured.compiler import COMPILE_THREADS
from pyserve.structured.params import GrammarError
from pyserve.testing.json_schemas import SCHEMAS

PROMPTS = ["Answer in JSON: ", "def parse(x):", "The user said", "import os\n"]


@pytest.fixture(scope="module")
def llm():
    with LLM(max_num_seqs=64) as llm:
        yield llm


def _constrained(spec: StructuredOutputsParams, temperature: float = 0.0, seed: int | None = None, **kw):
    return SamplingParams(max_tokens=200, temperature=temperature, seed=seed, structured_outputs=spec, **kw)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_schema_of_the_corpus_is_matched(llm, temperature):
    assert len(SCHEMAS) >= 50
    params = [_constrained(StructuredOutputsParams(json=s), temperature, seed=i) for i, s in enumerate(SCHEMAS)]
    outs = llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(SCHEMAS))], params, use_tqdm=False)
    for schema, out in zip(SCHEMAS, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), schema)
    assert len(llm.engine.grammar_matchers) == 0  # every matcher freed with its request


def test_regex_choice_grammar_and_json_object(llm):
    specs = [
        StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,4}"),
        StructuredOutputsParams(choice=["yes", "no", "maybe so"]),
        StructuredOutputsParams(grammar='start: "SELECT " col (", " col)? " FROM t"\ncol: /[a-z]{1,6}/'),
        StructuredOutputsParams(grammar='root ::= "(" [0-9]+ ")"'),  # GBNF
        StructuredOutputsParams(json_object=True),
    ]
    outs = llm.generate(PROMPTS[:1] * len(specs), [_constrained(s, 1.0, n=4) for s in specs], use_tqdm=False)
    texts = [[c.text for c in o.outputs] for o in outs]
    assert all(re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t) for t in texts[0])
    assert all(t in ("yes", "no", "maybe so") for t in texts[1])
    assert all(re.fullmatch(r"SELECT [a-z]{1,6}(, [a-z]{1,6})? FROM t", t) for t in texts[2])
    for t, c in zip(texts[3], outs[3].outputs):  # unbounded digits: a sample may end at max_tokens
        assert re.fullmatch(r"\([0-9]+\)" if c.finish_reason == "stop" else r"\([0-9]*", t), (c.finish_reason, t)
    for t, c in zip(texts[4], outs[4].outputs):
        if c.finish_reason == "stop":
            assert isinstance(json.loads(t), dict)


def test_unconstrained_requests_in_the_batch_get_their_own_tokens(llm):
    plain = SamplingParams(max_tokens=24, temperature=0.0)
    alone = llm.generate(PROMPTS, plain, use_tqdm=False)
    constrained = [_constrained(StructuredOutputsParams(json=SCHEMAS[i])) for i in range(len(PROMPTS))]
    mixed = llm.generate(PROMPTS * 2, [plain] * len(PROMPTS) + constrained, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[: len(PROMPTS)]] == [o.outputs[0].token_ids for o in alone]


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 4},
                                  {"method": "draft_model", "num_speculative_tokens": 4, "adaptive": False},
                                  {"method": "draft_model", "num_speculative_tokens": 4}])
def test_speculation_changes_no_token_of_a_constrained_request(llm, spec):
    schemas = SCHEMAS[:8]
    params = [_constrained(StructuredOutputsParams(json=s), t, seed=i) for i, s in enumerate(schemas) for t in (0.0, 0.9)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    plain = llm.generate(prompts, params, use_tqdm=False)
    with LLM(max_num_seqs=64, speculative_config=spec) as spec_llm:
        fast = spec_llm.generate(prompts, params, use_tqdm=False)
        stats = spec_llm.stats()
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in plain]
    assert stats["spec_decode_num_accepted_tokens"] > 0.5 * stats["spec_decode_num_draft_tokens"] > 0


def test_forced_tokens_are_verified_in_one_step_and_change_nothing(llm):
    params = [_constrained(StructuredOutputsParams(json=s), t, seed=i) for i, s in enumerate(SCHEMAS[:12])
              for t in (0.0, 0.9)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    before = llm.stats()
    forced = llm.generate(prompts, params, use_tqdm=False)
    after = llm.stats()
    with LLM(max_num_seqs=64, grammar_forced_tokens=False) as slow:
        one_by_one = slow.generate(prompts, params, use_tqdm=False)
        assert slow.stats()["grammar_forced_tokens"] == 0
    assert [o.outputs[0].token_ids for o in forced] == [o.outputs[0].token_ids for o in one_by_one]
    num_tokens = sum(len(o.outputs[0].token_ids) for o in forced)
    # Keys, braces and separators are most of a JSON output's tokens here.
    assert after["grammar_forced_tokens"] - before["grammar_forced_tokens"] > 0.3 * num_tokens


def test_a_constraint_that_does_not_compile_is_refused_and_the_engine_serves_on(llm):
    with pytest.raises(GrammarError, match="invalid regex"):
        llm.generate("x", _constrained(StructuredOutputsParams(regex="(a")), use_tqdm=False)
    with pytest.raises(GrammarError, match="structured_outputs: give exactly one"):
        SamplingParams(structured_outputs={"json": {}, "regex": "a"})
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs={"regex": "a+"})
    out = llm.generate("x", _constrained(StructuredOutputsParams(regex="ab?c")), use_tqdm=False)
    assert out[0].outputs[0].text in ("ac", "abc")


def test_a_constraint_the_matcher_cannot_follow_fails_its_request_alone(llm):
    prompts = ["x", "y"]
    params = [_constrained(StructuredOutputsParams(regex="a{1000000}")), _constrained(StructuredOutputsParams(regex="ab?c"))]
    with pytest.raises(ConstraintFailed, match="too many expressions"):
        llm.generate(prompts, params, use_tqdm=False)
    out = llm.generate("y", params[1], use_tqdm=False)
    assert out[0].outputs[0].text in ("ac", "abc")
    assert len(llm.engine.grammar_matchers) == 0 and llm.engine.stats()["num_requests_running"] == 0


def test_slow_compiles_keep_to_their_own_threads(llm, monkeypatch):
    """Thirty compiles that would each take 5 s: all answer a timeout error after
    GRAMMAR_COMPILE_TIMEOUT, while work on asyncio's default pool (embeddings, cache lookups,
    LoRA loads) runs at once."""
    engine, started, release = llm.engine, [], threading.Event()

    def slow_compile(spec):
        started.append(spec)
        release.wait(5)
        raise GrammarError("never")

    monkeypatch.setattr(engine.grammar_compiler, "compile", slow_compile)

    async def run():
        compiles = [asyncio.ensure_future(engine.compile_grammar(StructuredOutputsParams(regex=f"a{{{i}}}")))
                    for i in range(30)]
        waits = []
        for _ in range(10):
            start = time.perf_counter()
            await asyncio.to_thread(lambda: None)
            waits.append(time.perf_counter() - start)
            await asyncio.sleep(0.05)
        return waits, await asyncio.gather(*compiles, return_exceptions=True)

    start = time.perf_counter()
    try:
        waits, results = llm._loop.run_until_complete(run())
    finally:
        release.set()  # the two started compiles end: the next test's compiles find the threads free
    assert max(waits) < 0.2, waits
    assert all(isinstance(r, GrammarError) and "did not compile within" in str(r) for r in results)
    assert time.perf_counter() - start < 2.5
    assert len(started) == COMPILE_THREADS  # the other 28 gave their places up unstarted


def test_aborted_constrained_requests_free_their_matchers(llm):
    engine = llm.engine

    async def run():
        spec = StructuredOutputsParams(regex="[a-z]{1000}")  # far longer than max_tokens allows
        for i in range(3):
            await engine.add_request(f"abort-{i}", [5, 6, 7], SamplingParams(max_tokens=500, structured_outputs=spec))
        await asyncio.sleep(0.05)
        for i in range(3):
            await engine.abort(f"abort-{i}")
        await engine.wait_idle()

    llm._loop.run_until_complete(run())
    assert len(engine.grammar_matchers) == 0
