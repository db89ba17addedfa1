"""Constrained requests beside the engine's other features: logprobs, stop strings, prefix
caching, LoRA adapters in the same batch, and preemption."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pyserve import LLM, LoRARequest, SamplingParams, StructuredOutputsParams
from pyserve.default_model import ADAPTER_DIRS
from pyserve.model.token_masks import BANNED
from pyserve.testing.json_schemas import SCHEMAS


def _json(i: int, **kw) -> SamplingParams:
    kw.setdefault("temperature", 0.8)
    kw.setdefault("max_tokens", 200)
    return SamplingParams(seed=i, structured_outputs=StructuredOutputsParams(json=SCHEMAS[i]), **kw)


def _valid(out, i: int) -> None:
    c = out.outputs[0]
    assert c.finish_reason == "stop", c.text
    jsonschema.validate(json.loads(c.text), SCHEMAS[i])


@pytest.fixture(scope="module")
def llm():
    with LLM(enable_lora=True, max_loras=2, max_lora_rank=16) as llm:
        yield llm


def test_logprobs_are_of_the_masked_distribution(llm):
    out = llm.generate("Answer: ", _json(1, logprobs=3), use_tqdm=False)[0]
    _valid(out, 1)
    c = out.outputs[0]
    assert len(c.logprobs) == len(c.token_ids)
    for tid, entry in zip(c.token_ids, c.logprobs):
        assert entry[tid].logprob > BANNED / 2  # the sampled token was allowed
        assert entry[tid].logprob <= 0.0


def test_stop_strings_end_a_constrained_output(llm):
    out = llm.generate("Answer: ", _json(1, stop=[", "]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and ", " not in out.text
    assert out.text.startswith('{"name": "')


def test_prefix_caching_serves_a_repeated_constrained_request_alike(llm):
    params = _json(5, temperature=0.0)
    prompt = "Rate the answer below from 1 to 5 and add a short comment, as JSON. " * 4
    first = llm.generate(prompt, params, use_tqdm=False)[0]
    again = llm.generate(prompt, params, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == first.outputs[0].token_ids
    _valid(again, 5)


def test_lora_adapters_and_constraints_in_one_batch(llm):
    loras = [LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(sorted(ADAPTER_DIRS.items()))]
    n = 12
    outs = llm.generate(["def area(r):"] * n, [_json(i) for i in range(n)],
                        lora_request=[loras[i % 2] if i % 3 else None for i in range(n)], use_tqdm=False)
    for i, out in enumerate(outs):
        _valid(out, i)


def test_preempted_constrained_requests_resume_their_grammar():
    # 40 blocks of 4 tokens hold two or three of these requests at their full length, not 16.
    # Fixed prompt chunks (no latency-driven budget): on a slow machine a measured budget admits
    # the prompts a few at a time, and those can finish before the cache runs out.
    with LLM(num_kv_blocks=40, block_size=4, max_num_seqs=16, enable_prefix_caching=False,
             max_inter_token_latency=0) as small:
        n = 16
        outs = small.generate([f"Reply with JSON number {i}." for i in range(n)],
                              [_json(i, max_tokens=80) for i in range(n)], use_tqdm=False)
        assert small.stats()["num_preemptions"] > 0
        assert len(small.engine.grammar_matchers) == 0
    for i, out in enumerate(outs):
        _valid(out, i)
