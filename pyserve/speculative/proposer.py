"""The proposer interface: after a step, make draft tokens for chosen decoding requests; the
engine hands them to the scheduler, which verifies them in the next step.

A proposer sees the requests (their token history) and each one's block table as of the step
just run, which includes the lookahead blocks the scheduler reserved for speculation. Methods
that need the target's tensors (a draft model; an EAGLE head, which reads the target's hidden
states) run inside the ModelWorker; n-gram lookup runs in the Rust scheduler. The scheduler never
knows which method made a draft.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from pyserve.step.request import EngineRequest


@dataclass(slots=True)
class ProposalBatch:
    requests: list[EngineRequest]  # the requests to propose for
    block_tables: np.ndarray  # int32 [len(requests), width]: each request's blocks (0 = none)
    k: int  # draft tokens wanted per request (a proposer may return fewer); a tree's depth
    # Each request's tokens (prompt, then output) as of the step just run, for a proposer that
    # `reads_tokens` (the scheduler holds them; None otherwise).
    token_ids: list[np.ndarray] | None = None
    # A proposer of token trees: at most this many drafts a tree (0: chains only), and the
    # chance of being kept a draft off the likeliest chain must have to be worth its row.
    max_nodes: int = 0
    node_price: float = 1.0


@dataclass(slots=True)
class DraftTree:
    """A token tree of drafts: `parents[j]` is 0 where draft j follows the request's last token,
    else i for draft i - 1 (always before j). Its likeliest chain comes first (draft j's parent
    is j for its first drafts), so that when the target keeps that chain nothing moves."""

    tokens: list[int]
    parents: list[int]

    def __len__(self) -> int:
        return len(self.tokens)


def row_depths(parents: np.ndarray) -> np.ndarray:
    """int64 per row of a token tree: its depth below the first row (0), from each row's parent
    row (-1 for the first; always an earlier row)."""
    depths = np.zeros(len(parents), dtype=np.int64)
    for j in range(1, len(parents)):
        depths[j] = depths[parents[j]] + 1
    return depths


def tree_parents_of(out, seq: int) -> np.ndarray | None:
    """Where scheduled request `seq` of a step (a SchedulerOutput) verifies a token tree, its
    rows' parents (rows within its tokens, -1 for the first), else None."""
    if not len(out.tree_parents):
        return None
    parents = out.tree_parents[out.query_start_loc[seq] : out.query_start_loc[seq + 1]]
    return parents.astype(np.int64) if (parents != np.arange(len(parents)) - 1).any() else None


class Proposer(Protocol):
    reads_tokens: bool  # wants ProposalBatch.token_ids
    drafts_replaceable: bool  # other drafts may be verified in place of its own (it keeps no state of them)
    # Seconds of the last proposal spent catching up on what the steps before it did not run (a
    # draft model fed a new prompt, or the tokens of steps at depth 0): left out of the
    # proposal's cost by depth.
    catch_up_seconds: float

    async def propose(self, batch: ProposalBatch) -> list[list[int] | DraftTree]:
        """Up to `batch.k` draft tokens per request, in order, or a tree of them (only where
        `batch.max_nodes` asks for trees)."""
        ...

    def forget(self, request_ids: list[int]) -> None:
        """Drop per-request state: the requests finished, or were preempted (their KV is gone)."""
        ...


class ModelProposer(Protocol):
    """What the ModelWorker needs of a proposer that runs inside it (a draft model, an EAGLE
    head): it proposes on the EngineCore's thread, keeps each guess's
    distribution for the verification, and hears how many of a request's drafts were kept."""

    def propose(self, batch: ProposalBatch, seeds: list[int | None]) -> list[list[int] | DraftTree]:
        """Draft tokens (or trees) per request; `seeds`: each request's noise seed (None: unseeded)."""
        ...

    def take_draft_probs(self, request_id: int, num_drafts: int):
        """The distributions ([num_drafts, V] tensor) the request's pending drafts were drawn
        from; None when the drafts did not come from it."""
        ...

    def accepted(self, request_id: int, num_accepted: int) -> None:
        """The verification kept the request's first `num_accepted` drafts."""
        ...

    catch_up_seconds: float  # see Proposer

    def copy_blocks(self, pairs) -> None:
        """Copy-on-write of KV blocks (the target's copies, mirrored in any KV it keeps)."""
        ...

    def forget(self, request_ids: list[int]) -> None:
        ...


class NgramProposer:
    """Prompt lookup: the continuation of the longest recent n-gram match in the request's own
    tokens. Runs in the Rust scheduler, on the tokens it already holds."""

    reads_tokens = False  # the lookup runs where the tokens are
    drafts_replaceable = True  # it keeps nothing about its drafts: others may be sent instead
    catch_up_seconds = 0.0

    def __init__(self, scheduler, min_n: int, max_n: int):
        self.scheduler = scheduler
        self.min_n, self.max_n = min_n, max_n

    async def propose(self, batch: ProposalBatch) -> list[list[int]]:
        k, lo, hi = batch.k, self.min_n, self.max_n
        return [self.scheduler.propose_ngram(r.internal_id, k, lo, hi) for r in batch.requests]

    def forget(self, request_ids: list[int]) -> None:
        pass


class WorkerProposer:
    """A proposer that lives in the ModelWorker (it owns tensors): it runs inline on the
    EngineCore's loop, as the worker's steps do."""

    reads_tokens = True
    drafts_replaceable = False  # the draft model computed KV for its own guesses

    def __init__(self, worker):
        self.worker = worker

    async def propose(self, batch: ProposalBatch) -> list[list[int] | DraftTree]:
        return self.worker.propose(batch)

    @property
    def catch_up_seconds(self) -> float:
        return self.worker.proposer.catch_up_seconds

    def forget(self, request_ids: list[int]) -> None:
        self.worker.proposer.forget(request_ids)
