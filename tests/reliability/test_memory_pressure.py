"""Memory pressure: a KV pool far smaller than the offered load preempts sequences every few
steps yet gives exactly the outputs of an unpressured run (greedy and seeded sampling); a request
that could never fit in the whole pool is refused with an error naming the field instead of
waiting forever, and the engine keeps serving."""

from __future__ import annotations

import random

import httpx
import pytest

from pyserve import LLM, SamplingParams
from pyserve.testing import start_server, stop_server


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(rng.randint(8, 20))] for _ in range(n)]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=1.0, top_p=0.9, seed=5, max_tokens=24, ignore_eos=True),
], ids=["greedy", "seeded"])
def test_a_tiny_pool_gives_the_outputs_of_a_roomy_one(llama_dir, params):
    ps = prompts(16, seed=1)
    with LLM(str(llama_dir), block_size=4, num_kv_blocks=1024) as roomy:
        want = [o.outputs[0].token_ids for o in roomy.generate(ps, params, use_tqdm=False)]
        assert roomy.stats()["num_preemptions"] == 0
    # 24 blocks of 4 tokens hold 92 tokens; 16 sequences grow to 32-44 tokens each.
    with LLM(str(llama_dir), block_size=4, num_kv_blocks=24, max_num_seqs=16) as tiny:
        got = [o.outputs[0].token_ids for o in tiny.generate(ps, params, use_tqdm=False)]
        stats = tiny.stats()
    assert got == want
    steps = 24 + max(len(p) for p in ps)  # at least one step per token of the longest request
    assert stats["num_preemptions"] >= steps // 4, stats["num_preemptions"]  # one every few steps
    assert stats["kv_cache_usage_perc"] == 0.0 and stats["num_requests_running"] == 0


def test_a_request_larger_than_the_pool_is_refused_and_the_engine_serves_on(llama_dir):
    with LLM(str(llama_dir), block_size=4, num_kv_blocks=16, max_model_len=256) as llm:
        with pytest.raises(ValueError, match="prompt_token_ids.*the pool has 15"):
            llm.generate([list(range(5, 105))], SamplingParams(max_tokens=4), use_tqdm=False)
        with pytest.raises(ValueError, match="max_tokens.*the pool has 15"):
            llm.generate([list(range(5, 40))], SamplingParams(max_tokens=100), use_tqdm=False)
        out = llm.generate([list(range(5, 15))], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4 and llm.stats()["num_requests_waiting"] == 0


def test_the_server_refuses_it_with_400_naming_the_field(llama_dir, tmp_path):
    proc, base = start_server(llama_dir, "--served-model-name", "tiny", "--block-size", "4", "--num-kv-blocks", "16",
                              "--max-model-len", "256", workdir=tmp_path)
    try:
        big = {"model": "tiny", "prompt": list(range(5, 105)), "max_tokens": 4}
        r = httpx.post(base + "/v1/completions", json=big, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        r = httpx.post(base + "/v1/completions", json=big | {"prompt": list(range(5, 40)), "max_tokens": 100}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
        ok = httpx.post(base + "/v1/completions", json=big | {"prompt": list(range(5, 15))}, timeout=30)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    finally:
        assert stop_server(proc) == 0
