"""Penalties read a row's output so far: the rows that have them get it on StepRows."""

from __future__ import annotations

from pyserve.engine.participants.base import Step, StepParticipant
from pyserve.step.request import EngineRequest


class OutputTokens(StepParticipant):
    def __init__(self):
        self.num_needing_output = 0  # live requests whose penalties read their output

    def add(self, req: EngineRequest, is_fork: bool) -> None:
        self.num_needing_output += req.needs_output

    def drop(self, req: EngineRequest) -> None:
        self.num_needing_output -= req.needs_output

    def before_forward(self, step: Step) -> None:
        if self.num_needing_output:
            token_ids = step.token_ids
            step.rows.output_token_ids = [token_ids(r.internal_id, len(r.prompt_token_ids)) if r.needs_output
                                          else None for r in step.rows.requests]

    def held(self) -> int:
        return self.num_needing_output
