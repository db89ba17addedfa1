"""Token trees from an EAGLE head (EAGLE-2's dynamic trees): the head's likeliest guesses grown a
depth at a time, then the drafts worth a verification row kept.

A candidate is a guess with its score, the log-probability the head gives its whole path. Depth 1
holds the `width` likeliest tokens after the request's newest token. Each further depth feeds the
head the `width` best-scored candidates of the depth before, plus the tail of the likeliest chain
(the best child of the best child ...), each beside its parent's output at the position after
its parent's, and takes each one's `width` likeliest children. The head attends to the request's
real features and to its own guesses on the candidate's path only: each fed candidate's keys go
to a slot of its own after the newest pair (its expansion index), seen only by its descendants
(AttentionMetadata masks). Kept: the likeliest chain to the depth asked for (what a chain
proposer would have drafted, first, so that when the target keeps it nothing moves), then the
other candidates by score while the head's chance for them, exp(score), is above the price of a
verification row, up to `max_nodes` drafts; a candidate is kept only with its parent.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from pyserve.speculative.proposer import DraftTree

TREE_WIDTH = 4  # children taken per fed candidate, and candidates fed per depth besides the chain's
# The most the head's chance for a draft off the likeliest chain can be: where it leaves the
# chain, a sibling at least as likely is on it. A row priced at this or more keeps chains only.
OFF_CHAIN_MOST = 0.5
MAX_EXPANSIONS = 63  # head slots a growth uses past the newest pair (a row's mask covers 64 keys)
ALL_BITS = 2**64 - 1


@dataclass(slots=True)
class _Growth:
    """One request's candidates (parent -1: the request's newest token)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    slot: dict[int, int] = field(default_factory=dict)  # fed candidate -> its expansion index
    hidden: dict[int, tuple[int, int]] = field(default_factory=dict)  # fed candidate -> (output, row)
    chain: list[int] = field(default_factory=list)  # the likeliest chain's candidates

    def add_children(self, parent: int, tokens: np.ndarray, logprobs: np.ndarray) -> None:
        """`parent`'s children (best first); the chain goes on through its tail's best child."""
        base = self.scores[parent] if parent >= 0 else 0.0
        depth = self.depths[parent] + 1 if parent >= 0 else 1
        if parent == (self.chain[-1] if self.chain else -1):
            self.chain.append(len(self.tokens))
        for t, lp in zip(tokens.tolist(), logprobs.tolist()):
            self.tokens.append(t)
            self.parents.append(parent)
            self.scores.append(base + lp)
            self.depths.append(depth)

    def frontier(self, depth: int, width: int) -> list[int]:
        """The candidates of `depth` to feed: the best `width` by score and the chain's tail."""
        at = [c for c in range(len(self.tokens)) if self.depths[c] == depth]
        best = sorted(at, key=lambda c: -self.scores[c])[:width]
        tail = self.chain[-1] if len(self.chain) == depth else None
        return best + [tail] if tail is not None and tail not in best else best

    def mask(self, candidate: int) -> int:
        """Keys its fed row sees, bit b for the key b slots back: itself, its fed ancestors, and
        every key before the growth's first slot."""
        e = self.slot[candidate]
        bits = (ALL_BITS << (e + 1)) & ALL_BITS | 1
        c = self.parents[candidate]
        while c >= 0:
            bits |= 1 << (e - self.slot[c])
            c = self.parents[c]
        return bits

    def tree(self, depth: int, price: float, max_nodes: int) -> list[int] | DraftTree:
        """The drafts kept (module doc): a chain as a list, else a DraftTree."""
        chain = self.chain[:depth]
        kept = set(chain)
        extra = []
        others = sorted((c for c in range(len(self.tokens)) if c not in kept and self.depths[c] <= depth),
                        key=lambda c: (-self.scores[c], self.depths[c]))
        for c in others:
            if len(kept) >= max_nodes or math.exp(self.scores[c]) <= price:
                break
            if self.parents[c] < 0 or self.parents[c] in kept:
                kept.add(c)
                extra.append(c)
        if not extra:
            return [self.tokens[c] for c in chain]
        order = chain + sorted(extra, key=lambda c: (self.depths[c], -self.scores[c]))
        index = {c: j for j, c in enumerate(order)}
        parents = [0 if self.parents[c] < 0 else index[self.parents[c]] + 1 for c in order]
        return DraftTree([self.tokens[c] for c in order], parents)


def grow_trees(
    forward: Callable[[torch.Tensor, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray], torch.Tensor],
    top_children: Callable[[torch.Tensor, int], tuple[np.ndarray, np.ndarray]],
    hidden0: torch.Tensor,
    pos0: np.ndarray,
    depth: np.ndarray,
    room: np.ndarray,
    price: float,
    max_nodes: int,
    width: int = TREE_WIDTH,
) -> list[list[int] | DraftTree]:
    """Per request r: drafts grown from `hidden0[r]`, the head's output at its newest pair
    (position `pos0[r]`), at most `depth[r]` deep, feeding at most `room[r]` candidates.
    `forward(hidden, tokens, positions, slot_positions, requests, masks)` runs the head over
    rows (request `requests[i]`'s candidate `tokens[i]` at `positions[i]`, its keys written at
    the request's `slot_positions[i]`, seeing the keys `masks[i]` leaves); `top_children(hidden,
    width)` gives each row's `width` likeliest next tokens (target ids) and their log-probabilities,
    best first."""
    growths = [_Growth() for _ in range(len(pos0))]
    outputs = [hidden0]
    tokens, logprobs = top_children(hidden0, width)
    for r, g in enumerate(growths):
        if depth[r] > 0:
            g.add_children(-1, tokens[r], logprobs[r])
    room = np.minimum(room, MAX_EXPANSIONS)
    for d in range(1, int(depth.max(initial=0))):
        rows: list[tuple[int, int]] = []
        for r, g in enumerate(growths):
            if depth[r] > d:
                for c in g.frontier(d, width):
                    if len(g.slot) < room[r]:
                        g.slot[c] = len(g.slot)
                        rows.append((r, c))
        if not rows:
            break
        features = []
        for r, c in rows:
            parent = growths[r].parents[c]
            out, row = growths[r].hidden[parent] if parent >= 0 else (0, r)
            features.append(outputs[out][row])
        requests = np.array([r for r, _ in rows], dtype=np.int64)
        fed = np.array([growths[r].tokens[c] for r, c in rows], dtype=np.int64)
        slots = np.array([pos0[r] + 1 + growths[r].slot[c] for r, c in rows], dtype=np.int64)
        masks = np.array([growths[r].mask(c) for r, c in rows], dtype=np.uint64)
        hidden = forward(torch.stack(features), fed, pos0[requests] + d, slots, requests, masks)
        outputs.append(hidden)
        tokens, logprobs = top_children(hidden, width)
        for i, (r, c) in enumerate(rows):
            growths[r].hidden[c] = (len(outputs) - 1, i)
            growths[r].add_children(c, tokens[i], logprobs[i])
    return [g.tree(int(depth[r]), price, max_nodes) if depth[r] > 0 else [] for r, g in enumerate(growths)]
