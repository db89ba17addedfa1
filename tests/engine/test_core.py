"""EngineCore: n > 1 requests compute their prompt once and their samples fork from it (copy-on-write)."""

from __future__ import annotations

from pyserve import LLM, SamplingParams


def _count_computed_tokens(llm: LLM) -> list[int]:
    """Records the tokens every step computes."""
    steps: list[int] = []
    worker = llm.engine.worker
    execute = worker.execute

    def counting(out, rows, adapter_ids=None):
        steps.append(int(out.total_num_tokens))
        return execute(out, rows, adapter_ids)

    worker.execute = counting
    return steps


def test_eight_samples_prefill_their_prompt_once(llama_dir):
    prompt = [(7 * i) % 200 + 3 for i in range(100)]
    with LLM(str(llama_dir), device="cpu", block_size=4, num_kv_blocks=256, enable_prefix_caching=False) as llm:
        steps = _count_computed_tokens(llm)
        params = SamplingParams(n=8, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        # 99 prompt tokens once, then each sample its last prompt token, then 5 decode steps of 8.
        assert [n for n in steps if n] == [99, 8, 8, 8, 8, 8, 8]  # (a step of 0 frees finished state)
        assert [len(c.token_ids) for c in out.outputs] == [6] * 8


def test_forked_samples_match_independent_requests_with_the_same_seeds(llama_dir):
    prompt = [(5 * i) % 150 + 3 for i in range(37)]
    with LLM(str(llama_dir), device="cpu", block_size=4, num_kv_blocks=256) as llm:
        forked = llm.generate([prompt], SamplingParams(n=4, temperature=1.0, seed=9, max_tokens=8), use_tqdm=False)
        alone = llm.generate([prompt] * 4, [SamplingParams(temperature=1.0, seed=9 + i, max_tokens=8) for i in range(4)],
                             use_tqdm=False)
        assert [c.token_ids for c in forked[0].outputs] == [o.outputs[0].token_ids for o in alone]
        assert len({tuple(c.token_ids) for c in forked[0].outputs}) > 1  # the samples differ


def test_greedy_samples_of_one_request_are_identical_and_free_everything(llama_dir):
    with LLM(str(llama_dir), device="cpu", block_size=4, num_kv_blocks=64, enable_prefix_caching=False) as llm:
        out = llm.generate([[11, 12, 13, 14, 15, 16]], SamplingParams(n=3, temperature=0.0, max_tokens=5),
                           use_tqdm=False)[0]
        assert len({tuple(c.token_ids) for c in out.outputs}) == 1
        stats = llm.stats()
        assert (stats["kv_cache_usage_perc"], stats["num_requests_running"]) == (0.0, 0)
        assert stats["kv_free_blocks"] == 63
