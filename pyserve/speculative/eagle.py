"""The EAGLE proposer: an EAGLE-3 head (speculative/eagle_head.py) drafting from the hidden states
the target's own forward produced, with no second pass of the target.

After every target step (`extend`), the head is fed each position whose next token is now known:
a prompt chunk's positions with the prompt's next tokens, a decoding row's position with its
sampled token, a verifying row's positions up to the last accepted draft with the tokens the
verification kept. So its KV holds the pairs (the target's features at p, the token at p + 1) of
every position the request has, computed from real features, whatever depth the engine chose
(drafted positions are rewritten when their real features arrive). A chunk's last position, whose
next token comes with the next chunk, waits for it (`pending`). Positions a prefix-cache hit skips
keep the head KV the cached block's first computation wrote: a guess may be worse there, never
wrong (the target verifies every draft).

The head's output at the last pair (the request's newest token) is kept; `propose` turns it into
the first guess and feeds each guess back for the next, as the draft model does.
"""

from __future__ import annotations

import numpy as np
import torch

from pyserve.model.attention import AttentionMetadata
from pyserve.model.config import ModelConfig
from pyserve.model.kv_cache import allocate_kv_cache, copy_blocks
from pyserve.model.noise import NoiseKey
from pyserve.model.sampler import Sampler, SamplingRows
from pyserve.speculative.eagle_head import EagleHead
from pyserve.speculative.proposer import ProposalBatch


class EagleProposer:
    catch_up_seconds = 0.0  # the head is fed inside every target step, never behind

    def __init__(self, head: EagleHead, embedding: torch.nn.Module, *, num_blocks: int, block_size: int, max_model_len: int, backend,
                 sampler: Sampler, device: torch.device, dtype: torch.dtype):
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
        self.pending: dict[int, tuple[int, torch.Tensor]] = {}  # request -> (a chunk's last position, its features)
        self.last: dict[int, tuple[int, torch.Tensor]] = {}  # request -> (its last pair's position, the head's output)
        self.draft_probs: dict[int, torch.Tensor] = {}  # request -> [k, V] f32 of its drafts

    def copy_blocks(self, pairs: torch.Tensor) -> None:
        copy_blocks(self.kv_caches, pairs)

    def forget(self, request_ids: list[int]) -> None:
        for rid in request_ids:
            self.pending.pop(rid, None)
            self.last.pop(rid, None)
            self.draft_probs.pop(rid, None)

    def accepted(self, request_id: int, num_accepted: int) -> None:
        """Nothing to keep: `extend` feeds the kept positions from the step's real features."""

    def take_draft_probs(self, request_id: int, num_drafts: int) -> torch.Tensor | None:
        probs = self.draft_probs.pop(request_id, None)
        return None if probs is None else probs[:num_drafts]

    @torch.inference_mode()
    def extend(self, out, features: torch.Tensor, num_sampled: np.ndarray, sampled: np.ndarray) -> None:
        """Feeds the head the step's positions whose next token is known. `features`: the target's
        aux hidden states of every scheduled token; `num_sampled`/`sampled`: the StepResult's,
        for the requests with logits in order."""
        qsl = out.query_start_loc
        with_logits = np.flatnonzero(out.num_logits > 0)
        counts = np.zeros(out.num_reqs, dtype=np.int64)
        counts[with_logits] = num_sampled
        ends = np.zeros(out.num_reqs, dtype=np.int64)
        ends[with_logits] = np.cumsum(num_sampled)
        pieces, tokens, positions, rows, sample_rows = [], [], [], [], []
        fed = 0
        for i, rid in enumerate(out.req_ids.tolist()):
            lo, hi = int(qsl[i]), int(qsl[i + 1])
            ids, pos = out.input_ids[lo:hi], out.positions[lo:hi]
            held = self.pending.pop(rid, None)
            if counts[i]:  # the real tokens' next are the input's; then the sampled ones
                nxt = np.concatenate([ids[1 : hi - lo - int(out.num_spec_tokens[i])],
                                      sampled[ends[i] - counts[i] : ends[i]]])
            else:  # a prompt chunk: its last position waits for the next chunk's first token
                nxt = ids[1:]
                self.pending[rid] = (int(pos[-1]), features[hi - 1 : hi])
            if held is not None and held[0] == int(pos[0]) - 1:
                pieces.append(held[1])
                tokens.append(ids[:1])
                positions.append(pos[:1] - 1)
                rows.append(np.full(1, i))
                fed += 1
            if len(nxt):
                pieces.append(features[lo : lo + len(nxt)])
                tokens.append(nxt)
                positions.append(pos[: len(nxt)])
                rows.append(np.full(len(nxt), i))
                fed += len(nxt)
            if counts[i]:
                sample_rows.append((rid, fed - 1))
        if not pieces:
            return
        positions = np.concatenate(positions).astype(np.int64)
        rows = np.concatenate(rows)
        hidden = self._forward(torch.cat(pieces), np.concatenate(tokens), positions, rows, out.block_tables)
        for rid, r in sample_rows:
            self.last[rid] = (int(positions[r]), hidden[r : r + 1])

    def _forward(self, hidden: torch.Tensor, tokens: np.ndarray, positions: np.ndarray, rows: np.ndarray,
                 block_tables: np.ndarray) -> torch.Tensor:
        """The head over rows (request rows[j]'s pair at positions[j], in increasing positions per
        request, each request's rows together), writing their KV."""
        bs = self.block_size
        slots = block_tables[rows, positions // bs].astype(np.int64) * bs + positions % bs
        starts = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]])
        qsl = np.r_[starts, len(rows)].astype(np.int32)
        seq_lens = (positions[qsl[1:] - 1] + 1).astype(np.int32)
        tables = np.ascontiguousarray(block_tables[rows[starts]])
        meta = AttentionMetadata.build(slots, tables, seq_lens, qsl, self.device)
        dev = self.device
        embeds = self.embedding(torch.from_numpy(np.asarray(tokens, dtype=np.int64)).to(dev))
        return self.head(hidden, embeds, torch.from_numpy(positions).to(dev), self.kv_caches[0], meta, self.backend)

    @torch.inference_mode()
    def propose(self, batch: ProposalBatch, seeds: list[int | None]) -> list[list[int]]:
        """Up to batch.k guesses per request whose head output is current (its last pair is at its
        newest token); a seeded request's guess at sequence index t reads the keyed noise the
        target's sampling of index t reads (model.noise)."""
        reqs, bs = batch.requests, self.block_size
        lens = np.array([len(s) for s in batch.token_ids], dtype=np.int64)
        capacity = (batch.block_tables > 0).sum(axis=1) * bs
        depth = np.minimum(batch.k, np.minimum(capacity, self.max_model_len) - lens + 1).clip(min=0)
        states = [self.last.get(r.internal_id) for r in reqs]
        ready = np.array([s is not None and s[0] == n - 2 for s, n in zip(states, lens)])
        depth[~ready] = 0
        drafts: list[list[int]] = [[] for _ in reqs]
        live = np.flatnonzero(depth > 0)
        if not len(live):
            return drafts
        greedy = all(reqs[i].params.greedy for i in live)
        rows = None if greedy else SamplingRows.build(
            [reqs[i].params for i in live], [None if seeds[i] is None else NoiseKey(seeds[i], int(lens[i])) for i in live],
            [[]] * len(live), [[]] * len(live), None, self.device)
        hidden = torch.cat([states[i][1] for i in live])
        logits = self.head.draft_logits(hidden)
        probs: list[list[torch.Tensor]] = [[] for _ in reqs]
        pos = lens[live] - 2  # each request's last pair, fed by `extend`
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
