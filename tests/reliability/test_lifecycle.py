"""Randomized lifecycle: 1000 requests per engine configuration, each submitted with random
lengths, priorities, n and sampling, then left to finish, aborted (awaited or fire-and-forget, as
a disconnecting client does) or cancelled while being admitted; some carry a LoRA adapter, some
engines speculate. Afterwards nothing is left anywhere: every KV block is free or cached and
unreferenced, the scheduler's invariants hold, the queues and every per-request table are empty,
and no request waited forever."""

from __future__ import annotations

import asyncio
import random
import zlib

import pytest

from pyserve.engine.async_engine import AsyncEngine
from pyserve.config import EngineConfig
from pyserve.step.sampling_params import SamplingParams
from pyserve.lora.request import LoRARequest

CYCLES = 1000
IN_FLIGHT = 24


def random_params(rng: random.Random) -> SamplingParams:
    max_tokens = rng.randint(1, 16)
    return SamplingParams(
        n=rng.choice([1, 1, 1, 2, 3]), temperature=rng.choice([0.0, 0.0, 0.8, 1.2]), top_p=rng.choice([1.0, 0.9]),
        top_k=rng.choice([0, 0, 20]), seed=rng.choice([None, rng.randrange(1000)]),
        max_tokens=max_tokens, min_tokens=min(max_tokens, rng.choice([0, 0, 2])), ignore_eos=rng.random() < 0.5,
        stop=rng.choice([[], [], ["e"], ["(", "x"]]), logprobs=rng.choice([None, None, None, 2]),
        presence_penalty=rng.choice([0.0, 0.0, 0.5]), repetition_penalty=rng.choice([1.0, 1.0, 1.2]))


async def one_request(engine: AsyncEngine, i: int, rng: random.Random, adapters: list, tally: dict) -> None:
    prompt = [rng.randrange(3, 300) for _ in range(rng.randint(1, 40))]
    params = random_params(rng)
    lora = None
    if adapters and rng.random() < 0.4:
        k = rng.randrange(len(adapters))
        lora = LoRARequest(f"a{k}", k + 1, str(adapters[k]))
    fate = rng.choices(["finish", "abort", "abort_nowait", "cancel_admission"], [50, 20, 20, 10])[0]
    request_id = f"r{i}"
    add = asyncio.ensure_future(engine.add_request(request_id, prompt, params, priority=rng.randint(-2, 2),
                                                   lora_request=lora))
    if fate == "cancel_admission":
        await asyncio.sleep(0)
        add.cancel()
        try:
            await add
        except asyncio.CancelledError:
            tally["cancelled"] += 1
            return
        fate = "abort_nowait"  # admitted before the cancel landed: the client is gone anyway
    stream = await add
    if fate == "finish":
        await stream.done.wait()
        assert stream.error is None
        for c in stream.output.outputs:
            assert c.finish_reason in ("stop", "length") and 1 <= len(c.token_ids) <= params.max_tokens
        tally["finished"] += 1
        return
    await asyncio.sleep(rng.uniform(0, 0.02))
    if fate == "abort":
        await engine.abort(request_id)
    else:
        engine.abort_nowait(request_id)
    tally["aborted"] += 1


def assert_nothing_left(engine: AsyncEngine) -> None:
    engine.scheduler.check_invariants()
    stats = engine.stats()
    assert (stats["num_requests_running"], stats["num_requests_waiting"], stats["kv_cache_usage_perc"]) == (0, 0, 0.0)
    assert stats["kv_free_blocks"] + stats["kv_cached_blocks"] == engine.worker.num_kv_blocks - 1  # block 0 is null
    core = engine.engine_core
    assert not core.requests and not core.pending_forks and not core.fork_parent
    assert {type(p).__name__: p.held() for p in core.participants if p.held()} == {}
    assert not engine.output_processor._streams and not engine.output_processor._samples
    proposer = engine.worker.proposer
    if proposer is not None:  # the draft model's per-request KV bookkeeping
        assert not proposer.num_computed and not proposer.draft_probs
    assert engine.engine_core.receive_nowait() is None and engine.output_processor.receive_nowait() is None


CONFIGS = {
    "plain": dict(),
    "ngram_lora": dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3}, enable_lora=True,
                       max_loras=2),
    "draft_model": dict(speculative_config={"method": "draft_model", "num_speculative_tokens": 3}),
}


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.asyncio
async def test_random_lifecycle_leaves_nothing_behind(name, llama_dir, adapter_dirs):
    config = dict(CONFIGS[name])
    if name == "draft_model":  # the model drafts for itself: same tokenizer, full acceptance at T=0
        config["speculative_config"] = config["speculative_config"] | {"model": str(llama_dir)}
    engine = AsyncEngine(EngineConfig(model=str(llama_dir), block_size=4, num_kv_blocks=96, max_num_seqs=16,
                                      max_num_batched_tokens=64, **config))
    await engine.start()
    rng = random.Random(zlib.crc32(name.encode()))
    tally = {"finished": 0, "aborted": 0, "cancelled": 0}
    adapters = adapter_dirs if config.get("enable_lora") else []
    gate = asyncio.Semaphore(IN_FLIGHT)

    async def gated(i: int) -> None:
        async with gate:
            await one_request(engine, i, random.Random(rng.random()), adapters, tally)

    try:
        await asyncio.wait_for(asyncio.gather(*(gated(i) for i in range(CYCLES))), timeout=600)
        await asyncio.wait_for(engine.wait_idle(), timeout=30)
        await asyncio.sleep(0.05)  # let the last posted aborts and outputs drain
        assert sum(tally.values()) == CYCLES and min(tally.values()) > 0, tally
        assert engine.system.alive
        assert_nothing_left(engine)
        if name != "plain":
            assert engine.stats()["spec_decode_num_drafts"] > 0
        assert engine.stats()["num_preemptions"] > 0  # 96 blocks of 4 cannot hold 16 sequences' growth
    finally:
        await engine.stop()


@pytest.mark.asyncio
async def test_aborting_the_only_speculating_request_frees_the_drafts_state(llama_dir):
    """The step after such an abort schedules nothing: the draft model must still forget it."""
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "model": str(llama_dir)}
    engine = AsyncEngine(EngineConfig(model=str(llama_dir), block_size=4, num_kv_blocks=256, speculative_config=spec))
    await engine.start()
    try:
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        stream = await engine.add_request("only", list(range(5, 25)), params)
        while len(stream.output.outputs[0].token_ids) < 12:
            await asyncio.sleep(0.005)
        assert engine.worker.proposer.num_computed  # it has been drafting
        await engine.abort("only")
        await asyncio.wait_for(engine.wait_idle(), timeout=10)
        await asyncio.sleep(0.05)
        assert_nothing_left(engine)
    finally:
        await engine.stop()
