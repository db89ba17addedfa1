"""SamplingParams validation: every out-of-range value is refused naming its field; the edges are
accepted and normalized."""

from __future__ import annotations

import pytest

from pyserve import SamplingParams
from pyserve.step.sampling_params import GREEDY_BELOW, is_greedy


@pytest.mark.parametrize("field, kwargs", [
    ("n", dict(n=0)),
    ("n", dict(n=129)),
    ("temperature", dict(temperature=-1)),
    ("temperature", dict(temperature=2.5)),  # OpenAI's range, as the HTTP schema's
    ("temperature", dict(temperature=float("nan"))),
    ("top_p", dict(top_p=0)),
    ("top_p", dict(top_p=1.5)),
    ("top_k", dict(top_k=-2)),
    ("min_p", dict(min_p=2)),
    ("max_tokens", dict(max_tokens=0)),
    ("min_tokens", dict(min_tokens=5, max_tokens=4)),
    ("min_tokens", dict(min_tokens=-1)),
    ("logprobs", dict(logprobs=21)),
    ("logprobs", dict(logprobs=-1)),
    ("presence_penalty", dict(presence_penalty=3)),
    ("frequency_penalty", dict(frequency_penalty=-3)),
    ("repetition_penalty", dict(repetition_penalty=0)),
    ("stop", dict(stop=[""])),
    ("stop", dict(stop=["ok", 3])),
    ("stop", dict(stop=5)),
    ("stop_token_ids", dict(stop_token_ids=7)),
    ("stop_token_ids", dict(stop_token_ids=[-1])),
    ("stop_token_ids", dict(stop_token_ids=[2**31])),
    ("seed", dict(seed=1.5)),
    ("ignore_eos", dict(ignore_eos="yes")),
    ("detokenize", dict(detokenize=1)),
    ("stop", dict(stop=["x"], detokenize=False)),
])
def test_sampling_params_rejects_out_of_range_value_naming_the_field(field, kwargs):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        SamplingParams(**kwargs)


def test_sampling_params_accepts_the_edges_and_normalizes():
    p = SamplingParams(n=128, temperature=0, top_p=1.0, top_k=-1, min_p=1.0, max_tokens=3, min_tokens=3,
                       logprobs=20, presence_penalty=-2, frequency_penalty=2, repetition_penalty=10, stop="x")
    assert p.stop == ["x"] and p.greedy
    assert SamplingParams(temperature=1e-7).temperature == 0.0
    assert SamplingParams(max_tokens=None, min_tokens=100).max_tokens is None


@pytest.mark.parametrize("temperature, greedy", [(0.0, True), (1e-6, True), (GREEDY_BELOW / 2, True),
                                                 (GREEDY_BELOW, False), (0.5, False)])
def test_greedy_has_one_definition(temperature, greedy):
    """is_greedy is what SamplingParams samples by (a greedy temperature becomes 0, the sampler's
    greedy rows); the semantic cache asks it too (tests/server/test_semantic_cache.py)."""
    p = SamplingParams(temperature=temperature)
    assert is_greedy(temperature) == p.greedy == (p.temperature == 0.0) == greedy


def test_vllms_older_guided_decoding_is_read_as_structured_outputs():
    older = SamplingParams(guided_decoding={"regex": "[0-9]+"})
    assert older.structured_outputs == SamplingParams(structured_outputs={"regex": "[0-9]+"}).structured_outputs
    assert older.structured_outputs.regex == "[0-9]+"
    with pytest.raises(ValueError, match="give one of them"):
        SamplingParams(guided_decoding={"regex": "a"}, structured_outputs={"regex": "b"})
