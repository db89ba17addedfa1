"""The draft-model proposer: a smaller model with the target's tokenizer runs k tokens ahead.

It keeps its own paged KV tensors, laid out like the target's and addressed through the same
block tables and slots (a draft block is the draft's KV of the target's block). It does not run
every step: each request remembers how many of its tokens the draft has computed, and a proposal
first feeds the draft every token since then (the whole prompt the first time; a prefix-cache hit
of the target is recomputed by the draft, writing identical values into the shared block), then
k - 1 of its own guesses. A request that is behind (a new prompt; steps at depth 0) is caught up
before the proposal, timed apart (`catch_up_seconds`). When every request is greedy and the
draft runs on the CPU kernels (fp32 on a CPU), the guesses come from one `_core.greedy_decode`
call (model/whole_model.py): each draft forward then costs its arithmetic, not the interpreter's
dispatch around it. The KV of the guesses the target then accepts is kept (`accepted`: they are
the request's tokens now), so the next proposal starts after them. Steps where the engine chose
depth 0 therefore cost the draft nothing. The distribution each guess was drawn from is kept for
the verification of the next step.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from pyserve.model.attention import AttentionMetadata
from pyserve.model.config import ModelConfig
from pyserve.model.decode_graphs import DecodeGraphs
from pyserve.model.kv_cache import allocate_kv_cache, copy_blocks
from pyserve.model.loader import load_model
from pyserve.model.quantized_linear import quantize_linears
from pyserve.model.noise import NoiseKey
from pyserve.model.cpu_linear import can_use, use_cpu_linears
from pyserve.model.sampler import Sampler, SamplingRows
from pyserve.model.step_buffers import DecodeRows, StepBuffers
from pyserve.model.whole_model import FEED_ROWS, WholeModel
from pyserve.speculative.proposer import ProposalBatch


class DraftModelProposer:
    def __init__(self, model_dir: str, cfg: ModelConfig, *, dtype, device, num_blocks: int, block_size: int,
                 quantization: str | None, quantization_group_size: int,
                 max_model_len: int, backend, sampler: Sampler, graphs_for_batch: int | None = None):
        """`quantization` the target's (quantized at load as it is); `graphs_for_batch`: the draft's
        one-token steps of up to this many requests replay CUDA graphs (model.decode_graphs); None:
        they run op by op."""
        self.device = device
        self.block_size = block_size
        self.max_model_len = max_model_len
        # NOTE: a GGUF draft serves its file's blocks as they are (gguf_dequantize widens the target).
        self.model = load_model(model_dir, cfg, dtype, device, max_model_len, gguf_dequantize=False)
        self.model.fuse_projections()  # the draft serves no LoRA
        if quantization is not None:
            quantize_linears(self.model, quantization, quantization_group_size)
        if can_use(device, dtype):
            use_cpu_linears(self.model)
            self.model.use_cpu_ops()
        self.kv_caches = allocate_kv_cache(cfg, num_blocks, block_size, dtype, device)
        self.whole_model = WholeModel.of(self.model, self.kv_caches)
        self.backend = backend
        self.decode_graphs = None if graphs_for_batch is None else DecodeGraphs(
            self.model, self.kv_caches, StepBuffers(device, graphs_for_batch), -(-max_model_len // block_size))
        self.sampler = sampler
        self.num_computed: dict[int, int] = {}  # request id -> its tokens in the draft's KV
        self.fed_guesses: dict[int, int] = {}  # request id -> guesses fed after those, awaiting verification
        self.draft_probs: dict[int, torch.Tensor] = {}  # request id -> [k, V] f32 of its drafts
        self.catch_up_seconds = 0.0  # of the last proposal, catching up requests that were behind

    def copy_blocks(self, pairs: torch.Tensor) -> None:
        copy_blocks(self.kv_caches, pairs)

    def forget(self, request_ids: list[int]) -> None:
        for rid in request_ids:
            self.num_computed.pop(rid, None)
            self.fed_guesses.pop(rid, None)
            self.draft_probs.pop(rid, None)

    def accepted(self, request_id: int, num_accepted: int) -> None:
        """The verification kept the request's first `num_accepted` drafts: the KV the draft
        computed for the guesses among them is valid."""
        fed = self.fed_guesses.pop(request_id, 0)
        if request_id in self.num_computed:
            self.num_computed[request_id] += min(num_accepted, fed)

    def take_draft_probs(self, request_id: int, num_drafts: int) -> torch.Tensor | None:
        """The distributions of the request's first `num_drafts` pending drafts ([n, V]); None
        when its drafts are not this model's (a grammar's forced tokens)."""
        probs = self.draft_probs.pop(request_id, None)
        return None if probs is None else probs[:num_drafts]

    @torch.inference_mode()
    def propose(self, batch: ProposalBatch, seeds: list[int | None]) -> list[list[int]]:
        """Up to batch.k guesses per request; a seeded request's guess at sequence index t reads
        the keyed noise the target's sampling of index t reads (model.noise)."""
        reqs, bs = batch.requests, self.block_size
        capacity = (batch.block_tables > 0).sum(axis=1) * bs  # slots each request owns
        seqs = batch.token_ids
        lens = np.array([len(s) for s in seqs], dtype=np.int64)
        # Depth per request: the j-th forward writes position len - 1 + j, which must own a slot
        # and lie inside the model length.
        depth = np.minimum(batch.k, np.minimum(capacity, self.max_model_len) - lens + 1).clip(min=0)
        starts = np.array([min(self.num_computed.get(r.internal_id, 0), len(s) - 1) for r, s in zip(reqs, seqs)])
        self.catch_up_seconds = self._catch_up(reqs, seqs, starts, batch.block_tables, batch.k)
        ids = np.concatenate([np.asarray(s[b:], dtype=np.int32) for s, b in zip(seqs, starts)])
        positions = np.concatenate([np.arange(b, n, dtype=np.int64) for b, n in zip(starts, lens)])
        row = np.repeat(np.arange(len(reqs)), lens - starts)
        qsl = np.concatenate([[0], np.cumsum(lens - starts)]).astype(np.int32)
        greedy = all(r.params.greedy for r in reqs)  # the draft's guess is its argmax: no sampling state
        keys = [None if seed is None else NoiseKey(seed, int(n)) for seed, n in zip(seeds, lens)]
        rows = None if greedy else SamplingRows.build([r.params for r in reqs], keys, [[]] * len(reqs),
                                                      [[]] * len(reqs), None, self.device)
        if greedy and self.whole_model is not None:
            return self._propose_greedy(reqs, ids, positions, row, qsl, lens, batch.block_tables, depth)
        logits = self._forward(ids, positions, row, batch.block_tables, lens.astype(np.int32), qsl,
                               last=qsl[1:] - 1)
        for r, n in zip(reqs, lens):
            self.num_computed[r.internal_id] = int(n)
            self.fed_guesses[r.internal_id] = 0
        drafts: list[list[int]] = [[] for _ in reqs]
        probs: list[list[torch.Tensor]] = [[] for _ in reqs]
        pos = lens - 1  # position of the token fed last
        for j in range(int(depth.max(initial=0))):
            q, tokens = self._guess(logits, rows, j)
            for i in np.flatnonzero(depth > j):
                drafts[i].append(int(tokens[i]))
                probs[i].append(q[i])
            feed = np.flatnonzero(depth > j + 1)
            if not len(feed):
                break
            for i in feed.tolist():
                self.fed_guesses[reqs[i].internal_id] += 1
            pos = pos + 1
            step = self._decode(tokens[feed], pos[feed], batch.block_tables[feed])
            if len(feed) == len(reqs):
                logits = step
            else:  # rows stay aligned with `rows`; unfed rows are unused
                logits = torch.zeros_like(logits)
                logits[torch.from_numpy(feed).to(self.device)] = step
        for r, p in zip(reqs, probs):
            if p:
                self.draft_probs[r.internal_id] = torch.stack(p)
        return drafts

    def _propose_greedy(self, reqs, ids, positions, row, qsl, lens, block_tables, depth) -> list[list[int]]:
        """Every guess an argmax, in `_core.greedy_decode`; more rows to feed than
        `FEED_ROWS` (a large batch) go through the model's forward first, its argmax the
        first guess."""
        tables = np.ascontiguousarray(block_tables, dtype=np.int32)
        if len(ids) <= FEED_ROWS:
            guesses = self.whole_model.greedy(ids, positions, row, tables, depth)
        else:
            logits = self._forward(ids, positions, row, tables, lens.astype(np.int32), qsl, last=qsl[1:] - 1)
            first = logits.argmax(dim=-1).numpy().astype(np.int32)
            more = np.flatnonzero(depth > 1)
            rest = self.whole_model.greedy(first[more], lens[more], more, tables, np.where(depth > 1, depth - 1, 0))
            guesses = np.concatenate([first[:, None], rest], axis=1)
        for r, n, d in zip(reqs, lens, depth):
            self.num_computed[r.internal_id] = int(n)
            self.fed_guesses[r.internal_id] = max(int(d) - 1, 0)
        return [g[:d].tolist() for g, d in zip(guesses, depth)]

    def _catch_up(self, reqs, seqs, starts: np.ndarray, block_tables: np.ndarray, k: int) -> float:
        """Feeds each request that is behind (the draft has no state of it: a new prompt, a
        preempted request; or it has more than k + 1 tokens to feed: the draft sat out steps at
        depth 0) all its tokens but the last, before the proposal, and moves its `starts` to that
        last token: a cost of the steps the draft did not run, timed apart so that the depth
        controller leaves it out of the cost of a proposal. Returns the seconds it took."""
        behind = [i for i, (r, s) in enumerate(zip(reqs, seqs))
                  if len(s) - 1 > starts[i] and (r.internal_id not in self.num_computed or len(s) - starts[i] > k + 1)]
        if not behind:
            return 0.0
        start = time.perf_counter()
        ends = np.array([len(seqs[i]) - 1 for i in behind])
        counts = ends - starts[behind]
        ids = np.concatenate([np.asarray(seqs[i][starts[i]:e], dtype=np.int32) for i, e in zip(behind, ends)])
        positions = np.concatenate([np.arange(starts[i], e, dtype=np.int64) for i, e in zip(behind, ends)])
        qsl = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        self._forward(ids, positions, np.repeat(np.arange(len(behind)), counts), block_tables[behind],
                      ends.astype(np.int32), qsl, last=qsl[1:] - 1)
        starts[behind] = ends
        return time.perf_counter() - start

    def _guess(self, logits: torch.Tensor, rows: SamplingRows | None, j: int) -> tuple[torch.Tensor, np.ndarray]:
        """(q [B, V], the j-th guess drawn from each row of q); rows None: every request is greedy,
        q is one-hot at the argmax."""
        if rows is None:
            tokens = logits.argmax(dim=-1, keepdim=True)
            return torch.zeros_like(logits).scatter_(1, tokens, 1.0), tokens.squeeze(1).cpu().numpy()
        q = self.sampler.probs(logits, rows)
        return q, (q / self.sampler.exponential(q, rows, offset=j)).argmax(dim=-1).cpu().numpy()

    def _decode(self, ids: np.ndarray, positions: np.ndarray, block_tables: np.ndarray) -> torch.Tensor:
        """Logits of one token per request (request i's at positions[i]): a replayed graph where
        the draft has them."""
        n = len(ids)
        if self.decode_graphs is None:
            return self._forward(ids.astype(np.int32), positions, np.arange(n), block_tables,
                                 (positions + 1).astype(np.int32), np.arange(n + 1, dtype=np.int32), last=np.arange(n))
        step = DecodeRows(ids, positions, self._slots(block_tables, np.arange(n), positions), positions + 1, block_tables)
        return self.model.compute_logits(self.decode_graphs.run(step))

    def _slots(self, block_tables: np.ndarray, row: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """The KV slot of each position, row[i]'s table holding positions[i]."""
        bs = self.block_size
        return block_tables[row, positions // bs].astype(np.int64) * bs + positions % bs

    def _forward(self, ids, positions, row, block_tables, seq_lens, qsl, last) -> torch.Tensor:
        slots = self._slots(block_tables, row, positions)
        meta = AttentionMetadata.build(slots, np.ascontiguousarray(block_tables), seq_lens, qsl, self.device)
        hidden = self.model(torch.from_numpy(ids).to(self.device), torch.from_numpy(positions).to(self.device),
                            self.kv_caches, meta, self.backend)
        return self.model.compute_logits(hidden[torch.from_numpy(np.asarray(last, dtype=np.int64)).to(self.device)])
