"""Structured outputs over HTTP, through the official client: response_format (json_schema with
`chat.completions.parse`, json_object), vLLM's structured_outputs and guided_* fields, streamed
and not, with speculation on and off; bad constraints are 400s naming the field."""

from __future__ import annotations

import json
import re
import threading
import time
from typing import Annotated

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field, StringConstraints

from pyserve.testing import start_server, stop_server
from pyserve.testing.json_schemas import SCHEMAS
from pyserve.testing.metrics import parse_metrics


@pytest.fixture(scope="module", params=["plain", "ngram"])
def server(request, tmp_path_factory):
    flags = ["--served-model-name", "tiny"]
    if request.param == "ngram":
        flags += ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}']
    proc, base = start_server(None, *flags, workdir=tmp_path_factory.mktemp("so"))
    yield base
    stop_server(proc)


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0)


def _chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_response_format_json_schema_over_the_corpus_streamed_and_not(client):
    for i, schema in enumerate(SCHEMAS):
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}
        kw = dict(model="tiny", messages=_chat("Reply in JSON."), max_tokens=200, temperature=0.7, seed=i,
                  response_format=fmt)
        if i % 2:
            chunks = list(client.chat.completions.create(**kw, stream=True))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            assert finish == ["stop"], text
        else:
            r = client.chat.completions.create(**kw)
            text = r.choices[0].message.content
            assert r.choices[0].finish_reason == "stop", text
        jsonschema.validate(json.loads(text), schema)


class Person(BaseModel):
    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=99)
    likes: list[Annotated[str, StringConstraints(max_length=8)]] = Field(max_length=2)


def test_parse_with_a_pydantic_model(client):
    for seed in range(3):
        r = client.chat.completions.parse(model="tiny", messages=_chat("Who are you?"), response_format=Person,
                                          max_tokens=150, temperature=1.0, seed=seed)
        person = r.choices[0].message.parsed
        assert isinstance(person, Person) and 0 <= person.age <= 99


def test_strict_closes_every_object_to_the_properties_it_names(client):
    """OpenAI's strict mode: no key beyond those a schema names, even where the schema leaves
    additionalProperties open (a probe saw {"a": false, "bbbb... run on to max_tokens)."""
    inner = {"type": "object", "properties": {"b": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["b"]}
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}, "n": {"$ref": "#/$defs/inner"}},
              "required": ["a", "n"], "$defs": {"inner": inner}}
    closed = {**schema, "additionalProperties": False,
              "$defs": {"inner": {**inner, "additionalProperties": False}}}
    for seed in range(4):
        r = client.chat.completions.create(
            model="tiny", messages=_chat("Answer in JSON."), max_tokens=60, temperature=1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}})
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), closed)


def test_top_logprobs_leave_out_the_tokens_a_grammar_masked(client):
    r = client.completions.create(model="tiny", prompt="Pick a colour:", max_tokens=4, temperature=0, logprobs=5,
                                  extra_body={"structured_outputs": {"choice": ["red", "green"]}})
    lp = r.choices[0].logprobs
    assert r.choices[0].text in ("red", "green")
    assert all(top[token] == value and all(v > -1e30 for v in top.values())
               for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs))
    assert min(len(top) for top in lp.top_logprobs) < 5  # a forced step has fewer than 5 choices


def test_json_object_and_the_completions_endpoint(client):
    r = client.chat.completions.create(model="tiny", messages=_chat("JSON please"), max_tokens=100,
                                       temperature=0, response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    schema = SCHEMAS[1]
    c = client.completions.create(model="tiny", prompt="{", max_tokens=100, temperature=0.5, seed=1,
                                  extra_body={"response_format": {"type": "json_schema",
                                                                  "json_schema": {"name": "p", "schema": schema}}})
    jsonschema.validate(json.loads(c.choices[0].text), schema)


@pytest.mark.parametrize("body, check", [
    ({"structured_outputs": {"regex": "[A-Z]{2}[0-9]{3}"}}, lambda t: re.fullmatch("[A-Z]{2}[0-9]{3}", t)),
    ({"structured_outputs": {"choice": ["left", "right"]}}, lambda t: t in ("left", "right")),
    ({"structured_outputs": {"grammar": 'start: "(" /[0-9]{1,3}/ (" + " /[0-9]{1,3}/)? ")"'}},
     lambda t: re.fullmatch(r"\([0-9]{1,3}( \+ [0-9]{1,3})?\)", t)),
    ({"structured_outputs": {"json": SCHEMAS[6]}}, lambda t: jsonschema.validate(json.loads(t), SCHEMAS[6]) is None),
    ({"guided_regex": "(yes|no)!"}, lambda t: t in ("yes!", "no!")),
    ({"guided_choice": ["a1", "b2"]}, lambda t: t in ("a1", "b2")),
    ({"guided_json": SCHEMAS[2], "guided_decoding_backend": "auto"}, lambda t: json.loads(t)["ok"] in (True, False)),
])
def test_vllm_fields_on_both_endpoints(client, body, check):
    for n in range(2):
        chat = client.chat.completions.create(model="tiny", messages=_chat("go"), max_tokens=60, temperature=1.0,
                                              seed=n, extra_body=body, n=2)
        for choice in chat.choices:
            assert check(choice.message.content), choice.message.content
        text = client.completions.create(model="tiny", prompt="go", max_tokens=60, temperature=1.0, seed=n,
                                         extra_body=body).choices[0].text
        assert check(text), text


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_object", "extra": 1}}, "response_format.extra"),
    ({"structured_outputs": {"regex": "(a"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"grammar": "start: nope"}}, "structured_outputs"),
    ({"guided_json": {"$ref": "#/$defs/none"}}, "guided_json"),
    ({"guided_regex": "a", "structured_outputs": {"regex": "b"}}, "guided_regex"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ({"structured_outputs": {"json": {"enum": list(range(2000))}}}, "structured_outputs"),
    ({"structured_outputs": {"json": json.loads("[" * 0 + '{"type": "object", "properties": {"a": ' * 12 + "{}"
                                                + "}}" * 12)}}, "structured_outputs"),
])
def test_bad_constraints_are_400s_naming_the_field(server, body, param):
    start = time.perf_counter()
    r = httpx.post(server + "/v1/chat/completions", json={"model": "tiny", "messages": _chat("x"), **body}, timeout=10)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert time.perf_counter() - start < 1.0


def test_a_request_refused_as_its_engine_requests_are_added_has_an_outcome(server):
    """Counted in requests_total when its engine requests were being added, a request the engine
    refuses (a grammar that does not compile) is counted among the outcomes too."""
    def totals():
        metrics = parse_metrics(httpx.get(server + "/metrics").text)
        return {name: sum(v for k, v in metrics.items() if k.startswith(name)) for name in
                ("pyserve:requests_total", "pyserve:request_outcomes_total",
                 'pyserve:request_outcomes_total{model="tiny",outcome="refused"}')}

    before = totals()
    r = httpx.post(server + "/v1/chat/completions", json={"model": "tiny", "messages": _chat("x"),
                                                          "structured_outputs": {"grammar": "start: nope"}}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs"
    after = totals()
    assert [after[k] - before[k] for k in before] == [1, 1, 1]


@pytest.mark.parametrize("body", [{"structured_outputs": {"regex": "a{1000000}"}},
                                  {"structured_outputs": {"regex": "(a?){500}a{500}"}}])
def test_a_constraint_the_matcher_cannot_follow_fails_the_request(server, client, body):
    """llguidance's lexer gives up on these after the first token: never a 200 with "stop"."""
    request = {"model": "tiny", "messages": _chat("x"), "max_tokens": 16, **body}
    r = httpx.post(server + "/v1/chat/completions", json=request, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "constraint_failed" and "too many expressions" in r.json()["error"]["message"]
    with httpx.stream("POST", server + "/v1/chat/completions", json={**request, "stream": True}, timeout=30) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and json.loads(events[-2][6:])["error"]["code"] == "constraint_failed", events[-2:]
    assert not any('"finish_reason":"stop"' in e for e in events)
    ok = client.completions.create(model="tiny", prompt="def f():", max_tokens=4, temperature=0)  # serves on
    assert len(ok.choices[0].text) > 0


def test_hostile_constraints_do_not_stall_other_clients(server, client):
    hostile = [{"structured_outputs": {"regex": "(a*)*(b|c)*" * 50}},
               {"structured_outputs": {"json": {"oneOf": [{"oneOf": [{"type": "integer"}, {"type": "string"}] * 40}] * 40}}},
               {"structured_outputs": {"json": {"$defs": {"n": {"anyOf": [{"type": "null"}, {"type": "array", "items": {"$ref": "#/$defs/n"}}]}},
                                                "$ref": "#/$defs/n"}}}]
    statuses = []

    def attack():
        for body in hostile * 3:
            r = httpx.post(server + "/v1/chat/completions", timeout=30,
                           json={"model": "tiny", "messages": _chat("x"), "max_tokens": 8, **body})
            statuses.append(r.status_code)

    thread = threading.Thread(target=attack)
    thread.start()
    gaps = []
    while thread.is_alive():
        start = time.perf_counter()
        r = client.completions.create(model="tiny", prompt="def f():", max_tokens=4, temperature=0)
        gaps.append(time.perf_counter() - start)
        assert r.choices[0].text is not None
    thread.join()
    assert set(statuses) <= {200, 400} and len(statuses) == 9
    assert max(gaps, default=0) < 2.0, gaps
