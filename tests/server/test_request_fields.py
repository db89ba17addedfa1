"""Every request field is served, accepted as having no effect, or refused with a 400 naming it:
a walk through the OpenAI fields and vLLM's extras, and the effect of each served extra."""

from __future__ import annotations

import httpx
import openai
import pytest

from pyserve.default_model import TARGET_DIR
from pyserve.model.tokenizer import Tokenizer
from pyserve.server.schemas import NO_EFFECT_FIELDS, REFUSED_FIELDS
from pyserve.testing import start_server, stop_server

# A value of each refused field that is not its "off" value.
REFUSED_VALUES = {
    "suffix": "tail", "prompt_logprobs": 1, "use_beam_search": True, "length_penalty": 0.5,
    "allowed_token_ids": [5, 6], "bad_words": ["x"], "logits_processors": ["m.f"],
    "spaces_between_special_tokens": False, "return_tokens_as_token_ids": True,
    "prediction": {"type": "content", "content": "x"}, "audio": {"voice": "alloy"}, "modalities": ["audio"],
    "web_search_options": {}, "reasoning_effort": "high", "verbosity": "low", "guided_whitespace_pattern": " ",
    "documents": [{"text": "x"}], "mm_processor_kwargs": {"a": 1},
    "add_special_tokens": True, "kv_transfer_params": {}, "vllm_xargs": {"a": 1}, "structural_tag": "{}",
}
NO_EFFECT_VALUES = {"user": "u1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
                    "prompt_cache_key": "k", "safety_identifier": "s", "request_id": "r1"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc, base = start_server(None, "--served-model-name", "tiny", workdir=tmp_path_factory.mktemp("fields"))
    yield base
    stop_server(proc)


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(TARGET_DIR)


def _post(server, endpoint, **body):
    base = {"model": "tiny", "max_tokens": 4}
    base.update({"messages": [{"role": "user", "content": "hi"}]} if endpoint == "chat" else {"prompt": "hi"})
    base.update(body)
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    return httpx.post(server + path, json=base, timeout=30)


def test_the_lists_cover_every_field_value_of_this_test():
    assert set(REFUSED_VALUES) == set(REFUSED_FIELDS) and set(NO_EFFECT_VALUES) == set(NO_EFFECT_FIELDS)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_refused_fields_are_400s_naming_them_and_their_off_values_pass(server, endpoint):
    for field, value in REFUSED_VALUES.items():
        r = _post(server, endpoint, **{field: value})
        assert r.status_code == 400, (field, r.text)
        assert r.json()["error"]["param"] == field
        for off in REFUSED_FIELDS[field]:
            assert _post(server, endpoint, **{field: off}).status_code == 200, (field, off)
    r = _post(server, endpoint, frobnicate=1)
    assert r.status_code == 400 and r.json()["error"]["param"] == "frobnicate"
    assert "unknown field" in r.json()["error"]["message"]


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_fields_without_effect_are_accepted_and_change_nothing(server, endpoint):
    plain = _post(server, endpoint, temperature=0, max_tokens=8).json()["choices"][0]
    labelled = _post(server, endpoint, temperature=0, max_tokens=8, **NO_EFFECT_VALUES).json()["choices"][0]
    assert labelled == plain


@pytest.mark.parametrize("endpoint, body, param", [
    ("chat", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ("chat", {"parallel_tool_calls": False}, "parallel_tool_calls"),  # without tools
    ("completions", {"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    ("completions", {"stream": True, "stream_options": {"continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
    ("completions", {"stream": True, "stream_options": {"include_obfuscation": True}},
     "stream_options.include_obfuscation"),
    ("chat", {"messages": [{"role": "user", "content": "hi", "foo": 1}]}, "messages.0.foo"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "foo": 1}]}]},
     "messages.0.content.0.foo"),
    ("chat", {"messages": [{"role": "assistant", "content": "hi", "refusal": "no"}]}, "messages.0.refusal"),
    ("chat", {"messages": [{"role": "user"}]}, "messages.0"),  # content is required but for an assistant's calls
    ("chat", {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None,
      "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}", "x": 1}}]}]},
     "messages.1.tool_calls.0.function.x"),
    ("completions", {"logit_bias": {"\u00b2": 5}}, "logit_bias"),  # a digit, not 0-9
    ("completions", {"stop_token_ids": [7, 10**6]}, "stop_token_ids"),  # outside the vocabulary
    ("completions", {"priority": 2**31}, "priority"),  # past the scheduler's i32 (it once killed the engine)
    ("chat", {"priority": -(2**31) - 1}, "priority"),
])
def test_fields_set_but_not_served_are_400s_naming_the_nested_field(server, endpoint, body, param):
    r = _post(server, endpoint, **body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert r.json()["error"]["message"].startswith(param + ": ")
    assert _post(server, endpoint).status_code == 200  # and the server carries on


def test_a_response_message_sent_back_as_it_came_is_accepted(server):
    """The empty fields of a response's message (refusal, annotations, ...) and a content part's
    cache_control change nothing."""
    history = [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]},
               {"role": "assistant", "content": "hello", "refusal": None, "annotations": [], "audio": None,
                "function_call": None, "tool_calls": None},
               {"role": "user", "content": "and?"}]
    plain = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
             {"role": "user", "content": "and?"}]
    got = _post(server, "chat", messages=history, temperature=0, max_tokens=8)
    assert got.status_code == 200, got.text
    assert got.json()["choices"] == _post(server, "chat", messages=plain, temperature=0, max_tokens=8).json()["choices"]


@pytest.mark.parametrize("body, message", [
    ({"prompt": []}, "prompt: List should have at least 1 item"),
    ({"prompt": ["a"] * 65}, "prompt: List should have at most 64 items"),
    ({"prompt": ["a", [1, 2]]}, "prompt: expected str, list[int], list[str] or list[list[int]]"),
    ({"stop": ["x"] * 17}, "stop: List should have at most 16 items"),
])
def test_a_field_of_several_types_is_explained_by_the_type_the_value_took(server, body, message):
    r = _post(server, "completions", **body)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(message), r.text


def test_a_generation_request_naming_the_embedding_model_is_told_where_it_is_served(server):
    encoder = next(m["id"] for m in httpx.get(server + "/v1/models").json()["data"] if m.get("pyserve_kind"))
    r = _post(server, "chat", model=encoder)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert r.json()["error"]["message"] == f"model {encoder!r} is an embedding model: use /v1/embeddings"


def test_best_of_must_equal_n(server):
    assert _post(server, "completions", n=2, best_of=2).status_code == 200
    r = _post(server, "completions", n=1, best_of=3)
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"


def test_logit_bias_forces_and_bans_tokens(client, tok):
    forced = tok.encode(" banana", add_special_tokens=False)[0]
    r = client.completions.create(model="tiny", prompt="def f():", max_tokens=6, temperature=0,
                                  logit_bias={str(forced): 100}, extra_body={"ignore_eos": True})
    assert tok.encode(r.choices[0].text, add_special_tokens=False) == [forced] * 6
    greedy = client.completions.create(model="tiny", prompt="def f():", max_tokens=6, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text
    first = tok.encode(greedy, add_special_tokens=False)[0]
    banned = client.completions.create(model="tiny", prompt="def f():", max_tokens=6, temperature=0,
                                       logit_bias={str(first): -100}, extra_body={"ignore_eos": True}).choices[0].text
    assert tok.encode(banned, add_special_tokens=False)[0] != first
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(model="tiny", prompt="x", logit_bias={"999999": 1})


def test_stop_token_ids_min_tokens_and_special_tokens(client, tok):
    kw = dict(model="tiny", prompt="import os\n", temperature=0)
    ids = tok.encode(client.completions.create(**kw, max_tokens=12, extra_body={"ignore_eos": True}).choices[0].text,
                     add_special_tokens=False)
    stop_at = ids[3]
    first = ids.index(stop_at)
    r = client.completions.create(**kw, max_tokens=12, extra_body={"stop_token_ids": [stop_at], "ignore_eos": True})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == first + 1
    r = client.completions.create(**kw, max_tokens=12, extra_body={"stop_token_ids": [stop_at], "ignore_eos": True,
                                                                  "min_tokens": first + 2})
    assert r.usage.completion_tokens > first + 1
    special = tok.inner.token_to_id("<|system|>")
    for skip in (True, False):
        r = client.completions.create(model="tiny", prompt="x", max_tokens=2, temperature=0,
                                      logit_bias={str(special): 100},
                                      extra_body={"skip_special_tokens": skip, "ignore_eos": True})
        assert ("<|system|>" in r.choices[0].text) is (not skip)


def test_include_stop_str_in_output(client):
    kw = dict(model="tiny", prompt="import os\n", temperature=0, max_tokens=16, extra_body={"ignore_eos": True})
    text = client.completions.create(**kw).choices[0].text
    stop = text[4:6]
    cut = client.completions.create(**kw, stop=[stop]).choices[0].text
    kept = client.completions.create(model="tiny", prompt="import os\n", temperature=0, max_tokens=16, stop=[stop],
                                     extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].text == cut + stop


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(server, endpoint, tok):
    """vLLM's left truncation: usage counts the tokens kept, and the answer is the answer to them."""
    long = "def add(a, b):\n    return a + b\n" * 6
    full = _post(server, endpoint, **({"prompt": long} if endpoint == "completions" else
                                      {"messages": [{"role": "user", "content": long}]})).json()
    body = {"temperature": 0, "max_tokens": 5, "ignore_eos": True, "truncate_prompt_tokens": 9}
    if endpoint == "completions":
        cut = _post(server, endpoint, prompt=long, **body).json()
        ids = tok.encode(long)[-9:]
        alone = _post(server, endpoint, prompt=ids, **{k: v for k, v in body.items() if k != "truncate_prompt_tokens"})
        assert cut["choices"][0]["text"] == alone.json()["choices"][0]["text"]
    else:
        cut = _post(server, endpoint, messages=[{"role": "user", "content": long}], **body).json()
    assert full["usage"]["prompt_tokens"] > 9 and cut["usage"]["prompt_tokens"] == 9
    for bad, words in ((0, "at least 1"), (-2, "truncate_prompt_tokens")):
        r = _post(server, endpoint, truncate_prompt_tokens=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text
        assert words in r.json()["error"]["message"]


def test_truncate_prompt_tokens_is_refused_with_echo(server):
    r = _post(server, "completions", echo=True, truncate_prompt_tokens=2)
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text


@pytest.fixture(scope="module")
def capped(tmp_path_factory):
    proc, base = start_server(None, "--served-model-name", "tiny", "--default-max-tokens", "3",
                              "--max-tokens-limit", "6", workdir=tmp_path_factory.mktemp("capped"))
    yield base
    stop_server(proc)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_output_caps_hold_a_request_to_the_default_and_refuse_more_than_the_limit(capped, endpoint):
    body = {"max_tokens": None, "temperature": 0, "ignore_eos": True}
    r = _post(capped, endpoint, **body).json()
    assert r["usage"]["completion_tokens"] == 3 and r["choices"][0]["finish_reason"] == "length"
    r = _post(capped, endpoint, **{**body, "max_tokens": 6}).json()
    assert r["usage"]["completion_tokens"] == 6
    r = _post(capped, endpoint, **{**body, "max_tokens": 7})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    assert "limit of 6" in r.json()["error"]["message"]
    if endpoint == "chat":
        r = _post(capped, endpoint, **{**body, "max_completion_tokens": 7})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens", r.text


def test_output_caps_are_checked_at_start():
    from pyserve.server.settings import ServerSettings

    with pytest.raises(ValueError, match="default_max_tokens"):
        ServerSettings("m", default_max_tokens=0)
    with pytest.raises(ValueError, match=r"default_max_tokens \(9\) must not exceed max_tokens_limit \(4\)"):
        ServerSettings("m", default_max_tokens=9, max_tokens_limit=4)


@pytest.fixture(scope="module")
def concise(tmp_path_factory):
    proc, base = start_server(None, "--served-model-name", "tiny", "--concise", "--concise-instruction",
                              "Be brief.", workdir=tmp_path_factory.mktemp("concise"))
    yield base
    stop_server(proc)


def _prompt_tokens(tok, messages) -> int:
    return len(tok.encode(tok.apply_chat_template(messages, True), add_special_tokens=False))


def test_concise_puts_its_instruction_in_the_system_prompt(concise, tok):
    """The prompt the model is given is the conversation with the instruction after the system
    message's text, or in a system message of its own; completions are left as they are."""
    user = {"role": "user", "content": "hi"}
    alone = _post(concise, "chat", messages=[user]).json()
    assert alone["usage"]["prompt_tokens"] == _prompt_tokens(tok, [{"role": "system", "content": "Be brief."}, user])
    system = {"role": "system", "content": "You write Python."}
    both = _post(concise, "chat", messages=[system, user]).json()
    want = _prompt_tokens(tok, [{"role": "system", "content": "You write Python.\n\nBe brief."}, user])
    assert both["usage"]["prompt_tokens"] == want
    assert _post(concise, "completions", prompt="hi").json()["usage"]["prompt_tokens"] == len(tok.encode("hi"))
