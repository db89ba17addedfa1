"""The OpenAI-compatible server, as a real process on loopback, driven by the official client."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time

import httpx
import openai
import pytest
from tokenizers import Tokenizer as HFTokenizer

from pyserve.embeddings.packaged import NAME as PACKAGED_EMBEDDING_MODEL
from pyserve.model.tokenizer import Tokenizer
from pyserve.testing import scrape_metrics, start_server, stop_server

KEY = "test-key-123"
MODEL = "tiny"


def start(model_dir, *extra: str) -> tuple[subprocess.Popen, str]:
    flags = ["--served-model-name", MODEL, "--block-size", "4", "--num-kv-blocks", "512", *extra]
    return start_server(model_dir, *flags, workdir=model_dir.parent)


@pytest.fixture(scope="module")
def server(model_dirs):
    proc, base = start(model_dirs["llama"], "--api-key", KEY, "--max-waiting", "64")
    yield base
    stop_server(proc)


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)


def metric(base: str, name: str) -> float:
    return scrape_metrics(base, KEY, MODEL)[name]


def test_chat_non_streaming_and_streaming_agree(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "def add(a, b):"}], max_tokens=12,
              temperature=0.8, seed=42)
    full = client.chat.completions.create(**kw)
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-")
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert full.usage.prompt_tokens > 0 and full.usage.completion_tokens > 0
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [choice.finish_reason]


def test_completions_text_and_token_prompts(client):
    r = client.completions.create(model=MODEL, prompt="for i in", max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5
    ids = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=3, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert ids.usage.prompt_tokens == 4 and ids.usage.completion_tokens == 3
    batch = client.completions.create(model=MODEL, prompt=["a", "b"], max_tokens=2, temperature=0)
    assert sorted(c.index for c in batch.choices) == [0, 1]


def test_cached_tokens_reported_on_repeat(client):
    prompt = "class Point:\n    def __init__(self, x, y):\n        self.x = x\n"
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= 4


def test_stop_string_is_honoured_and_not_leaked(client):
    base = client.completions.create(model=MODEL, prompt="import os", max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    assert len(base) > 4
    stop = base[3:5]
    for stream in (False, True):
        r = client.completions.create(model=MODEL, prompt="import os", max_tokens=16, temperature=0, stop=[stop],
                                      stream=stream, extra_body={"ignore_eos": True})
        if stream:
            chunks = list(r)
            text = "".join(c.choices[0].text for c in chunks)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason][0]
        else:
            text, reason = r.choices[0].text, r.choices[0].finish_reason
        assert text == base[: base.index(stop)] and reason == "stop"


def test_n_and_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=3, max_tokens=4,
                                       temperature=1.0, seed=1, logprobs=True, top_logprobs=2)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    for c in r.choices:
        assert len(c.logprobs.content) == len(c.logprobs.content)
        for entry in c.logprobs.content:
            assert entry.logprob <= 0.0 and len(entry.top_logprobs) == 2
            assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    r = client.completions.create(model=MODEL, prompt="def", max_tokens=3, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens


def test_completion_logprobs_hold_the_sampled_token_and_text_offsets(client):
    """As OpenAI's legacy API: each top_logprobs holds the sampled token besides the top k (up to
    k + 1 entries; logprobs=0 gives the sampled token alone), text_offset counts characters
    from the choice's start, and a stream's offsets run on across its chunks."""
    kw = dict(model=MODEL, prompt="def fib(n):", max_tokens=8, temperature=1.5, seed=3)
    for k in (0, 1):
        lp = client.completions.create(**kw, logprobs=k).choices[0].logprobs
        assert all(top[token] == logprob and len(top) <= k + 1
                   for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs))
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:j]) for j in range(len(lp.tokens))]
    streamed = [c.choices[0].logprobs for c in client.completions.create(**kw, logprobs=1, stream=True)
                if c.choices and c.choices[0].logprobs]
    assert [o for c in streamed for o in c.text_offset] == lp.text_offset


def test_chat_logprob_bytes_are_the_tokens_own_bytes(client, model_dirs):
    """A byte-level token that is a piece of a character: its bytes, not U+FFFD's."""
    tokenizer = HFTokenizer.from_file(str(model_dirs["llama"] / "tokenizer.json"))
    piece = tokenizer.id_to_token(100)  # GPT-2's alphabet writes the bytes 0xA1-0xAC as themselves
    assert 0xA1 <= ord(piece) <= 0xAC and tokenizer.decode([100]) == "\ufffd"
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                       temperature=0, logprobs=True, top_logprobs=1, logit_bias={"100": 100})
    content = r.choices[0].logprobs.content
    assert [e.bytes for e in content] == [[ord(piece)]] * 3


def test_models_health_version_metrics(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    models = httpx.get(server + "/v1/models", headers=auth).json()
    assert [m["id"] for m in models["data"]] == [MODEL, PACKAGED_EMBEDDING_MODEL]
    assert abs(models["data"][0]["created"] - time.time()) < 3600  # when the server loaded it
    for card in models["data"]:  # the openai client's models.retrieve
        assert httpx.get(f"{server}/v1/models/{card['id']}", headers=auth).json() == card
    missing = httpx.get(server + "/v1/models/nope", headers=auth)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert httpx.get(server + "/health").status_code == 200
    assert "version" in httpx.get(server + "/version", headers=auth).json()
    body = {"model": MODEL, "prompt": "the cat", "max_tokens": 3, "temperature": 0}
    assert httpx.post(server + "/v1/completions", headers=auth, json=body, timeout=60).status_code == 200  # latencies
    text = httpx.get(server + "/metrics", headers=auth).text
    for name in ["pyserve:num_requests_running", "pyserve:num_requests_waiting", "pyserve:kv_cache_usage_perc",
                 "pyserve:time_to_first_token_seconds_count", "pyserve:inter_token_latency_seconds_count",
                 "pyserve:e2e_request_latency_seconds_count", "pyserve:prompt_tokens_total",
                 "pyserve:generation_tokens_total", "pyserve:prefix_cache_queries_total",
                 "pyserve:prefix_cache_hits_total", "pyserve:num_preemptions_total"]:
        assert f"\n{name}" in text or text.startswith(name), name


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
def test_the_bearer_scheme_is_case_insensitive_and_the_key_exact(server, scheme):
    assert httpx.get(server + "/v1/models", headers={"Authorization": f"{scheme} {KEY}"}).status_code == 200
    assert httpx.get(server + "/v1/models", headers={"Authorization": f"{scheme} {KEY.upper()}x"}).status_code == 401


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                                     {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Bearer{KEY}"}])
def test_auth_required_everywhere_but_health(server, headers):
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/metrics"),
                         ("GET", "/version"), ("GET", "/nope")]:
        r = httpx.request(method, server + path, headers=headers, json={})
        assert r.status_code == 401, path
        assert r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(server + "/health").status_code == 200


def post(server, path, body, raw=None):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    return httpx.post(server + path, headers=headers, content=raw if raw is not None else json.dumps(body))


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"model": MODEL, "prompt": "x", "temperature": 5}, 400, "temperature"),
    ({"model": MODEL, "prompt": "x", "n": 1000}, 400, "n"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 100000}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ({"model": MODEL, "prompt": [999999]}, 400, "prompt"),
    ({"model": MODEL}, 400, "prompt"),
    ({"model": "other", "prompt": "x"}, 404, "model"),
])
def test_errors_are_openai_shaped(server, body, status, param):
    r = post(server, "/v1/completions", body)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"]


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": MODEL, "prompt": "x", "max_tokens": 2}
EMBEDDING = {"model": PACKAGED_EMBEDDING_MODEL, "input": "x"}


@pytest.mark.parametrize(("path", "body", "param", "expected"), [
    ("/v1/chat/completions", CHAT | {"max_tokens": "5"}, "max_tokens", "integer"),
    ("/v1/chat/completions", CHAT | {"max_tokens": True}, "max_tokens", "integer"),
    ("/v1/chat/completions", CHAT | {"max_tokens": 5.0}, "max_tokens", "integer"),
    ("/v1/chat/completions", CHAT | {"temperature": "0"}, "temperature", "number"),
    ("/v1/chat/completions", CHAT | {"temperature": False}, "temperature", "number"),
    ("/v1/chat/completions", CHAT | {"stream": "false"}, "stream", "boolean"),
    ("/v1/chat/completions", CHAT | {"logprobs": 1}, "logprobs", "boolean"),
    ("/v1/chat/completions", CHAT | {"n": "1"}, "n", "integer"),
    ("/v1/chat/completions", CHAT | {"seed": "7"}, "seed", "integer"),
    ("/v1/chat/completions", CHAT | {"stream": True, "stream_options": {"include_usage": 1}},
     "stream_options.include_usage", "boolean"),
    ("/v1/completions", COMPLETION | {"max_tokens": "5"}, "max_tokens", "integer"),
    ("/v1/completions", COMPLETION | {"logprobs": "1"}, "logprobs", "integer"),
    ("/v1/completions", COMPLETION | {"echo": 1}, "echo", "boolean"),
    ("/v1/completions", COMPLETION | {"prompt": [1, "2"]}, "prompt", "list[int]"),
    ("/v1/embeddings", EMBEDDING | {"dimensions": "64"}, "dimensions", "integer"),
    ("/v1/embeddings", EMBEDDING | {"input": [1, True]}, "input", "list[int]"),
])
def test_field_types_are_strict(server, path, body, param, expected):
    """A value of another JSON type is a 400 naming its field, as OpenAI's API answers: no
    string read as a number, no boolean as an integer, no 5.0 as 5 (an integer is a number)."""
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(f"{param}: ") and expected in err["message"]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", CHAT | {"max_tokens": 100000}, "max_tokens"),
    ("/v1/chat/completions", CHAT | {"max_tokens": None, "max_completion_tokens": 100000}, "max_completion_tokens"),
    ("/v1/completions", COMPLETION | {"max_tokens": 100000}, "max_tokens"),
    ("/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 100000}, "max_output_tokens"),
])
def test_an_output_cap_past_the_models_length_names_the_field_sent(server, path, body, param):
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(f"{param}: 100000 tokens after a prompt of "), err


def test_continue_final_message_continues_the_assistants_text(server, model_dirs):
    """vLLM's fields: the last (assistant) message is continued, the template's end of its turn
    left out; its variables from chat_template_kwargs; each refused naming itself where it cannot be."""
    tok = Tokenizer.from_dir(model_dirs["llama"])
    messages = [{"role": "user", "content": "def add(a, b):"}, {"role": "assistant", "content": "    return"}]
    body = CHAT | {"messages": messages, "max_tokens": 4, "temperature": 0}
    r = post(server, "/v1/chat/completions", body | {"continue_final_message": True, "add_generation_prompt": False})
    assert r.status_code == 200, r.text
    prompt = tok.chat_prompt(messages, False, continue_final_message=True)
    assert r.json()["usage"]["prompt_tokens"] == len(prompt) == len(tok.chat_prompt(messages, False)) - 1  # no <|end|>
    for extra, param in (({"continue_final_message": True}, "continue_final_message"),
                         ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs")):
        r = post(server, "/v1/chat/completions", body | extra)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = post(server, "/v1/chat/completions", body | {"chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200, r.text  # a variable the template does not read changes nothing


def test_stop_reason_names_the_stop_string_or_token_that_ended_a_choice(server):
    """vLLM's `stop_reason`: the stop string (or stop token id) that ended it; None at EOS or max_tokens."""
    body = COMPLETION | {"prompt": "def f(x):", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    free = post(server, "/v1/completions", body).json()["choices"][0]
    assert (free["finish_reason"], free["stop_reason"]) == ("length", None)
    text = free["text"]  # a random model's: the first character after the first that the text has once there
    at = next(i for i, ch in enumerate(text) if i > 0 and ch.strip() and ch != "\ufffd" and text.index(ch) == i)
    stop = text[at]
    chat = {k: v for k, v in body.items() if k != "prompt"} | {"messages": [{"role": "user", "content": "def f(x):"}]}
    for path, sent in (("/v1/completions", body), ("/v1/chat/completions", chat)):
        r = post(server, path, sent | {"stop": [stop]})
        choice = r.json()["choices"][0]
        if path == "/v1/completions":
            assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (text[:at], "stop", stop)
        elif choice["finish_reason"] == "stop":
            assert choice["stop_reason"] == stop
        chunks = _sse(post(server, path, sent | {"stop": [stop], "stream": True}))
        last = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]][-1]
        assert last["stop_reason"] == choice["stop_reason"]


def test_integers_are_numbers(server):
    r = post(server, "/v1/completions", COMPLETION | {"temperature": 0, "top_p": 1, "presence_penalty": 0})
    assert r.status_code == 200, r.text


def _sse(r: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


def test_responses_carry_refusal_and_system_fingerprint(server):
    """As OpenAI sends them: a chat message's refusal (null: this server never refuses), and one
    system_fingerprint per model on every chat and text completion object, streamed chunks too."""
    chat = post(server, "/v1/chat/completions", CHAT).json()
    assert chat["choices"][0]["message"]["refusal"] is None and "refusal" in chat["choices"][0]["message"]
    fingerprint = chat["system_fingerprint"]
    assert fingerprint.startswith("fp_pyserve_") and len(fingerprint) > len("fp_pyserve_")
    chunks = _sse(post(server, "/v1/chat/completions", CHAT | {"stream": True, "stream_options": {"include_usage": True}}))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "", "refusal": None}
    assert chunks[-1]["usage"] and {c["system_fingerprint"] for c in chunks} == {fingerprint}
    assert post(server, "/v1/completions", COMPLETION).json()["system_fingerprint"] == fingerprint
    chunks = _sse(post(server, "/v1/completions", COMPLETION | {"stream": True}))
    assert len(chunks) > 1 and {c["system_fingerprint"] for c in chunks} == {fingerprint}
    assert post(server, "/v1/chat/completions", CHAT).json()["system_fingerprint"] == fingerprint  # stable


def test_invalid_json_and_huge_body(server):
    r = post(server, "/v1/chat/completions", None, raw=b"{not json")
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = post(server, "/v1/chat/completions", None, raw=b"[" * 10 + b"]" * 10)
    assert r.status_code == 400
    r = post(server, "/v1/completions", None, raw=b'{"prompt": "' + b"a" * (2 << 20) + b'"}')
    assert r.status_code == 413


def test_chat_max_tokens_beyond_model_length(server):
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                              "max_tokens": 600})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_32_concurrent_streams(server):
    async def one(client, i):
        stream = await client.completions.create(model=MODEL, prompt=f"x{i}", max_tokens=8, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        return sum(1 for c in [c async for c in stream] if c.choices and c.choices[0].text is not None)

    async def main():
        client = openai.AsyncOpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)
        return await asyncio.gather(*(one(client, i) for i in range(32)))

    counts = asyncio.run(main())
    assert len(counts) == 32 and all(c >= 1 for c in counts)


def test_disconnect_mid_stream_frees_everything(server):
    baseline = metric(server, "pyserve:kv_cache_usage_perc")
    body = {"model": MODEL, "prompt": "def", "max_tokens": 400, "stream": True, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", server + "/v1/completions", json=body, headers=headers) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 3:
                break
    deadline = time.time() + 10
    while time.time() < deadline:
        if metric(server, "pyserve:num_requests_running") == 0 and \
                metric(server, "pyserve:kv_cache_usage_perc") == baseline:
            break
        time.sleep(0.1)
    assert metric(server, "pyserve:num_requests_running") == 0
    assert metric(server, "pyserve:kv_cache_usage_perc") == baseline


def test_sigterm_drains_in_flight_stream_and_exits_zero(model_dirs):
    proc, base = start(model_dirs["qwen2"])
    body = {"model": MODEL, "prompt": "def", "max_tokens": 60, "stream": True, "ignore_eos": True}
    lines = []
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if not line:
                continue
            lines.append(line)
            if len(lines) == 2:
                proc.send_signal(signal.SIGTERM)
    assert lines[-1] == "data: [DONE]"
    tokens = sum(len(json.loads(x[6:])["choices"][0]["text"]) > 0 for x in lines[:-1])
    assert tokens >= 30, "the stream ran to its end after SIGTERM"
    assert proc.wait(timeout=60) == 0


def test_a_request_not_streamed_is_timed_from_its_first_token(client, server):
    """No deltas reach the server while it runs: its first token's time comes from the engine, and
    its inter-token gaps count once per token after the first."""
    ttft, itl = "pyserve:time_to_first_token_seconds", "pyserve:inter_token_latency_seconds"
    names = [f"{m}_{part}" for m in (ttft, itl) for part in ("count", "sum")]
    before = list(map(scrape_metrics(server, KEY, MODEL).__getitem__, names))
    r = client.completions.create(model=MODEL, prompt="def", max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 6
    after = list(map(scrape_metrics(server, KEY, MODEL).__getitem__, names))
    assert after[0] - before[0] == 1 and after[2] - before[2] == 5
    assert 0 < after[1] - before[1] < 5 and 0 < after[3] - before[3] < 5
