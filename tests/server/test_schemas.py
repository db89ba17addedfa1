"""The request schemas bound each sampling field as SamplingParams does (one table, BOUNDS in
pyserve/step/sampling_params.py): the same edges accepted, the values just past them refused by
both, over HTTP a 400 naming the field."""

from __future__ import annotations

import pytest

from pyserve import SamplingParams
from pyserve.server.body import validate
from pyserve.http.errors import BadRequest
from pyserve.server.schemas import ChatCompletionRequest, CompletionRequest
from pyserve.step.sampling_params import BOUNDS, LOGIT_BIAS, TOKEN_ID, Bounds

CHAT = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
COMPLETION = {"model": "m", "prompt": "x"}


def _cases():
    """(schema, body, the HTTP field, its SamplingParams field, its bounds, the lowest value the
    HTTP field takes)."""
    for name, b in BOUNDS.items():
        if name in ("logprobs", "prompt_logprobs"):  # chat's logprobs is a bool; prompt_logprobs is refused
            continue
        yield ChatCompletionRequest, CHAT, name, name, b, b.low
        yield CompletionRequest, COMPLETION, name, name, b, 0 if name == "max_tokens" else b.low  # 0: echo only
    yield ChatCompletionRequest, CHAT, "max_completion_tokens", "max_tokens", BOUNDS["max_tokens"], 1
    yield ChatCompletionRequest, CHAT | {"logprobs": True}, "top_logprobs", "logprobs", BOUNDS["logprobs"], 0
    yield CompletionRequest, COMPLETION, "logprobs", "logprobs", BOUNDS["logprobs"], 0


def _past(b: Bounds, value, up: bool):
    step = 1 if b.kind is int else max(abs(value), 1.0) * 1e-9
    return value + step if up else value - step


def _params(name: str, value) -> dict:
    return {name: value} | ({"max_tokens": None} if name == "min_tokens" else {})


@pytest.mark.parametrize("schema, body, field, name, b, low", list(_cases()),
                         ids=[f"{c[0].__name__}.{c[2]}" for c in _cases()])
def test_the_schema_and_sampling_params_take_the_same_values_of_each_field(schema, body, field, name, b, low):
    for value in [b.high] + ([] if b.low_open else [b.low]):
        validate(schema, body | {field: value})
        SamplingParams(**_params(name, value))
    too_high = _past(b, b.high, up=True)
    too_low = b.low if b.low_open else _past(b, b.low, up=False)
    for value in (too_high, too_low):
        with pytest.raises(ValueError, match=rf"^{name}\b"):
            SamplingParams(**_params(name, value))
    if low < b.low:  # a completion's max_tokens 0 (with echo: the engine is asked for one token)
        validate(schema, body | {field: low})
        too_low = _past(b, low, up=False)
    for value in (too_high, too_low):
        with pytest.raises(BadRequest) as e:
            validate(schema, body | {field: value})
        assert e.value.param == field


def test_token_ids_and_biases_are_bounded_alike():
    for value, ok in ((TOKEN_ID.low, True), (TOKEN_ID.high, True), (-1, False), (TOKEN_ID.high + 1, False)):
        body = COMPLETION | {"stop_token_ids": [value]}
        if ok:
            validate(CompletionRequest, body)
            SamplingParams(stop_token_ids=[value])
        else:
            with pytest.raises(BadRequest) as e:
                validate(CompletionRequest, body)
            assert e.value.param.startswith("stop_token_ids")
            with pytest.raises(ValueError, match=r"^stop_token_ids\b"):
                SamplingParams(stop_token_ids=[value])
    for value, ok in ((LOGIT_BIAS.low, True), (LOGIT_BIAS.high, True), (-100.5, False), (100.5, False)):
        if ok:
            validate(CompletionRequest, COMPLETION | {"logit_bias": {"5": value}})
            SamplingParams(logit_bias={5: value})
        else:
            with pytest.raises(BadRequest) as e:
                validate(CompletionRequest, COMPLETION | {"logit_bias": {"5": value}})
            assert e.value.param.startswith("logit_bias")
            with pytest.raises(ValueError, match=r"^logit_bias\b"):
                SamplingParams(logit_bias={5: value})
