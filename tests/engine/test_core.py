"""EngineCore: n > 1 requests compute their prompt once and their samples fork from it (copy-on-write);
a prompt arriving while a stream decodes is computed in chunks of the step budget."""

from __future__ import annotations

import pytest

from pyserve import LLM, SamplingParams
from pyserve.engine.async_engine import AsyncEngine
from pyserve.config import EngineConfig
from pyserve.engine.step_budget import StepBudget


def _count_computed_tokens(llm: LLM) -> list[int]:
    """Records the tokens every step computes."""
    steps: list[int] = []
    worker = llm.engine.worker
    execute = worker.execute

    def counting(out, rows, *rest):
        steps.append(int(out.total_num_tokens))
        return execute(out, rows, *rest)

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


class KnownCost(StepBudget):
    """Observes a known cost instead of the clock, seconds = 0.01 + 0.001 * tokens: with a target
    of 0.05 s every step the stream decodes in holds 40 tokens."""

    def observe(self, num_tokens: int, seconds: float) -> None:
        super().observe(num_tokens, 0.01 + 0.001 * num_tokens)


async def _newcomer_chunks(llama_dir, max_inter_token_latency: float) -> list[int]:
    """The tokens per step of a 200-token prompt that arrives while a stream decodes."""
    engine = AsyncEngine(EngineConfig(model=str(llama_dir), device="cpu", block_size=4, num_kv_blocks=256,
                                      max_inter_token_latency=max_inter_token_latency))
    if engine.engine_core.step_budget is not None:
        engine.engine_core.step_budget = KnownCost(max_inter_token_latency, engine.config.max_num_batched_tokens)
    steps: list[dict[int, int]] = []
    execute = engine.worker.execute

    def recording(out, rows, *rest):
        steps.append(dict(zip(out.req_ids.tolist(), out.num_scheduled_tokens.tolist())))
        return execute(out, rows, *rest)

    engine.worker.execute = recording
    await engine.start()
    try:
        # Long enough to be decoding still when the newcomer ends (the engine runs on a thread of
        # its own, at its own pace); aborted then.
        params = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)
        stream = await engine.add_request("stream", list(range(3, 11)), params)
        for _ in range(2):  # its prompt step and a decode step: the cost has two sizes to fit
            await stream.deltas.get()
        newcomer = await engine.add_request("newcomer", list(range(50, 250)),
                                            SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        await newcomer.done.wait()
        await engine.abort("stream")
    finally:
        await engine.stop()
    stream_id, newcomer_id = stream.internal_ids[0], newcomer.internal_ids[0]
    assert all(s.get(stream_id) == 1 for s in steps if newcomer_id in s), "the stream decodes at every step"
    return [s[newcomer_id] for s in steps if newcomer_id in s]


@pytest.mark.asyncio
async def test_a_prompt_arriving_during_a_stream_is_chunked_to_the_step_budget(llama_dir):
    # 40 tokens a step: the stream's decode token, then 39 of the prompt; then its first decode.
    assert await _newcomer_chunks(llama_dir, 0.05) == [39, 39, 39, 39, 39, 5, 1]


@pytest.mark.asyncio
async def test_without_a_latency_target_the_prompt_takes_the_whole_step(llama_dir):
    assert await _newcomer_chunks(llama_dir, 0.0) == [200, 1]
