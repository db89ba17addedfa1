"""/v1/completions with `echo`: the prompt before the completion, and with `logprobs` the
prompt tokens' logprobs (the first one null) as the engine's prompt_logprobs give them; with
`max_tokens: 0` only the prompt (lm-evaluation-harness' loglikelihood requests)."""

from __future__ import annotations

import math

from pyserve import SamplingParams
from pyserve.testing.in_process import serving


def client(model_dir):
    return serving(model_dir, block_size=4, num_kv_blocks=128)


PROMPT = "def add(a, b):\n    return"


async def test_echo_puts_the_prompt_and_its_logprobs_before_the_completion(llama_dir):
    async with client(llama_dir) as (engine, c):
        ids = engine.tokenizer.encode(PROMPT)
        stream = await engine.add_request("ref", ids, SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2,
                                                                     logprobs=2))
        await stream.done.wait()
        ref = stream.output
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 2}
        r = await c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["text"] == PROMPT + ref.outputs[0].text
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) + 3 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for j in range(1, len(ids)):
            assert math.isclose(lp["token_logprobs"][j], ref.prompt_logprobs[j][ids[j]].logprob, abs_tol=1e-5)
            top = lp["top_logprobs"][j]  # the top 2 and the prompt's own token, keyed by text (pieces may share "\ufffd")
            assert 1 <= len(top) <= 3 and math.isclose(top[lp["tokens"][j]], lp["token_logprobs"][j], abs_tol=1e-6)
        assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:j]) for j in range(len(lp["tokens"]))]
        generated = ref.outputs[0].logprobs
        for j, tid in enumerate(ref.outputs[0].token_ids):
            assert math.isclose(lp["token_logprobs"][len(ids) + j], generated[j][tid].logprob, abs_tol=1e-5)
        scored = (await c.post("/v1/completions", json={**body, "max_tokens": 0, "prompt": ids})).json()
        only = scored["choices"][0]
        assert only["text"] == engine.tokenizer.decode(ids, skip_special_tokens=False)
        assert only["logprobs"]["token_logprobs"] == lp["token_logprobs"][: len(ids)]
        assert only["finish_reason"] == "length" and scored["usage"]["completion_tokens"] == 0
        plain = (await c.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 3,
                                                        "temperature": 0, "echo": True})).json()["choices"][0]
        assert plain["text"] == PROMPT + ref.outputs[0].text and plain["logprobs"] is None


async def test_echo_refusals_name_the_field(llama_dir):
    async with client(llama_dir) as (engine, c):
        for body, param in [({"max_tokens": 0}, "max_tokens"), ({"echo": True, "stream": True}, "echo")]:
            r = await c.post("/v1/completions", json={"model": "tiny", "prompt": "x", **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
