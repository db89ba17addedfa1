"""Prompt logprobs (SamplingParams.prompt_logprobs) of requests being prefilled, gathered chunk
by chunk: row j holds prompt token j + 1's logprob given the tokens before it, its rank and the
top alternatives. A chunk recomputed after a preemption writes the same rows again. Forks share
their parent's prompt: only the parent gathers."""

from __future__ import annotations

import numpy as np

from pyserve.engine.participants.base import Step, StepParticipant
from pyserve.step.request import EngineRequest, Logprobs, PromptRows


class PromptLogprobs:
    """One request's rows, filled as its prompt's chunks are computed."""

    def __init__(self, prompt_len: int, num_top: int):
        n = prompt_len - 1
        self.num_top = num_top
        self.rows = Logprobs(np.zeros((n, num_top), np.float32), np.zeros((n, num_top), np.int64),
                             np.zeros(n, np.float32), np.zeros(n, np.int64))
        self.filled = np.zeros(n, dtype=bool)

    def write(self, token_indices: np.ndarray, logprobs: Logprobs) -> None:
        """Rows for prompt tokens `token_indices` (each >= 1)."""
        rows = token_indices - 1
        self.rows.top[rows], self.rows.top_token_ids[rows] = logprobs.top, logprobs.top_token_ids
        self.rows.sampled[rows], self.rows.sampled_ranks[rows] = logprobs.sampled, logprobs.sampled_ranks
        self.filled[rows] = True

    @property
    def complete(self) -> bool:
        return bool(self.filled.all())


class PromptLogprobsGathering(StepParticipant):
    def __init__(self):
        self.buffers: dict[int, PromptLogprobs] = {}  # requests prefilling with prompt logprobs

    def add(self, req: EngineRequest, is_fork: bool) -> None:
        if req.params.prompt_logprobs is not None and not is_fork:
            self.buffers[req.internal_id] = PromptLogprobs(len(req.prompt_token_ids), req.params.prompt_logprobs)

    def drop(self, req: EngineRequest) -> None:
        self.buffers.pop(req.internal_id, None)

    def before_forward(self, step: Step) -> None:
        if not self.buffers:
            return
        index = [i for i, rid in enumerate(step.req_ids) if rid in self.buffers]
        if index:
            reqs = [step.requests[step.req_ids[i]] for i in index]
            step.prompt_rows = PromptRows(index, [r.prompt_token_ids for r in reqs],
                                          [r.params.prompt_logprobs for r in reqs])

    def after_update(self, step: Step) -> None:
        """Writes the step's rows; the requests whose prompts are done (their first token came
        this step) hand theirs to the step's output and leave."""
        if step.prompt_rows is None:
            return
        for i, (token_indices, logprobs) in zip(step.prompt_rows.index, step.result.prompt_logprobs, strict=True):
            buffer = self.buffers.get(step.req_ids[i])
            if buffer is not None and len(token_indices):
                buffer.write(token_indices, logprobs)
        done = {}
        for rid in step.update.req_ids:
            buffer = self.buffers.get(rid)
            if buffer is not None and buffer.complete:
                done[rid] = self.buffers.pop(rid).rows
        step.prompt_logprobs = done or None

    def held(self) -> int:
        return len(self.buffers)
