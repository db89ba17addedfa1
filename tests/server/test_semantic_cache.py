"""The semantic cache through the openai client: a miss stored then a hit (the same words, and a
rephrasing), tricks (a number, a negation changed) and another tenant missing, a streamed hit
replayed as SSE, TTL, opt-outs, sampled requests left alone, invalidation behind the API key,
the figures in /metrics."""

from __future__ import annotations

import asyncio

import openai
import pytest

from pyserve.testing import parse_metrics
from pyserve.testing.in_process import serving_models

KEY = "sk-cache"
SYSTEM = {"role": "system", "content": "You answer questions about Python."}


def ask(text: str) -> list[dict]:
    return [SYSTEM, {"role": "user", "content": text}]


@pytest.fixture()
async def served(llama_dir):
    models = {"tiny": {"model": str(llama_dir), "block_size": 4, "num_kv_blocks": 64}}
    async with serving_models(models, api_key=KEY, semantic_cache=True, semantic_cache_ttl=3.0) as (_, http):
        http.headers["Authorization"] = f"Bearer {KEY}"
        yield http


def client(http, tenant: str | None = None) -> openai.AsyncOpenAI:
    headers = {"X-Tenant": tenant} if tenant else {}
    return openai.AsyncOpenAI(base_url="http://t/v1", api_key=KEY, http_client=http, max_retries=0,
                              default_headers=headers)


async def chat(api: openai.AsyncOpenAI, text: str, **kw):
    r = await api.chat.completions.with_raw_response.create(**({"model": "tiny", "messages": ask(text),
                                                                "max_tokens": 8, "temperature": 0} | kw))
    return r.headers.get("x-pyserve-cache"), r.parse()


async def test_a_miss_is_stored_and_the_same_question_or_a_rephrasing_hits(served):
    api = client(served, "acme")
    status, first = await chat(api, "How do I sort a list in Python?")
    assert status == "miss" and first.usage.model_extra["pyserve_cache"] == "miss"
    for text in ("How do I sort a list in Python?", "In Python, how can I sort a list?"):
        status, again = await chat(api, text)
        assert status == "hit" and again.usage.model_extra["pyserve_cache"] == "hit"
        assert again.choices[0].message.content == first.choices[0].message.content and again.id != first.id
        assert again.system_fingerprint == first.system_fingerprint and first.system_fingerprint.startswith("fp_")
    for trick in ("How do I not sort a list in Python?", "How do I sort a list in Ruby?"):
        assert (await chat(api, trick))[0] == "miss"
    status, _ = await chat(api, "What is 12 times 4?")
    assert (await chat(api, "What is 12 times 4?"))[0] == "hit" and (await chat(api, "What is 12 times 5?"))[0] == "miss"
    status, _ = await chat(api, "How do I sort a list in Python?", max_tokens=9)  # another scope: other params
    assert status == "miss"
    metrics = parse_metrics((await served.get("/metrics")).text)
    assert metrics["pyserve:semantic_cache_hits_total"] == 3
    assert metrics["pyserve:semantic_cache_misses_total"] == 6
    assert metrics["pyserve:semantic_cache_lookup_seconds_count"] == 9


async def test_only_the_users_words_are_matched_by_meaning(served):
    """An agent's loop: the same question after a tool result that changed (one state for
    another) is a miss; the same transcript with other call ids is a hit (ids are random)."""
    api = client(served, "agents")

    def loop(result: str, call_id: str) -> list[dict]:
        call = {"id": call_id, "type": "function", "function": {"name": "deploy", "arguments": '{"env": "prod"}'}}
        return [SYSTEM, {"role": "user", "content": "Deploy to prod, then tell me how it went."},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": call_id, "content": result},
                {"role": "user", "content": "How did the deployment go?"}]

    async def status(messages):
        r = await api.chat.completions.with_raw_response.create(model="tiny", messages=messages, max_tokens=8,
                                                                temperature=0)
        return r.headers.get("x-pyserve-cache")

    assert await status(loop("deployment succeeded, all services healthy", "call_1")) == "miss"
    assert await status(loop("deployment failed, all services down", "call_2")) == "miss"
    assert await status(loop("deployment succeeded, all services healthy", "call_3")) == "hit"
    assert await status(loop("deployment succeeded, all services healthy", "call_4")[:-1] + [
        {"role": "user", "content": "How did the deployment go??"}]) == "hit"  # the user's words, by meaning


async def test_one_tenant_never_reads_anothers_entry(served):
    a = client(served, "tenant-a")
    assert (await chat(a, "How do I read a file in Python?"))[0] == "miss"
    assert (await chat(a, "In Python, how do I read a file?"))[0] == "hit"
    # the same system prompt; the same question, a similar one, no X-Tenant: each a tenant of its own
    assert (await chat(client(served, "tenant-b"), "How do I read a file in Python?"))[0] == "miss"
    assert (await chat(client(served, "tenant-c"), "In Python, how do I read a file?"))[0] == "miss"
    assert (await chat(client(served), "How do I read a file in Python?"))[0] == "miss"


async def test_a_streamed_hit_is_replayed_as_sse(served):
    api = client(served, "s")
    _, first = await chat(api, "How do I parse JSON in Python?")
    r = await api.chat.completions.with_raw_response.create(model="tiny", messages=ask("How do I parse JSON in Python?"),
                                                              max_tokens=8, temperature=0, stream=True,
                                                              stream_options={"include_usage": True})
    assert r.headers["x-pyserve-cache"] == "hit"
    assert r.headers["x-pyserve-request-id"].startswith("chatcmpl-")  # the hit's own id, as its log line's
    chunks = [c async for c in r.parse()]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == first.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == first.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == first.usage.completion_tokens
    assert {c.system_fingerprint for c in chunks} == {first.system_fingerprint} != {None}


async def test_entries_expire_and_opt_outs_and_sampled_requests_are_not_cached(served):
    api = client(served, "t")
    assert (await chat(api, "How do I copy a directory in Python?"))[0] == "miss"
    await asyncio.sleep(3.1)
    assert (await chat(api, "How do I copy a directory in Python?"))[0] == "miss"  # expired, stored anew
    assert (await chat(api, "How do I open a socket?", extra_headers={"Cache-Control": "no-store"}))[0] == "bypass"
    assert (await chat(api, "How do I open a socket?"))[0] == "miss"  # no-store stored nothing
    assert (await chat(api, "How do I open a socket?", extra_headers={"Cache-Control": "no-cache"}))[0] == "bypass"
    r = await api.chat.completions.with_raw_response.create(model="tiny", messages=ask("How do I open a socket?"),
                                                              max_tokens=8, temperature=1.0)
    assert "x-pyserve-cache" not in r.headers
    assert (await chat(api, "How do I open a socket?", seed=3))[0] == "miss"  # seeded: cached, its own scope


async def test_a_temperature_the_engine_takes_as_greedy_is_cached_as_deterministic(served):
    """Below GREEDY_BELOW the engine samples the argmax, as at temperature 0: the cache stores and
    answers such a request too (it took only exactly 0 as greedy)."""
    api = client(served, "t")
    assert (await chat(api, "How do I read a file line by line?", temperature=1e-6))[0] == "miss"
    assert (await chat(api, "How do I read a file line by line?", temperature=1e-6))[0] == "hit"


async def test_invalidation_needs_the_key_and_drops_only_the_callers_tenant(served):
    a, b = client(served, "a"), client(served, "b")
    await chat(a, "How do I merge two dictionaries in Python?")
    await chat(b, "How do I merge two dictionaries in Python?")
    r = await served.post("/v1/cache/invalidate", json={}, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    r = await served.post("/v1/cache/invalidate", json={"model": "tiny"}, headers={"X-Tenant": "a"})
    assert r.status_code == 200 and r.json() == {"invalidated": 1}
    assert (await chat(a, "How do I merge two dictionaries in Python?"))[0] == "miss"
    assert (await chat(b, "How do I merge two dictionaries in Python?"))[0] == "hit"
    r = await served.post("/v1/cache/invalidate", json={"tenant": "b"})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "tenant")
    r = await served.post("/v1/cache/invalidate", json={"model": "nope"})
    assert (r.status_code, r.json()["error"]["param"]) == (404, "model")
    info = (await served.get("/v1/cache", headers={"X-Tenant": "b"})).json()
    assert (info["entries"], info["stores"], info["hits"]) == (1, 1, 1) and 0.5 < info["threshold"] < 1
    stats = (await served.get("/v1/stats")).json()  # the server's figures
    assert (stats["semantic_cache"]["entries"], stats["semantic_cache"]["hits"]) == (2, 1)
    r = await served.get("/v1/stats", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401


async def test_the_bearer_schemes_case_and_spaces_name_one_tenant(served):
    """`bearer KEY` and `BEARER  KEY` pass the key check as `Bearer KEY` does, and are its
    tenant: its entries hit, /v1/cache shows them, invalidation drops them."""
    assert (await chat(client(served, "t"), "How do I reverse a string in Python?"))[0] == "miss"
    for auth in (f"bearer {KEY}", f"BEARER  {KEY}", f"Bearer \t{KEY}"):
        headers = {"Authorization": auth, "X-Tenant": "t"}
        r = await served.post("/v1/chat/completions", headers=headers, json={
            "model": "tiny", "messages": ask("How do I reverse a string in Python?"), "max_tokens": 8, "temperature": 0})
        assert (r.status_code, r.headers["x-pyserve-cache"]) == (200, "hit"), auth
        assert (await served.get("/v1/cache", headers=headers)).json()["entries"] == 1
    r = await served.post("/v1/cache/invalidate", json={}, headers={"Authorization": f"bearer {KEY}", "X-Tenant": "t"})
    assert r.json() == {"invalidated": 1}


async def test_the_cache_figures_are_the_callers_own(served):
    """GET /v1/cache: the caller's tenant's entries, bytes, hits, misses and stores, not the
    server's (those are in /v1/stats)."""
    a, b = client(served, "a"), client(served, "b")
    for text in ("How do I sort a dict by value?", "How do I flatten a list of lists?"):
        assert (await chat(b, text))[0] == "miss"
    assert (await chat(b, "How do I sort a dict by value?"))[0] == "hit"
    assert (await chat(a, "How do I sort a dict by value?"))[0] == "miss"

    def figures(tenant):
        return served.get("/v1/cache", headers={"X-Tenant": tenant})

    mine = {t: (await figures(t)).json() for t in ("a", "b", "c")}
    assert [(f["entries"], f["hits"], f["misses"], f["stores"]) for f in mine.values()] == \
        [(1, 0, 1, 1), (2, 1, 2, 2), (0, 0, 0, 0)]
    assert mine["c"]["bytes"] == 0 < mine["a"]["bytes"] < mine["b"]["bytes"]
    server = (await served.get("/v1/stats")).json()["semantic_cache"]
    assert (server["entries"], server["bytes"]) == (3, mine["a"]["bytes"] + mine["b"]["bytes"])


def test_a_hit_is_a_new_response_with_fresh_tool_call_ids():
    import numpy as np
    import orjson

    from pyserve.semantic_cache.guard import guard_of
    from pyserve.semantic_cache.store import Entry
    from pyserve.server.chat_cache import hit_body

    call = {"id": "call_stored", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    stored = {"choice": {"index": 0, "message": {"role": "assistant", "content": None, "tool_calls": [call]},
                         "logprobs": None, "finish_reason": "tool_calls"},
              "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}}
    entry = Entry(1, "s", np.zeros(4, np.float32), guard_of("q"), orjson.dumps(stored), "t", "m", 0.0, 0.9)
    first, second = hit_body(entry, "m", "fp_m"), hit_body(entry, "m", "fp_m")
    ids = [b["choices"][0]["message"]["tool_calls"][0]["id"] for b in (first, second)]
    assert len(set(ids)) == 2 and "call_stored" not in ids and first["id"] != second["id"]
    assert first["choices"][0]["message"]["tool_calls"][0]["function"] == call["function"]
