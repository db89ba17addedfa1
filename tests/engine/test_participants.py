"""The step's participants (engine/participants): a part added to the EngineCore is called at
the step's fixed points, sees every request come and go, and what it hands back (drafts here)
is what the core acts on."""

from __future__ import annotations

import asyncio

from pyserve import SamplingParams
from pyserve.config import EngineConfig
from pyserve.engine.async_engine import AsyncEngine
from pyserve.engine.core import EngineCore
from pyserve.engine.participants import Step, StepParticipant

PROMPT = [5, 6, 7, 8, 9]
MAX_TOKENS = 16


class Oracle(StepParticipant):
    """Proposes, as the next step's drafts, the next 4 tokens of an answer known beforehand."""

    def __init__(self, answer: list[int]):
        self.answer = answer
        self.added, self.dropped, self.steps, self.kept = [], [], 0, []

    def add(self, req, is_fork):
        self.added.append(req.internal_id)

    def drop(self, req):
        self.dropped.append(req.internal_id)

    def before_forward(self, step: Step):
        self.steps += 1

    def after_update(self, step: Step):
        u = step.update
        self.kept += [list(u.token_ids[u.starts[i] : u.starts[i + 1]]) for i in range(len(u.req_ids))]

    async def after_output(self, step: Step):
        done = sum(map(len, self.kept))
        for rid in step.update.req_ids:
            if rid not in step.finished:
                step.drafts[rid] = self.answer[done : done + 4]


def _engine(llama_dir) -> AsyncEngine:
    return AsyncEngine(EngineConfig(model=str(llama_dir), device="cpu", block_size=4, num_kv_blocks=64,
                                    watchdog_timeout=None), own_thread=False)


async def _generate(engine: AsyncEngine) -> list[int]:
    await engine.start()
    try:
        stream = await engine.add_request("r", PROMPT, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                                       ignore_eos=True))
        await asyncio.wait_for(stream.done.wait(), 60)
    finally:
        await engine.stop()
    return list(stream.output.outputs[0].token_ids)


async def test_a_participants_drafts_are_verified_and_it_sees_the_request_come_and_go(llama_dir):
    answer = await _generate(_engine(llama_dir))
    assert len(answer) == MAX_TOKENS

    engine = _engine(llama_dir)
    core = engine.engine_core
    oracle = Oracle(answer)
    engine.engine_core = EngineCore(core.scheduler, core.worker, core.output_processor, [*core.participants, oracle],
                                    core.step_budget, core.background)
    got = await _generate(engine)

    assert got == answer  # drafts verified, never taken on trust
    assert sum(oracle.kept, []) == answer
    # 1 prefill step, then every step keeps its 4 drafts and one more token: 3 steps for the other 15
    assert oracle.steps == 4 and [len(k) for k in oracle.kept] == [1, 5, 5, 5]
    assert oracle.added == oracle.dropped and len(oracle.added) == 1
