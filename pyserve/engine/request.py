"""The engine's view of one sample of one request, and the messages actors exchange about it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import numpy as np

from pyserve.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class EngineRequest:
    """One sequence the scheduler runs. A request with `n > 1` has n of them, one per sample."""

    internal_id: int  # the Rust scheduler's id
    request_id: str  # the user's id, shared by the samples of one request
    index: int  # sample index within the request
    params: SamplingParams
    prompt_token_ids: list[int]
    stop_token_ids: list[int]  # params.stop_token_ids plus EOS unless ignore_eos (for min_tokens)
    output_token_ids: list[int] = field(default_factory=list)
    adapter_id: int = 0  # LoRA adapter (0 = the base model)
    # Output length from which a step's token is the plain argmax of the logits (see
    # SamplingParams.plain_greedy); None when it never is. Kept so the check costs one compare.
    argmax_from: int | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.params.plain_greedy:
            self.argmax_from = self.params.min_tokens

    def argmax_only(self) -> bool:
        """True when this step's token is the plain argmax of the logits."""
        return self.argmax_from is not None and len(self.output_token_ids) >= self.argmax_from

    def banned_token_ids(self) -> list[int]:
        """Tokens that must not be sampled yet: stop tokens before `min_tokens` outputs."""
        if len(self.output_token_ids) < self.params.min_tokens:
            return self.stop_token_ids
        return []


class RequestRefused(ValueError):
    """The scheduler can never serve this request as given; `field` names the field at fault
    (the scheduler's names: prompt_token_ids, max_tokens, min_tokens, ...)."""

    def __init__(self, message: str, field: str | None):
        super().__init__(message)
        self.field = field


@dataclass(slots=True)
class Add:
    """Queue a sequence. `accepted` resolves once the scheduler took it (or refused it: a
    ValueError naming the field)."""

    request: EngineRequest
    accepted: asyncio.Future[None]
    max_tokens: int | None
    stop_token_ids: list[int]  # the user's plus the model's extra EOS ids
    eos_token_id: int | None
    priority: int = 0
    adapter_id: int = 0
    cache_salt: str = ""


@dataclass(slots=True)
class Abort:
    internal_id: int


# The per-token logprob arrays a step may carry (StepResult, StepOutput, SampleDelta), row-aligned
# with its tokens.
LOGPROB_FIELDS = ("logprobs", "logprob_token_ids", "sampled_logprobs", "sampled_ranks")


@dataclass(slots=True)
class SampleDelta:
    """New tokens of one sequence from one step."""

    internal_id: int
    token_ids: list[int]
    finish_reason: str | None  # set when the scheduler finished it this step
    num_cached_tokens: int | None = None  # set on the first delta
    logprobs: np.ndarray | None = None  # [len(token_ids), K] top-k logprobs
    logprob_token_ids: np.ndarray | None = None
    sampled_logprobs: np.ndarray | None = None  # [len(token_ids)]
    sampled_ranks: np.ndarray | None = None


@dataclass(slots=True)
class StepOutput:
    """One step's new tokens, column-wise (no object per sequence on the hot path): sequence
    `internal_ids[i]` got `token_ids[starts[i]:starts[i + 1]]`. The logprob arrays, present when
    any row asked for logprobs, have one row per entry of `token_ids`."""

    internal_ids: list[int]
    token_ids: list[int]
    starts: list[int]
    finish_reasons: dict[int, str]  # the sequences the scheduler finished this step
    num_cached_tokens: dict[int, int]  # for sequences getting their first tokens
    logprobs: np.ndarray | None = None
    logprob_token_ids: np.ndarray | None = None
    sampled_logprobs: np.ndarray | None = None
    sampled_ranks: np.ndarray | None = None

    def delta(self, i: int) -> SampleDelta:
        """Sequence i's part of the step as one SampleDelta."""
        lo, hi = self.starts[i], self.starts[i + 1]
        rid = self.internal_ids[i]
        delta = SampleDelta(rid, self.token_ids[lo:hi], self.finish_reasons.get(rid), self.num_cached_tokens.get(rid))
        if self.logprobs is not None:
            for name in LOGPROB_FIELDS:
                setattr(delta, name, getattr(self, name)[lo:hi])
        return delta
