"""Structured output's part in the step: the constrained rows' masks computed on the grammar's
thread while the forward runs, each matcher fed the tokens the step kept (a sequence whose
matcher cannot follow them fails), and the tokens a grammar forces next sent as drafts."""

from __future__ import annotations

import numpy as np
import structlog

from pyserve.engine.participants.base import Step, StepParticipant
from pyserve.speculative.proposer import tree_parents_of
from pyserve.speculative.speculator import can_speculate
from pyserve.step.request import EngineRequest
from pyserve.structured.matchers import GrammarMatchers, MaskRow

log = structlog.get_logger("pyserve.engine")

MAX_FORCED_TOKENS = 32  # forced tokens one step verifies for a request


class GrammarStep(StepParticipant):
    def __init__(self, matchers: GrammarMatchers, forced_tokens: bool = True):
        self.matchers = matchers
        self.forced_tokens = forced_tokens  # tokens a grammar forces go out as drafts of the next step
        self.num_forced_tokens = 0

    def add(self, req: EngineRequest, is_fork: bool) -> None:
        if req.grammar is not None:
            self.matchers.add(req.internal_id, req.grammar)

    def drop(self, req: EngineRequest) -> None:
        if req.grammar is not None:
            self.matchers.drop(req.internal_id)

    def before_forward(self, step: Step) -> None:
        """Starts the masks of the constrained rows: each one's first logits row, and the
        drafts its further logits rows verify (the input token after each row's position)."""
        if not self.matchers:
            return
        out = step.out
        counts = out.num_logits[step.with_logits]
        firsts = np.cumsum(counts) - counts
        mask_rows = []
        for i, req, first, count, written in zip(np.flatnonzero(step.with_logits).tolist(), step.rows.requests,
                                                 firsts.tolist(), counts.tolist(), step.rows.num_output):
            if req.internal_id in self.matchers:
                drafts = out.input_ids[out.logits_indices[first + 1 : first + count]].tolist() if count > 1 else []
                max_tokens = req.params.max_tokens
                left = None if max_tokens is None else max_tokens - written
                tree = tree_parents_of(out, i)
                mask_rows.append(MaskRow(req.internal_id, first, drafts, left, None if tree is None else tree.tolist()))
        if mask_rows:
            step.rows.token_masks = self.matchers.start_masks(mask_rows)

    def after_update(self, step: Step) -> None:
        """Feeds each constrained request's matcher the tokens the step kept; one whose matcher
        could not follow them fails, with why. One whose JSON a closing mask ended (its budget
        ran out) finishes with "length", not "stop"."""
        if not self.matchers:
            return
        update = step.update
        tokens, starts = update.token_ids, update.starts
        paths = (step.result.tree_paths if step.result is not None else None) or {}
        path_of = {step.rows.requests[i].internal_id: path.tolist() for i, path in paths.items()}
        for i, rid in enumerate(update.req_ids):
            why = self.matchers.advance(rid, tokens[starts[i] : starts[i + 1]], path_of.get(rid)) \
                if rid in self.matchers else None
            if why is not None:
                log.warning("grammar_failed", internal_id=rid, reason=why)
                step.failures[rid] = why
            elif step.finished.get(rid) == "stop" and self.matchers.closed_by_budget(rid):
                step.closed_by_budget.add(rid)

    async def after_output(self, step: Step) -> None:
        """The tokens each constrained request's grammar forces next become its drafts, checked
        all in the next step instead of one step per token: a draft whose mask allows it alone
        is kept unverified; one whose bytes the tokenizer could also split otherwise is
        verified like any draft (so the output is what one token per step writes). Where the
        speculator drafted, it merged them itself."""
        if not self.matchers or not self.forced_tokens or step.speculated:
            return
        for rid in step.update.req_ids:
            req = step.requests.get(rid)
            if req is None or rid not in self.matchers or not can_speculate(req, 0):
                continue
            forced = self.matchers.forced_tokens(rid)[:MAX_FORCED_TOKENS]
            if forced:
                step.drafts[rid] = forced
                self.num_forced_tokens += len(forced)

    def held(self) -> int:
        return len(self.matchers)

    def stats(self) -> dict[str, float | int]:
        return {"grammar_forced_tokens": self.num_forced_tokens}

