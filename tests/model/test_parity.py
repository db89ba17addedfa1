"""Greedy parity with transformers, token for token, on tiny random models of every supported
architecture: batched, with chunked prefill forced, with prefix reuse and under preemption."""

from __future__ import annotations

import pytest

from pyserve import LLM, SamplingParams
from pyserve.testing import MAX_TOKENS, assert_parity, hf_greedy, prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def references(model_dirs):
    return {arch: hf_greedy(path, prompts(300)) for arch, path in model_dirs.items()}


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_greedy_matches_transformers_batched_and_chunked(arch, model_dirs, references):
    ps = prompts(300)
    with LLM(str(model_dirs[arch]), block_size=4, num_kv_blocks=512) as llm:
        outs = llm.generate(ps, GREEDY, use_tqdm=False)
        assert [o.prompt_token_ids for o in outs] == ps
        assert_parity([o.outputs[0].token_ids for o in outs], references[arch])
        assert all(o.outputs[0].finish_reason == "length" for o in outs)
    with LLM(str(model_dirs[arch]), block_size=4, num_kv_blocks=512, max_num_batched_tokens=8) as llm:
        outs = llm.generate(ps, GREEDY, use_tqdm=False)
        assert_parity([o.outputs[0].token_ids for o in outs], references[arch])


def test_prefix_reuse_gives_cached_tokens_and_same_output(model_dirs, references):
    ps = prompts(300)
    with LLM(str(model_dirs["llama"]), block_size=4, num_kv_blocks=512) as llm:
        first = llm.generate(ps, GREEDY, use_tqdm=False)
        second = llm.generate(ps, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in second] == [o.outputs[0].token_ids for o in first]
        assert_parity([o.outputs[0].token_ids for o in second], references["llama"])
        long_prompts = [o for o in second if len(o.prompt_token_ids) >= 8]
        assert all(o.num_cached_tokens >= 4 for o in long_prompts)
        assert first[2].num_cached_tokens == 0
        assert llm.stats()["prefix_cache_hits"] > 0


def test_a_prompt_that_parts_from_a_cached_one_inside_a_block_reuses_that_blocks_first_tokens(model_dirs):
    """The cache matches up to the token where two prompts part, inside a block of 4 there: that
    block is copied, its first tokens kept, and the output is still transformers'."""
    ps = prompts(300, seed=3, lengths=(22, 22, 22, 22))
    variants = [p[:13 + i] + [(t + 1) % 300 or 2 for t in p[13 + i:]] for i, p in enumerate(ps)]
    references = hf_greedy(model_dirs["llama"], variants)
    with LLM(str(model_dirs["llama"]), block_size=4, num_kv_blocks=512) as llm:
        llm.generate(ps, GREEDY, use_tqdm=False)
        outs = llm.generate(variants, GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [13, 14, 15, 16]
    assert_parity([o.outputs[0].token_ids for o in outs], references)


def test_parity_under_forced_preemption(model_dirs, references):
    ps = prompts(300)
    # 64 + 12 tokens need 19 blocks of 4: the pool holds one long request and little else.
    with LLM(str(model_dirs["qwen2"]), block_size=4, num_kv_blocks=24, enable_prefix_caching=False) as llm:
        outs = llm.generate(ps, GREEDY, use_tqdm=False)
        assert llm.stats()["num_preemptions"] > 0
    assert_parity([o.outputs[0].token_ids for o in outs], references["qwen2"])


def test_batch_invariance_alone_and_in_batch_of_32(model_dirs):
    target = prompts(300, seed=1, lengths=(21,))[0]
    others = prompts(300, seed=2, lengths=[(i * 7) % 50 + 1 for i in range(31)])
    with LLM(str(model_dirs["qwen3"]), block_size=4, num_kv_blocks=1024) as llm:
        alone = llm.generate([target], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        batch = llm.generate(others[:15] + [target] + others[15:], GREEDY, use_tqdm=False)
    assert batch[15].outputs[0].token_ids == alone


def test_seeded_sampling_is_reproducible_in_any_batch(model_dirs):
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True)
    ps = prompts(300, seed=3, lengths=(5, 30, 12))
    with LLM(str(model_dirs["llama"]), block_size=4, num_kv_blocks=512) as llm:
        alone = llm.generate([ps[1]], p, use_tqdm=False)[0].outputs[0].token_ids
        mixed = llm.generate(ps, [SamplingParams(temperature=1.0, max_tokens=10), p, SamplingParams(
            temperature=0.7, seed=7, max_tokens=10)], use_tqdm=False)
        again = llm.generate([ps[1]], p, use_tqdm=False)[0].outputs[0].token_ids
    assert mixed[1].outputs[0].token_ids == alone == again
