"""The engine side of speculative decoding: after each step, account for the verified drafts,
choose the depth for the next step and ask the proposer for drafts. No tensors here."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from pyserve.speculative.config import SpeculativeConfig
from pyserve.speculative.depth import DepthController
from pyserve.speculative.proposer import DraftTree, ProposalBatch, Proposer, row_depths, tree_parents_of
from pyserve.speculative.tree_choice import TreeChoice
from pyserve.step.request import EngineRequest
from pyserve.structured.matchers import GrammarMatchers


def can_speculate(req: EngineRequest, num_output: int) -> bool:
    """Verification samples every position from the same distribution, so requests whose
    distribution depends on their own output so far (penalties, a min_tokens ban), that bias
    logits (greedy verification reads the raw argmax) or that want logprobs decode plainly.
    `num_output`: the request's output tokens so far."""
    p = req.params
    return p.logprobs is None and not req.needs_output and num_output >= p.min_tokens and p.logit_bias is None


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, grammar: GrammarMatchers | None = None,
                 forced_tokens: bool = True):
        self.proposer = proposer
        self.grammar = grammar  # the EngineCore's matchers: drafts of constrained requests are cut to what they allow
        self.forced_tokens = forced_tokens  # and replaced by the grammar's forced tokens when those go further
        self.depth = DepthController(config.num_speculative_tokens, config.adaptive,
                                     has_draft_cost=config.method != "ngram")
        self.max_tree_nodes = config.tree_nodes  # 0: chains
        self.tree_choice = TreeChoice()
        # The last proposal, awaiting its verification step: (batch size, a tree?, its seconds).
        self.last_proposal: tuple[int, bool, float] | None = None
        self.num_trees = 0  # verifications of a token tree, and the drafts they held
        self.num_tree_nodes = 0
        self.num_drafts = 0  # request-steps that verified at least one draft
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        # By draft position: drafts verified there, and kept (the ones before them were kept too)
        self.drafted_per_position = [0] * config.num_speculative_tokens
        self.accepted_per_position = [0] * config.num_speculative_tokens
        self.last_depth = 0

    async def after_step(self, out, num_sampled: np.ndarray, num_output: np.ndarray, seconds: float,
                         finished: set[int], requests: dict[int, EngineRequest],
                         token_ids: Callable[[int], list[int]]) -> dict[int, list[int]]:
        """Per scheduled request: `num_sampled` tokens sampled (0 without logits), `num_output`
        output tokens after the step; `finished`: requests that ended this step; `token_ids`: a
        request's tokens (the EngineCore reads them from its scheduler). Returns the drafts to
        verify next step, by request (the EngineCore hands them to the scheduler)."""
        if (out.num_scheduled_tokens == 1 + out.num_spec_tokens).all():  # decode-only steps feed the cost model
            self.depth.observe_step(out.num_reqs, int(out.num_spec_tokens.sum()), seconds)
            if self.last_proposal is not None and self.last_proposal[0] == out.num_reqs:
                _, tree, proposal_seconds = self.last_proposal
                self.tree_choice.observe(out.num_reqs, tree, int(num_sampled.sum()), seconds + proposal_seconds)
        self.last_proposal = None
        for seq, (s, n) in enumerate(zip(out.num_spec_tokens.tolist(), num_sampled.tolist())):
            if s and n:
                tree = tree_parents_of(out, seq)
                depth = s if tree is None else int(row_depths(tree).max())  # a chain's depth is its length
                self.num_drafts += 1
                self.num_draft_tokens += s
                self.num_accepted_tokens += n - 1
                self.depth.observe_verification(depth, n - 1)
                if depth < s:
                    self.num_trees += 1
                    self.num_tree_nodes += s
                for j in range(min(depth, len(self.drafted_per_position))):
                    self.drafted_per_position[j] += 1
                    self.accepted_per_position[j] += j < n - 1
        gone = set(out.finished_req_ids.tolist()) | finished
        if gone:
            self.forget(sorted(gone))
        if out.preempted_req_ids.size:
            self.forget(out.preempted_req_ids.tolist())
        rows, candidates = [], []
        for i, (rid, n, n_out) in enumerate(zip(out.req_ids.tolist(), num_sampled.tolist(), num_output.tolist())):
            req = requests.get(rid)
            if n and req is not None and rid not in finished and can_speculate(req, n_out):
                rows.append(i)
                candidates.append(req)
        if not candidates:  # nothing to draft for: the depth last chosen stands
            return {}
        k = self.last_depth = self.depth.choose(out.num_reqs, len(candidates))
        if not k:
            return {}
        start = time.perf_counter()
        tokens_read = [token_ids(r.internal_id) for r in candidates] if self.proposer.reads_tokens else None
        batch = ProposalBatch(candidates, out.block_tables[rows], k, tokens_read)
        tree = bool(self.max_tree_nodes) and self.tree_choice.trees(out.num_reqs)
        if tree:
            batch.max_nodes = self.max_tree_nodes
            batch.node_price = self.depth.node_price(out.num_reqs, len(candidates), k)
        drafts = await self.proposer.propose(batch)
        elapsed = time.perf_counter() - start
        self.depth.charge(out.num_reqs, elapsed)
        seconds = elapsed - self.proposer.catch_up_seconds
        if self.max_tree_nodes:
            self.last_proposal = (out.num_reqs, tree, seconds)
        self.depth.observe_proposal(len(candidates), k, sum(min(len(d), k) for d in drafts), seconds)
        out_drafts: dict[int, list[int] | DraftTree] = {}
        for req, tokens in zip(candidates, drafts):
            if self.grammar is not None and req.internal_id in self.grammar and not isinstance(tokens, DraftTree):
                tokens = self._constrained(req.internal_id, list(tokens), k)  # a tree's refused drafts are masked
            if len(tokens):
                out_drafts[req.internal_id] = tokens
        return out_drafts

    def _constrained(self, internal_id: int, drafts: list[int], k: int) -> list[int]:
        """A constrained request's drafts: the proposer's as far as the grammar allows them, or
        the tokens the grammar forces when those reach further (a proposer that keeps state of
        its own drafts keeps them)."""
        valid = self.grammar.valid_drafts(internal_id, drafts)
        if not self.forced_tokens or not self.proposer.drafts_replaceable:
            return valid
        forced = self.grammar.forced_tokens(internal_id)[:k]
        return forced if len(forced) > len(valid) else valid

    def forget(self, request_ids: list[int]) -> None:
        """Drops the proposer's state of requests that finished, were aborted or preempted."""
        self.proposer.forget(request_ids)

    def stats(self) -> dict[str, float | int]:
        return speculation_stats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, self.last_depth,
                                 list(self.drafted_per_position), list(self.accepted_per_position),
                                 self.num_trees, self.num_tree_nodes)


def speculation_stats(num_drafts: int = 0, num_draft_tokens: int = 0, num_accepted_tokens: int = 0,
                      depth: int = 0, drafted_per_position: list[int] | None = None,
                      accepted_per_position: list[int] | None = None, num_trees: int = 0,
                      num_tree_nodes: int = 0) -> dict[str, float | int | list[int]]:
    """Speculation's statistics by their /metrics names (all 0, the per-position lists empty, for
    an engine that does not speculate). Per position: by depth (a token tree counts once at each
    of its depths)."""
    return {
        "spec_decode_num_drafts": num_drafts,
        "spec_decode_num_draft_tokens": num_draft_tokens,
        "spec_decode_num_accepted_tokens": num_accepted_tokens,
        "spec_decode_mean_acceptance_length": 1.0 + num_accepted_tokens / num_drafts if num_drafts else 0.0,
        "spec_decode_depth": depth,
        "spec_decode_num_draft_tokens_per_pos": drafted_per_position or [],
        "spec_decode_num_accepted_tokens_per_pos": accepted_per_position or [],
        "spec_decode_num_trees": num_trees,
        "spec_decode_num_tree_nodes": num_tree_nodes,
    }
