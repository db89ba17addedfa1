"""Routes and cascades through the openai client: a router's choice by the request's embedding, a
cascade kept or escalated by the small model's token logprobs (streamed too), the answering
model named in `model` and a header, the answers those of the models asked directly; routes in
/v1/models, bad routes refused. The classifier's training: tests/model_choice/test_train.py."""

from __future__ import annotations

import openai
import pytest

from pyserve.embeddings.encoder import embed_texts
from pyserve.embeddings.packaged import NAME as ENCODER, PackagedEncoder
from pyserve.model_choice.classifier import RouteClassifier
from pyserve.server.completion_result import choice_tokens
from pyserve.server.decision import confidence
from pyserve.testing import parse_metrics
from pyserve.testing.in_process import serving_models

SORTING = "how do I sort a list of numbers"
OTHER = "the history of medieval castles in France"


@pytest.fixture(scope="module")
def router_file(tmp_path_factory) -> str:
    """A router that sends text like SORTING to the large model and the rest to the small."""
    direction = embed_texts(PackagedEncoder(), [SORTING])[0]
    path = tmp_path_factory.mktemp("router") / "router.json"
    RouteClassifier("small", "large", ENCODER, [float(w) * 40 for w in direction], -30.0, 0.5, 0.5).save(path)
    return str(path)


def _models(model_dirs):
    return {"small": {"model": str(model_dirs["qwen2"]), "block_size": 4, "num_kv_blocks": 64},
            "large": {"model": str(model_dirs["llama"]), "block_size": 4, "num_kv_blocks": 64}}


async def _chat(http, model: str, text: str, **kw):
    api = openai.AsyncOpenAI(base_url="http://t/v1", api_key="none", http_client=http, max_retries=0)
    r = await api.chat.completions.with_raw_response.create(
        **({"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 6, "temperature": 0} | kw))
    return r.headers, r.parse()


async def test_a_route_sends_each_request_to_the_model_its_router_picks(model_dirs, router_file):
    async with serving_models(_models(model_dirs), route=[f"auto={router_file}"]) as (_, http):
        cards = {c["id"]: c for c in (await http.get("/v1/models")).json()["data"]}
        assert cards["auto"]["pyserve_route"] == {"kind": "route", "small": "small", "large": "large"}
        for text, want in ((SORTING, "large"), (OTHER, "small")):
            headers, routed = await _chat(http, "auto", text)
            _, direct = await _chat(http, want, text)
            assert routed.model == headers["x-pyserve-model"] == want
            assert routed.choices[0].message.content == direct.choices[0].message.content
        r = await http.post("/v1/completions", json={"model": "auto", "prompt": SORTING, "max_tokens": 3})
        assert r.json()["model"] == "large"
        r = await http.post("/v1/completions", json={"model": "auto", "prompt": [SORTING, OTHER], "max_tokens": 3})
        assert (r.status_code, r.json()["error"]["param"]) == (400, "prompt")
        metrics = parse_metrics((await http.get("/metrics")).text)
        assert metrics['pyserve:route_requests_total{model="large",route="auto"}'] == 2
        assert metrics['pyserve:route_requests_total{model="small",route="auto"}'] == 1
        stats = (await http.get("/v1/stats")).json()
        assert stats["routes"]["auto"] == {"kind": "route", "small": "small", "large": "large",
                                           "requests": {"small": 1, "large": 2}, "escalations": 0,
                                           "large_share": 2 / 3}
        assert set(stats["models"]) == {"small", "large"}
        assert stats["models"]["large"]["generation_tokens"] > 0 and stats["semantic_cache"] is None


async def test_a_cascade_keeps_a_confident_small_answer_and_escalates_the_rest(model_dirs):
    cascades = ["keep=small,large,-1e9", "escalate=small,large,1"]  # logprobs never fall below -1e9 nor reach 1
    async with serving_models(_models(model_dirs), cascade=cascades) as (_, http):
        _, small = await _chat(http, "small", OTHER)
        _, large = await _chat(http, "large", OTHER)
        headers, kept = await _chat(http, "keep", OTHER)
        assert (kept.model, headers["x-pyserve-escalated"]) == ("small", "no")
        assert headers["x-pyserve-request-id"] == kept.id  # the small model's request, as logged
        assert kept.choices[0].message.content == small.choices[0].message.content
        assert kept.choices[0].logprobs is None  # asked for internally, not by the client
        headers, up = await _chat(http, "escalate", OTHER)
        assert (up.model, headers["x-pyserve-escalated"], headers["x-pyserve-model"]) == ("large", "yes", "large")
        assert headers["x-pyserve-request-id"] == up.id
        assert (headers["x-pyserve-small-prompt-tokens"], headers["x-pyserve-small-completion-tokens"]) == (
            str(small.usage.prompt_tokens), str(small.usage.completion_tokens))
        assert up.usage.completion_tokens == large.usage.completion_tokens
        assert up.choices[0].message.content == large.choices[0].message.content
        for name, want in (("keep", small), ("escalate", large)):
            api = openai.AsyncOpenAI(base_url="http://t/v1", api_key="none", http_client=http, max_retries=0)
            stream = await api.chat.completions.create(model=name, messages=[{"role": "user", "content": OTHER}],
                                                       max_tokens=6, temperature=0, stream=True)
            chunks = [c async for c in stream]
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
                want.choices[0].message.content
        metrics = parse_metrics((await http.get("/metrics")).text)
        assert metrics['pyserve:cascade_escalations_total{route="escalate"}'] == 2
        assert 'pyserve:cascade_escalations_total{route="keep"}' not in metrics
        routes = (await http.get("/v1/stats")).json()["routes"]
        assert (routes["escalate"]["escalations"], routes["escalate"]["requests"]) == (2, {"small": 0, "large": 2})
        assert (routes["keep"]["escalations"], routes["keep"]["large_share"]) == (0, 0.0)
        assert routes["keep"]["kind"] == "cascade"


def _text_body(tokens: list[str], logprobs: list[float | None]) -> dict:
    return {"choices": [{"text": "".join(tokens), "logprobs": {"tokens": tokens, "token_logprobs": logprobs}}]}


@pytest.mark.parametrize("tokens, logprobs, want", [
    # leading line breaks and indent, then the line up to the token that ends it; the rest ignored
    (["\n   ", " return", " x", "\n\n", " def", " f"], [-1.0, -2.0, -3.0, -4.0, -9.0, -9.0], -2.5),
    (["a", "b\n", "c"], [-1.0, -3.0, -9.0], -2.0),  # a token with text before its line break ends the line
    (["\nx", "y"], [-1.0, -2.0], -1.5),  # the break before the text does not: one line, all of it
    (["a", "b"], [None, -2.0], -2.0),  # no logprob for a token: left out
    ([], [], float("-inf")),
    # a fenced answer: the block's tokens (a token starting inside it counts), not the fence lines
    (["``", "`python\n", "def", " f", "():\n", "  x", "\n", "```", "\nmore"],
     [0.0, 0.0, -1.0, -2.0, -3.0, -6.0, -8.0, -9.0, -9.0], -4.0),
    (["\n```\n", "a", "b"], [0.0, -1.0, -2.0], -1.5),  # no closing fence: the rest
    (["```py"], [-0.5], -0.5),  # a fence line and nothing after it: that line
])
def test_a_cascade_is_as_confident_as_the_mean_logprob_of_its_answers_first_line_or_code_block(tokens, logprobs,
                                                                                                 want):
    assert confidence(choice_tokens(_text_body(tokens, logprobs)["choices"][0])) == want
    chat = {"choices": [{"message": {}, "logprobs": {"content": [{"token": t, "logprob": v}
                                                               for t, v in zip(tokens, logprobs)]}}]}
    assert confidence(choice_tokens(chat["choices"][0])) == want


async def test_the_responses_api_serves_a_cascade_as_chat_does(model_dirs):
    """/v1/responses naming a cascade: the kept small answer or the escalated large one, streamed
    or not, as /v1/chat/completions gives it, with its headers."""
    async with serving_models(_models(model_dirs), cascade=["keep=small,large,-1e9", "escalate=small,large,1"]) \
            as (_, http):
        api = openai.AsyncOpenAI(base_url="http://t/v1", api_key="none", http_client=http, max_retries=0)
        for name, answerer in (("keep", "small"), ("escalate", "large")):
            _, chat = await _chat(http, name, OTHER)
            raw = await api.responses.with_raw_response.create(model=name, input=OTHER, max_output_tokens=6,
                                                               temperature=0, store=False)
            r = raw.parse()
            assert (r.model, raw.headers["x-pyserve-model"]) == (answerer, answerer)
            assert r.output_text == chat.choices[0].message.content
            assert r.usage.output_tokens == chat.usage.completion_tokens
            stream = await api.responses.create(model=name, input=OTHER, max_output_tokens=6, temperature=0,
                                                store=False, stream=True)
            text = "".join([e.delta async for e in stream if e.type == "response.output_text.delta"])
            assert text == r.output_text


async def test_a_route_policy_takes_the_place_of_the_answering_models(model_dirs):
    """The cascade's own output cap and limit hold for its requests; the model asked by name keeps
    its own (none here)."""
    async with serving_models(_models(model_dirs), cascade=["keep=small,large,-1e9", "escalate=small,large,1"],
                              route_policy=["keep=default_max_tokens:2,max_tokens_limit:3",
                                            "escalate=default_max_tokens:4"]) as (_, http):
        async def ask(model, **body):
            return await http.post("/v1/chat/completions", json={
                "model": model, "messages": [{"role": "user", "content": "hi"}], "temperature": 0,
                "ignore_eos": True, **body})

        for model, want in (("keep", 2), ("escalate", 4)):
            r = await ask(model)
            assert r.json()["usage"]["completion_tokens"] == want, r.text
        r = await ask("keep", max_tokens=4)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
        r = await ask("small", max_tokens=8)
        assert r.json()["usage"]["completion_tokens"] == 8


@pytest.mark.parametrize("settings, message", [
    ({"cascade": ["c=small,large,-1"], "route_policy": ["d=concise:true"]}, "no --route or --cascade is named 'd'"),
    ({"cascade": ["c=small,large,-1"], "route_policy": ["c=colour:red"]}, "use NAME=KEY:VALUE"),
    ({"cascade": ["c=small,large,-1"], "route_policy": ["c=max_prompt_tokens:0"]}, "max_prompt_tokens must be"),
    ({"cascade": ["c=small,nope,-1"]}, "route 'c': model 'nope' is not served"),
    ({"cascade": ["small=small,large,-1"]}, "route 'small': the name is already a served model"),
    ({"cascade": ["c=small,large"]}, "use NAME=SMALL,LARGE,MIN_LOGPROB"),
    ({"cascade": ["c=small,large,-1", "c=small,large,-2"]}, "route 'c' is given twice"),
])
async def test_bad_routes_are_refused_naming_them(model_dirs, settings, message):
    with pytest.raises(ValueError, match=message):
        async with serving_models(_models(model_dirs), **settings):
            pass
