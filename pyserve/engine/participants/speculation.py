"""Speculative decoding's part in the step: after the step's tokens went out, the Speculator
accounts for the verified drafts, picks the next depth and proposes the next step's drafts."""

from __future__ import annotations

from pyserve.engine.participants.base import Step, StepParticipant
from pyserve.speculative.speculator import Speculator
from pyserve.step.request import EngineRequest


class Speculation(StepParticipant):
    def __init__(self, speculator: Speculator):
        self.speculator = speculator

    def drop(self, req: EngineRequest) -> None:
        self.speculator.forget([req.internal_id])

    async def after_output(self, step: Step) -> None:
        num_output = step.out.num_output_tokens + step.update.num_appended
        drafts = await self.speculator.after_step(step.out, step.num_sampled, num_output, step.seconds,
                                                  set(step.finished), step.requests, step.token_ids)
        step.drafts.update(drafts)
        step.speculated = bool(self.speculator.last_depth)

    def stats(self) -> dict[str, float | int]:
        return self.speculator.stats()
