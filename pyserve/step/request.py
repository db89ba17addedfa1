"""The engine's view of one sample of one request, and the messages actors exchange about it."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pyserve.step.sampling_params import SamplingParams
from pyserve.structured.compiler import Grammar


@dataclass(slots=True)
class EngineRequest:
    """One sequence the scheduler runs. A request with `n > 1` has n of them, one per sample.
    Its tokens live in the Rust scheduler only; a step hands out how many outputs each has."""

    internal_id: int  # the Rust scheduler's id
    request_id: str  # the user's id, shared by the samples of one request
    index: int  # sample index within the request
    params: SamplingParams
    prompt_token_ids: list[int]
    stop_token_ids: list[int]  # params.stop_token_ids plus EOS unless ignore_eos (for min_tokens)
    adapter_id: int = 0  # LoRA adapter (0 = the base model)
    grammar: Grammar | None = None  # the compiled constraint of params.structured_outputs
    # Output length from which a step's token is the plain argmax of the logits (see
    # SamplingParams.plain_greedy); None when it never is. Kept so the check costs one compare.
    argmax_from: int | None = field(init=False, default=None)
    # Penalties read the output so far: the step must hand it to the sampler.
    needs_output: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        p = self.params
        if p.plain_greedy:
            self.argmax_from = p.min_tokens
        self.needs_output = bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0)

    def argmax_only(self, num_output: int) -> bool:
        """True when the next token (after `num_output` outputs) is the plain argmax of the logits."""
        return self.argmax_from is not None and num_output >= self.argmax_from

    def banned_token_ids(self, num_output: int) -> list[int]:
        """Tokens that must not be sampled yet: stop tokens before `min_tokens` outputs."""
        if num_output < self.params.min_tokens:
            return self.stop_token_ids
        return []


@dataclass(slots=True)
class StepRows:
    """What the sampler needs of the requests that sample this step (row i: `requests[i]`):
    how many outputs each has, the outputs themselves for rows whose penalties read them
    (None elsewhere, or None for all when no row has penalties), and the grammar masks."""

    requests: list[EngineRequest]
    num_output: list[int]
    output_token_ids: list[np.ndarray | None] | None = None
    # The grammar masks of this step's constrained rows, being computed (structured.matchers).
    token_masks: Future | None = None

    def take(self, index) -> StepRows:
        outputs = None if self.output_token_ids is None else [self.output_token_ids[i] for i in index]
        return StepRows([self.requests[i] for i in index], [self.num_output[i] for i in index], outputs)


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
    # The request's other samples (n > 1): forked from `request` once its prompt is computed,
    # so that the prompt's KV is computed once and shared.
    forks: list[EngineRequest] = field(default_factory=list)


@dataclass(slots=True)
class Abort:
    internal_id: int


@dataclass(slots=True)
class Logprobs:
    """Logprobs of a run of tokens, one row per token: the top-K alternatives (descending) and
    the sampled token's own logprob and rank."""

    top: np.ndarray  # f32 [n, K]
    top_token_ids: np.ndarray  # int64 [n, K]
    sampled: np.ndarray  # f32 [n]
    sampled_ranks: np.ndarray  # int64 [n]

    def __getitem__(self, index) -> Logprobs:
        """The rows at `index` (a slice or an index array)."""
        return Logprobs(self.top[index], self.top_token_ids[index], self.sampled[index], self.sampled_ranks[index])

    def scattered(self, rows: np.ndarray, n: int) -> Logprobs:
        """These rows placed at `rows` of n zero rows (tokens without logprobs read zeros)."""
        out = []
        for a in (self.top, self.top_token_ids, self.sampled, self.sampled_ranks):
            full = np.zeros((n, *a.shape[1:]), dtype=a.dtype)
            full[rows] = a
            out.append(full)
        return Logprobs(*out)


@dataclass(slots=True)
class StepResult:
    """What the model worker sampled in one step, per request row with logits."""

    token_ids: np.ndarray  # int64, end to end: num_sampled[i] tokens for request row i
    num_sampled: np.ndarray  # int64 [rows]: 1, or accepted drafts + 1 for a verifying row
    logprobs: Logprobs | None = None  # one row per token, when any row asked
    # For each entry of the step's PromptRows: the prompt indices it scored and their logprobs.
    prompt_logprobs: list[tuple[np.ndarray, Logprobs]] | None = None
    # Per request row that verified a token tree: the rows of its step it kept (0, its last
    # token, then the accepted drafts' rows in order); their KV belongs at rows 0, 1, 2, ...
    tree_paths: dict[int, np.ndarray] | None = None


@dataclass(slots=True)
class PromptRows:
    """The scheduled requests of a step whose prompt tokens get logprobs: each one's index in
    the step, prompt and number of top alternatives."""

    index: list[int]
    prompts: list[list[int]]
    num_top: list[int]


@dataclass(slots=True)
class SampleDelta:
    """New tokens of one sequence from one step."""

    internal_id: int
    token_ids: list[int]
    finish_reason: str | None  # set when the scheduler finished it this step
    num_cached_tokens: int | None = None  # set on the first delta
    logprobs: Logprobs | None = None
    closed_by_budget: bool = False  # stopped, but its JSON was closed for want of tokens (json_close)


@dataclass(slots=True)
class StepOutput:
    """One step's new tokens, column-wise (no object per sequence on the hot path): sequence
    `internal_ids[i]` got `token_ids[starts[i]:starts[i + 1]]`. `logprobs`, present when any row
    asked for them, has one row per entry of `token_ids`."""

    internal_ids: list[int]
    token_ids: list[int]
    starts: list[int]
    finish_reasons: dict[int, str]  # the sequences the scheduler finished this step
    num_cached_tokens: dict[int, int]  # for sequences getting their first tokens
    logprobs: Logprobs | None = None
    # Sequences that failed this step (left the scheduler already), with why: their requests fail.
    failures: dict[int, str] | None = None
    reply_to: Any = None  # the actor (EngineCore) that takes the Aborts this step calls for
    # Sequences whose first token came this step and that asked for prompt logprobs: one row
    # per prompt token after the first.
    prompt_logprobs: dict[int, Logprobs] | None = None
    # Sequences that stopped this step with their JSON closed for want of tokens: they finish
    # with "length".
    closed_by_budget: set[int] | frozenset[int] = frozenset()

    def delta(self, i: int) -> SampleDelta:
        """Sequence i's part of the step as one SampleDelta."""
        lo, hi = self.starts[i], self.starts[i + 1]
        rid = self.internal_ids[i]
        logprobs = None if self.logprobs is None else self.logprobs[lo:hi]
        return SampleDelta(rid, self.token_ids[lo:hi], self.finish_reasons.get(rid), self.num_cached_tokens.get(rid),
                           logprobs, rid in self.closed_by_budget)
