"""The served prompt budget: --max-prompt-tokens (a model's, or its models file entry's) and a
request's max_prompt_tokens / prompt_policy fit a chat to the budget, say what they removed
(usage.prompt_tokens_details.removed_tokens, the x-pyserve-prompt-policy header), keep the
prompt's prefix for the prefix cache, and refuse what they cannot do."""

from __future__ import annotations

import json

import pytest

from pyserve.default_model import TARGET_DIR
from pyserve.model.tokenizer import Tokenizer
from pyserve.prompt_budget import fit_chat
from pyserve.testing.in_process import serving_models

BUDGET = 160
MODEL = {"model": str(TARGET_DIR), "block_size": 4, "num_kv_blocks": 512}


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(TARGET_DIR)


def chat(turns: int) -> list[dict]:
    msgs = [{"role": "system", "content": "You write Python."}]
    for t in range(turns):
        msgs.append({"role": "user", "content": f"Question {t}: write a function that adds {t} to each item of a list."})
        msgs.append({"role": "assistant", "content": f"def add_{t}(xs):\n    return [x + {t} for x in xs]"})
    return msgs[:-1]


def expected(tok, messages, budget, policy="turns"):
    def render(m):
        return tok.encode(tok.apply_chat_template(m, True), add_special_tokens=False)
    return fit_chat(messages, budget, policy, render, lambda t: len(tok.encode(t, add_special_tokens=False)))


async def ask(client, messages, **body):
    return await client.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 2,
                                                            "temperature": 0, **body})


@pytest.mark.asyncio
async def test_a_chat_over_the_budget_keeps_its_newest_turns_and_says_what_was_removed(tok):
    msgs = chat(12)
    want = expected(tok, msgs, BUDGET)
    assert want.diet.dropped_messages > 0  # the chat is over the budget
    async with serving_models({"tiny": MODEL}, max_prompt_tokens=BUDGET) as (_, client):
        r = await ask(client, msgs)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] == len(want.token_ids) <= BUDGET
        assert usage["prompt_tokens_details"]["removed_tokens"] == want.diet.removed_tokens > 0
        assert r.headers["x-pyserve-prompt-policy"] == "turns"
        # a request may ask less than the model's budget, not more
        r = await ask(client, msgs, max_prompt_tokens=100)
        assert r.json()["usage"]["prompt_tokens"] == len(expected(tok, msgs, 100).token_ids) <= 100
        r = await ask(client, msgs, max_prompt_tokens=BUDGET + 1)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_prompt_tokens", r.text
        assert f"prompt budget of {BUDGET} for 'tiny'" in r.json()["error"]["message"]
        # a budget the newest turn alone overflows
        r = await ask(client, msgs, max_prompt_tokens=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_prompt_tokens", r.text
        assert "over the budget of 10" in r.json()["error"]["message"]
        # streamed: the usage chunk says the same
        r = await ask(client, msgs, stream=True, stream_options={"include_usage": True})
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        assert chunks[-1]["usage"]["prompt_tokens_details"]["removed_tokens"] == want.diet.removed_tokens
        # the Responses API serves the same conversation the same way
        r = await client.post("/v1/responses", json={"model": "tiny", "instructions": msgs[0]["content"],
                                                     "input": msgs[1:], "max_output_tokens": 2, "temperature": 0})
        assert r.headers["x-pyserve-prompt-policy"] == "turns", r.text
        details = r.json()["usage"]["input_tokens_details"]
        assert r.json()["usage"]["input_tokens"] == len(want.token_ids)
        assert details["removed_tokens"] == want.diet.removed_tokens
        # a short chat is left whole: nothing removed, the policy still named
        r = await ask(client, chat(1))
        assert r.json()["usage"]["prompt_tokens_details"]["removed_tokens"] == 0


@pytest.mark.asyncio
async def test_the_kept_prefix_is_reused_from_turn_to_turn(tok):
    """Turns the cut does not move on find the previous prompt in the prefix cache: with turns of
    about 50 tokens and a budget of 320, the cut moves every third turn or so (at half the budget)."""
    async with serving_models({"tiny": MODEL}, max_prompt_tokens=320) as (_, client):
        hits = []
        for turns in range(8, 26):
            msgs = chat(turns)
            r = (await ask(client, msgs)).json()["usage"]
            want = expected(tok, msgs, 320)
            assert r["prompt_tokens"] == len(want.token_ids) <= 320
            hits.append((want.messages[1]["content"], r["prompt_tokens_details"]["cached_tokens"], r["prompt_tokens"]))
        same_cut = [(c, p) for (first, c, p), (before, _, _) in zip(hits[1:], hits) if first == before]
        assert len(same_cut) >= 10, hits
        for cached, prompt in same_cut:  # all but the newest turn (~50 tokens) and a partial block
            assert cached >= prompt - 60, hits


@pytest.mark.asyncio
async def test_turns_plus_repeats_drops_a_resent_passage(tok):
    doc = "Context: the service stores each order in the orders table, keyed by its id and customer."
    msgs = [{"role": "user", "content": f"{doc}\n\nHow are orders keyed?"},
            {"role": "assistant", "content": "By id."},
            {"role": "user", "content": f"{doc}\n\nAnd by customer?"}]
    want = expected(tok, msgs, BUDGET, "turns+repeats")
    assert want.diet.dropped_passages == 1
    async with serving_models({"tiny": MODEL}, max_prompt_tokens=BUDGET) as (_, client):
        r = await ask(client, msgs, prompt_policy="turns+repeats")
        assert r.headers["x-pyserve-prompt-policy"] == "turns+repeats"
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] == len(want.token_ids)
        assert usage["prompt_tokens_details"]["removed_tokens"] == want.diet.removed_tokens > 0


@pytest.mark.asyncio
async def test_a_models_own_budget_and_the_refusals(tok):
    async with serving_models({"tiny": MODEL, "open": MODEL}, policies={"tiny": {"max_prompt_tokens": 40}}) \
            as (_, client):
        long_prompt = " ".join(["word"] * 60)
        r = await client.post("/v1/completions", json={"model": "tiny", "prompt": long_prompt, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        assert "over the prompt budget of 40" in r.json()["error"]["message"]
        r = await client.post("/v1/completions", json={"model": "tiny", "prompt": long_prompt, "max_tokens": 1,
                                                       "truncate_prompt_tokens": 40})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 40, r.text
        r = await client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 1,
                                                       "prompt_policy": "turns"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_policy", r.text  # chat only
        # the other model has no budget: its chats are whole, and a policy alone is refused
        r = await client.post("/v1/chat/completions", json={"model": "open", "messages": chat(12), "max_tokens": 1})
        assert "x-pyserve-prompt-policy" not in r.headers
        assert "removed_tokens" not in r.json()["usage"]["prompt_tokens_details"]
        r = await client.post("/v1/chat/completions", json={"model": "open", "messages": chat(2), "max_tokens": 1,
                                                            "prompt_policy": "turns"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_policy", r.text
        assert "needs a prompt budget" in r.json()["error"]["message"]
        r = await client.post("/v1/chat/completions", json={"model": "open", "messages": chat(12), "max_tokens": 1,
                                                            "max_prompt_tokens": BUDGET})
        assert r.json()["usage"]["prompt_tokens"] == len(expected(tok, chat(12), BUDGET).token_ids)
