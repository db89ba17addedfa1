"""The interface every optional part of the step shares, and the step they read and add to.

The EngineCore keeps the loop (schedule, forward, update, forks, aborts, the output); a feature
that takes part in every step is a StepParticipant instead of a branch of that loop. Each hook
a participant overrides is called, in the order the participants were given:
- `add` / `drop`: a request arrives (a fork too) / leaves (finished, aborted or failed);
- `before_forward`: adds the worker's inputs to the step (masks, adapter ids, prompt rows);
- `after_update`: the scheduler kept the step's tokens; the requests that finished are still
  held; may add failures (they leave the scheduler) and what the step's output carries;
- `after_output` (async): the step's output went out; may propose the next step's drafts.
Participants hand back data on the Step; only the EngineCore calls the scheduler.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pyserve.speculative.proposer import DraftTree
from pyserve.step.request import EngineRequest, Logprobs, PromptRows, StepResult, StepRows


@dataclass(slots=True)
class Step:
    out: Any  # the scheduler's SchedulerOutput
    req_ids: list[int]  # the scheduled requests, in the step's order
    rows: StepRows  # the requests that sample (the worker's rows)
    with_logits: np.ndarray  # per scheduled request: whether it samples
    requests: dict[int, EngineRequest]  # the EngineCore's live requests (read only)
    token_ids: Callable[..., list[int]]  # a request's tokens (from a start), read from the scheduler
    adapter_ids: np.ndarray | None = None  # per scheduled request; None: LoRA disabled
    prompt_rows: PromptRows | None = None
    result: StepResult | None = None
    seconds: float = 0.0  # the worker's time for the step
    num_sampled: np.ndarray | None = None  # per scheduled request
    update: Any = None  # the scheduler's update: the tokens it kept, by request
    finished: dict[int, str] = field(default_factory=dict)  # request -> finish reason
    failures: dict[int, str] = field(default_factory=dict)  # request -> why it failed
    closed_by_budget: set[int] = field(default_factory=set)  # stopped, their JSON closed for want of tokens
    prompt_logprobs: dict[int, Logprobs] | None = None  # of prompts whose first token came now
    drafts: dict[int, list[int] | DraftTree] = field(default_factory=dict)  # to verify next step
    speculated: bool = False  # the speculator chose a depth > 0 after this step


class StepParticipant:
    """An optional part of the step; every hook does nothing unless overridden."""

    def add(self, req: EngineRequest, is_fork: bool) -> None:
        pass

    def drop(self, req: EngineRequest) -> None:
        pass

    def before_forward(self, step: Step) -> None:
        pass

    def after_update(self, step: Step) -> None:
        pass

    async def after_output(self, step: Step) -> None:
        pass

    def held(self) -> int:
        """How many requests it holds state for (0 once every request left)."""
        return 0

    def stats(self) -> dict[str, float | int]:
        """Its counters, by the names /metrics publishes."""
        return {}


def overriding(participants: list[StepParticipant], hook: str) -> list[Callable]:
    """The bound `hook` of each participant that overrides it: the step calls no empty hook."""
    default = getattr(StepParticipant, hook)
    return [getattr(p, hook) for p in participants if getattr(type(p), hook) is not default]
