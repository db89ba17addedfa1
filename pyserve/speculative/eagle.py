"""The EAGLE proposer: an EAGLE-3 head (speculative/eagle_head.py) drafting from the hidden states the
target's own forward produced, with no second pass of the target.

After every target step (`record`), the positions whose next token is now known become pairs (the
target's features at p, the token at p + 1): a prompt chunk's positions with the prompt's next
tokens, a decoding row's position with its sampled token, a verifying row's positions up to the last
accepted draft with the tokens the verification kept. A chunk's last position, whose next token
comes with the next chunk, waits for it (`held`). Recording costs no head forward: a step keeps a
reference to its features and index arrays (`RecordedStep`), so steps at depth 0 cost next to
nothing. A proposal first feeds the head each candidate's pairs recorded since its last feed, in one
forward (so the head's KV holds every position from real features; drafted positions are rewritten
when their real features arrive), then chains its guesses from the head's output at the newest
token, as the draft model does, or grows a token tree from it (speculative/eagle_tree.py; a verified
tree's kept rows are recorded at the positions after the last token). A request that sat out
proposals (depth 0) for more than RECORDED_STEPS steps (or RECORDED_BYTES of features) loses its
oldest pairs: their head KV stays as it was, as does that of positions a prefix-cache hit skipped
(the cached block's first computation wrote it); a guess may be worse there, never wrong (the target
verifies every draft). Feeding a request more than k + 1 pairs (a new prompt, steps at depth 0) is
timed apart (`catch_up_seconds`).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from pyserve.model.attention import AttentionMetadata
from pyserve.model.config import ModelConfig
from pyserve.model.kv_cache import allocate_kv_cache, copy_blocks
from pyserve.model.noise import NoiseKey
from pyserve.model.sampler import Sampler, SamplingRows
from pyserve.model.whole_model import FEED_ROWS
from pyserve.speculative.eagle_head import EagleHead
from pyserve.speculative.eagle_kernel import eagle_greedy, head_view
from pyserve.speculative.eagle_tree import OFF_CHAIN_MOST, grow_trees
from pyserve.speculative.proposer import DraftTree, ProposalBatch

RECORDED_STEPS = 64  # target steps whose pairs are kept for feeding
RECORDED_BYTES = 256 << 20  # and at most these bytes of their features (long prompts' chunks are large)


@dataclass(slots=True)
class RecordedStep:
    """One target step's pairs: pair j is request `requests[j]`'s position `positions[j]` (in
    increasing positions per request), its features `features[rows[j]]`, its next token `tokens[j]`."""

    features: torch.Tensor
    requests: np.ndarray
    positions: np.ndarray
    rows: np.ndarray
    tokens: np.ndarray

    @property
    def nbytes(self) -> int:
        """Bytes of its features (what keeping it holds)."""
        return self.features.numel() * self.features.element_size()


class EagleProposer:
    def __init__(self, head: EagleHead, embedding: torch.nn.Module, *, num_blocks: int, block_size: int,
                 max_model_len: int, backend, sampler: Sampler, device: torch.device, dtype: torch.dtype):
        self.head = head
        self.embedding = embedding  # the tokens' embedding the head reads (the target's, or its own)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.backend = backend
        self.sampler = sampler
        self.device = device
        c: ModelConfig = head.config.layer
        self.kv_caches = allocate_kv_cache(c, num_blocks, block_size, dtype, device)
        self.target_ids = head.target_ids()
        self.view = head_view(head, embedding)  # None: the head runs op by op
        self.steps: deque[RecordedStep] = deque()
        self.held: dict[int, tuple[int, torch.Tensor]] = {}  # request -> (a chunk's last position, its features)
        self.fed_to: dict[int, int] = {}  # request -> the last position the head was fed
        self.recorded_bytes = 0  # of the kept steps' features
        self.draft_probs: dict[int, torch.Tensor] = {}  # request -> [k, V] f32 of its drafts
        self.forgotten: set[int] = set()  # requests whose recorded pairs are still to be dropped
        self.catch_up_seconds = 0.0  # of the last proposal, feeding requests that were behind

    def copy_blocks(self, pairs: torch.Tensor) -> None:
        copy_blocks(self.kv_caches, pairs)

    def forget(self, request_ids: list[int]) -> None:
        """The requests finished or were preempted: their recorded pairs go too (a preempted
        request is recorded again as it is recomputed), taken out of the record at once before
        the next record or proposal (a batch's requests finish one by one)."""
        for rid in request_ids:
            self.held.pop(rid, None)
            self.fed_to.pop(rid, None)
            self.draft_probs.pop(rid, None)
        self.forgotten.update(request_ids)

    def _drop_forgotten(self) -> None:
        if not self.forgotten:
            return
        gone = np.fromiter(self.forgotten, dtype=np.int64)
        self.forgotten.clear()
        for i, step in enumerate(self.steps):
            keep = ~np.isin(step.requests, gone)
            if not keep.all():
                self.steps[i] = RecordedStep(step.features, step.requests[keep], step.positions[keep],
                                             step.rows[keep], step.tokens[keep])

    def accepted(self, request_id: int, num_accepted: int) -> None:
        """Nothing to keep: `record` takes the kept positions from the step's real features."""

    def take_draft_probs(self, request_id: int, num_drafts: int) -> torch.Tensor | None:
        probs = self.draft_probs.pop(request_id, None)
        return None if probs is None else probs[:num_drafts]

    def record(self, out, features: torch.Tensor, num_sampled: np.ndarray, sampled: np.ndarray,
               tree_paths: dict[int, np.ndarray] | None = None) -> None:
        """Keeps the step's pairs whose next token is known. `features`: the target's aux hidden
        states of every scheduled token; `num_sampled`/`sampled`: the StepResult's, for the
        requests with logits in order; `tree_paths`: its rows kept of each token tree (by the
        same order)."""
        self._drop_forgotten()
        n = out.num_reqs
        if len(out.input_ids) == n and len(num_sampled) == n:  # a decode step: one pair a request
            self._keep(RecordedStep(features, out.req_ids.astype(np.int64), out.positions.astype(np.int64),
                                    np.arange(n), np.asarray(sampled, dtype=np.int64)))
            return
        qsl = out.query_start_loc
        with_logits = np.flatnonzero(out.num_logits > 0)
        counts = np.zeros(n, dtype=np.int64)
        counts[with_logits] = num_sampled
        ends = np.zeros(n, dtype=np.int64)
        ends[with_logits] = np.cumsum(num_sampled)
        paths = {int(with_logits[i]): path for i, path in (tree_paths or {}).items()}
        extra, requests, positions, rows, tokens = [], [], [], [], []
        for i, rid in enumerate(out.req_ids.tolist()):
            lo, hi = int(qsl[i]), int(qsl[i + 1])
            ids, pos = out.input_ids[lo:hi], out.positions[lo:hi]
            held = self.held.pop(rid, None)
            if counts[i]:  # the real tokens' next are the input's; then the sampled ones
                nxt = np.concatenate([ids[1 : hi - lo - int(out.num_spec_tokens[i])],
                                      sampled[ends[i] - counts[i] : ends[i]]])
            else:  # a prompt chunk: its last position waits for the next chunk's first token
                nxt = ids[1:]
                self.held[rid] = (int(pos[-1]), features[hi - 1 : hi].clone())
            if held is not None and held[0] == int(pos[0]) - 1:
                rows.append(np.array([len(features) + len(extra)]))
                extra.append(held[1])
                requests.append(np.array([rid]))
                positions.append(pos[:1] - 1)
                tokens.append(ids[:1])
            path = paths.get(i)
            if path is not None:  # a token tree: the kept rows, at the positions after its last token
                rows.append(lo + path)
                positions.append(pos[0] + np.arange(len(path)))
            else:
                rows.append(np.arange(lo, lo + len(nxt)))
                positions.append(pos[: len(nxt)])
            requests.append(np.full(len(nxt), rid))
            tokens.append(nxt)
        if extra:
            features = torch.cat([features, *extra])
        self._keep(RecordedStep(features, np.concatenate(requests).astype(np.int64),
                                np.concatenate(positions).astype(np.int64), np.concatenate(rows),
                                np.concatenate(tokens).astype(np.int64)))

    def _keep(self, step: RecordedStep) -> None:
        self.steps.append(step)
        self.recorded_bytes += step.nbytes
        while len(self.steps) > RECORDED_STEPS or (self.recorded_bytes > RECORDED_BYTES and len(self.steps) > 1):
            self.recorded_bytes -= self.steps.popleft().nbytes

    def _unfed(self, request_ids: list[int]) -> tuple[torch.Tensor, np.ndarray, np.ndarray, np.ndarray]:
        """(features, tokens, positions, the request's index in `request_ids`) of every recorded
        pair of those requests not yet fed, grouped by request in increasing positions."""
        index = {rid: i for i, rid in enumerate(request_ids)}
        lookup = np.array(request_ids, dtype=np.int64)
        parts = []
        for step in self.steps:
            mine = np.isin(step.requests, lookup)
            if not mine.any():
                continue
            theirs = step.requests[mine].tolist()
            which = np.array([index[r] for r in theirs])
            after = np.array([self.fed_to.get(r, -1) for r in theirs])
            new = step.positions[mine] > after
            if not new.any():
                continue
            rows = step.rows[mine][new]
            parts.append((step.features[torch.from_numpy(rows).to(step.features.device)],
                          step.tokens[mine][new], step.positions[mine][new], which[new]))
        if not parts:
            return torch.empty(0), np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.int64)
        features = torch.cat([p[0] for p in parts])
        tokens, positions, which = (np.concatenate([p[i] for p in parts]) for i in (1, 2, 3))
        order = np.lexsort((positions, which))
        return features[torch.from_numpy(order).to(features.device)], tokens[order], positions[order], which[order]

    def _runs(self, request_ids: list[int]) -> tuple[torch.Tensor, np.ndarray, np.ndarray, np.ndarray]:
        """`_unfed`, each request's pairs cut to one run of positions ending at its newest (pairs
        dropped from the front of the record leave a gap: only the run after it is fed)."""
        features, tokens, positions, which = self._unfed(request_ids)
        if not len(which):
            return features, tokens, positions, which
        breaks = np.r_[True, (which[1:] != which[:-1]) | (positions[1:] != positions[:-1] + 1)]
        run = np.cumsum(breaks)
        keep = np.isin(run, run[np.r_[which[1:] != which[:-1], True]])
        return features[torch.from_numpy(keep)], tokens[keep], positions[keep], which[keep]

    def _feed(self, request_ids: list[int], block_tables: np.ndarray) -> dict[int, tuple[int, torch.Tensor]]:
        """Feeds the head the requests' unfed pairs; returns each fed request's newest pair's
        position and the head's output there."""
        features, tokens, positions, which = self._runs(request_ids)
        if not len(which):
            return {}
        hidden = self._forward(features, tokens, positions, which, block_tables)
        ends = np.flatnonzero(np.r_[which[1:] != which[:-1], True])
        states = {}
        for e in ends.tolist():
            rid = request_ids[which[e]]
            self.fed_to[rid] = int(positions[e])
            states[rid] = (int(positions[e]), hidden[e : e + 1])
        return states

    def _forward(self, hidden: torch.Tensor, tokens: np.ndarray, positions: np.ndarray, rows: np.ndarray,
                 block_tables: np.ndarray) -> torch.Tensor:
        """The head over rows (request rows[j]'s pair at positions[j], in increasing positions per
        request, each request's rows together), writing their KV."""
        starts = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]])
        qsl = np.r_[starts, len(rows)].astype(np.int32)
        seq_lens = (positions[qsl[1:] - 1] + 1).astype(np.int32)
        tables = np.ascontiguousarray(block_tables[rows[starts]])
        meta = AttentionMetadata.build(self._slots(block_tables, rows, positions), tables, seq_lens, qsl, self.device)
        return self._run_head(hidden, tokens, positions, meta)

    def _slots(self, block_tables: np.ndarray, rows: np.ndarray, slot_positions: np.ndarray) -> np.ndarray:
        """int64: the cache slot of position `slot_positions[i]` in the table `block_tables[rows[i]]`."""
        bs = self.block_size
        return block_tables[rows, slot_positions // bs].astype(np.int64) * bs + slot_positions % bs

    def _run_head(self, hidden: torch.Tensor, tokens: np.ndarray, positions: np.ndarray,
                  meta: AttentionMetadata) -> torch.Tensor:
        """The head over rows laid out by `meta`: `hidden` and the embedding of `tokens` at `positions`."""
        dev = self.device
        embeds = self.embedding(torch.from_numpy(np.asarray(tokens, dtype=np.int64)).to(dev))
        return self.head(hidden, embeds, torch.from_numpy(positions).to(dev), self.kv_caches[0], meta, self.backend)

    @torch.inference_mode()
    def propose(self, batch: ProposalBatch, seeds: list[int | None]) -> list[list[int] | DraftTree]:
        """Up to batch.k guesses per request whose head output is current (its last pair is at its
        newest token); a seeded request's guess at sequence index t reads the keyed noise the
        target's sampling of index t reads (model.noise)."""
        self._drop_forgotten()
        reqs, bs = batch.requests, self.block_size
        lens = np.array([len(s) for s in batch.token_ids], dtype=np.int64)
        capacity = (batch.block_tables > 0).sum(axis=1) * bs
        depth = np.minimum(batch.k, np.minimum(capacity, self.max_model_len) - lens + 1).clip(min=0)
        if batch.max_nodes and batch.node_price < OFF_CHAIN_MOST:  # else no draft off the chain could pay
            return self._propose_trees(batch, lens, depth, np.minimum(capacity, self.max_model_len))
        if self.view is not None and all(r.params.greedy for r in reqs):
            drafts = self._propose_in_kernel([r.internal_id for r in reqs], lens, batch.block_tables, depth, batch.k)
            if drafts is not None:
                return drafts
        states, depth, live = self._fed(batch, lens, depth)
        drafts: list[list[int]] = [[] for _ in reqs]
        if not len(live):
            return drafts
        greedy = all(reqs[i].params.greedy for i in live)
        rows = None if greedy else SamplingRows.build(
            [reqs[i].params for i in live], [None if seeds[i] is None else NoiseKey(seeds[i], int(lens[i])) for i in live],
            [[]] * len(live), [[]] * len(live), None, self.device)
        hidden = torch.cat([states[i][1] for i in live])
        logits = self.head.draft_logits(hidden)
        probs: list[list[torch.Tensor]] = [[] for _ in reqs]
        pos = lens[live] - 2  # each request's newest pair, just fed
        for j in range(int(depth.max())):
            q, tokens = self._guess(logits, rows, j)
            guessing = np.flatnonzero(depth[live] > j)
            for a in guessing.tolist():
                drafts[live[a]].append(int(tokens[a]))
                probs[live[a]].append(q[a])
            feed = np.flatnonzero(depth[live] > j + 1)
            if not len(feed):
                break
            on = torch.from_numpy(feed).to(self.device)
            hidden = self._forward(hidden[on], tokens[feed], pos[feed] + j + 1, np.arange(len(feed)),
                                   batch.block_tables[live[feed]])
            step = self.head.draft_logits(hidden)
            if len(feed) == len(live):
                logits = step
            else:  # rows stay aligned with `rows`; rows no longer fed are unused
                logits = torch.zeros_like(logits)
                logits[on] = step
                full = torch.zeros((len(live), hidden.shape[1]), dtype=hidden.dtype, device=self.device)
                full[on] = hidden
                hidden = full
        for r, p in zip(reqs, probs):
            if p:
                self.draft_probs[r.internal_id] = torch.stack(p)
        return drafts

    def _fed(self, batch: ProposalBatch, lens: np.ndarray, depth: np.ndarray
             ) -> tuple[list[tuple[int, torch.Tensor] | None], np.ndarray, np.ndarray]:
        """Feeds the requests' unfed pairs op by op: (each request's newest pair's position and the
        head's output there, or None; `depth` left only for requests whose newest pair is at their
        newest token; the indices of those with depth)."""
        ids = [r.internal_id for r in batch.requests]
        fed = self._feed_all(ids, lens, batch.block_tables, batch.k)
        states = [fed.get(rid) for rid in ids]
        ready = np.array([s is not None and s[0] == n - 2 for s, n in zip(states, lens)])
        depth = np.where(ready, depth, 0)
        return states, depth, np.flatnonzero(depth > 0)

    def _propose_trees(self, batch: ProposalBatch, lens: np.ndarray, depth: np.ndarray,
                       limit: np.ndarray) -> list[list[int] | DraftTree]:
        """Token trees (speculative/eagle_tree.py) for every request whose head output is current,
        greedy or sampled alike (the tree's verification samples the target at every node)."""
        states, depth, live = self._fed(batch, lens, depth)
        drafts: list[list[int] | DraftTree] = [[] for _ in batch.requests]
        if not len(live):
            return drafts
        tables = batch.block_tables[live]
        pos0 = lens[live] - 2

        def forward(hidden, tokens, positions, slot_positions, requests, masks):
            return self._forward_rows(hidden, tokens, positions, slot_positions, tables[requests], masks)

        grown = grow_trees(forward, self._top_children, torch.cat([states[i][1] for i in live]), pos0, depth[live],
                           limit[live] - pos0 - 1, batch.node_price, batch.max_nodes)
        for i, tree in zip(live.tolist(), grown):
            drafts[i] = tree
        return drafts

    def _forward_rows(self, hidden: torch.Tensor, tokens: np.ndarray, positions: np.ndarray,
                      slot_positions: np.ndarray, block_tables: np.ndarray, masks: np.ndarray) -> torch.Tensor:
        """The head over rows that each attend as one decode row: row i's token at `positions[i]`,
        its keys written at slot position `slot_positions[i]` of its table `block_tables[i]`,
        seeing the keys up to there that `masks[i]` leaves."""
        slots = self._slots(block_tables, np.arange(len(tokens)), slot_positions)
        meta = AttentionMetadata.build(slots, np.ascontiguousarray(block_tables),
                                       (slot_positions + 1).astype(np.int32), np.arange(len(tokens) + 1, dtype=np.int32),
                                       self.device, masks=masks)
        return self._run_head(hidden, tokens, positions, meta)

    def _top_children(self, hidden: torch.Tensor, width: int) -> tuple[np.ndarray, np.ndarray]:
        """Each row's `width` likeliest next tokens by the head (target ids) and their
        log-probabilities, best first."""
        logprobs = torch.log_softmax(self.head.draft_logits(hidden), dim=-1)
        best, index = logprobs.topk(min(width, logprobs.shape[-1]), dim=-1)
        return self.target_ids[index].cpu().numpy(), best.cpu().numpy()

    def _propose_in_kernel(self, request_ids: list[int], lens: np.ndarray, block_tables: np.ndarray,
                           depth: np.ndarray, k: int) -> list[list[int]] | None:
        """Greedy guesses with the feed in one `_core.eagle_greedy` call; the pairs of requests more
        than k + 1 behind but each one's last go in a call before it, timed as catch-up. None
        (nothing fed) where more than FEED_ROWS pairs wait: the op-by-op feed is cheaper then."""
        features, tokens, positions, which = self._runs(request_ids)
        if len(which) > FEED_ROWS:
            return None
        self.catch_up_seconds = 0.0
        n = len(request_ids)
        if not len(which):
            return [[] for _ in range(n)]
        counts = np.bincount(which, minlength=n)
        last = np.r_[which[1:] != which[:-1], True]  # each request's newest pair
        newest = np.full(n, -1, dtype=np.int64)
        newest[which[last]] = positions[last]
        depth = np.where((counts > 0) & (newest == lens - 2), depth, 0)
        tables = np.ascontiguousarray(block_tables, dtype=np.int32)
        early = (counts[which] > k + 1) & ~last
        if early.any():
            start = time.perf_counter()
            on = torch.from_numpy(early)
            eagle_greedy(self.view, self.kv_caches[0], features[on], tokens[early], positions[early], which[early],
                         tables, np.zeros(n, dtype=np.int64))
            self.catch_up_seconds = time.perf_counter() - start
        rest = ~early
        guesses = eagle_greedy(self.view, self.kv_caches[0], features[torch.from_numpy(rest)], tokens[rest],
                               positions[rest], which[rest], tables, depth)
        for i in np.flatnonzero(counts).tolist():
            self.fed_to[request_ids[i]] = int(newest[i])
        self._drop_fed_steps()
        return [g[:d].tolist() for g, d in zip(guesses, depth)]

    def _feed_all(self, request_ids: list[int], lens: np.ndarray, block_tables: np.ndarray,
                  k: int) -> dict[int, tuple[int, torch.Tensor]]:
        """Feeds every request's unfed pairs; those of requests more than k + 1 pairs behind first,
        timed as catch-up."""
        behind = np.array([n - 2 - self.fed_to.get(rid, -1) > k + 1 for rid, n in zip(request_ids, lens)])
        self.catch_up_seconds = 0.0
        states = {}
        if behind.any():
            start = time.perf_counter()
            states = self._feed([request_ids[i] for i in np.flatnonzero(behind)], block_tables[behind])
            self.catch_up_seconds = time.perf_counter() - start
        if not behind.all():
            states |= self._feed([request_ids[i] for i in np.flatnonzero(~behind)], block_tables[~behind])
        self._drop_fed_steps()
        return states

    def _drop_fed_steps(self) -> None:
        """Drops the oldest recorded steps whose every pair has been fed (at small batches every
        proposal feeds them all: the record stays a step or two long)."""
        while self.steps:
            step = self.steps[0]
            fed = np.array([self.fed_to.get(r, -1) for r in step.requests.tolist()], dtype=np.int64)
            if not (step.positions <= fed).all():
                return
            self.recorded_bytes -= self.steps.popleft().nbytes

    def _guess(self, draft_logits: torch.Tensor, rows: SamplingRows | None, j: int) -> tuple[torch.Tensor, np.ndarray]:
        """(q [n, V] over the target's vocabulary, the j-th guess of each row); rows None:
        greedy, q one-hot at the argmax."""
        n, vocab = len(draft_logits), self.sampler.vocab_size
        if rows is None:
            best = self.target_ids[draft_logits.argmax(dim=-1)]
            q = torch.zeros((n, vocab), device=self.device).scatter_(1, best[:, None], 1.0)
            return q, best.cpu().numpy()
        logits = torch.full((n, vocab), float("-inf"), device=self.device)
        logits[:, self.target_ids] = draft_logits
        q = self.sampler.probs(logits, rows)
        return q, (q / self.sampler.exponential(q, rows, offset=j)).argmax(dim=-1).cpu().numpy()
