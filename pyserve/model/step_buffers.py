"""Fixed device buffers for decode steps, so a step's inputs keep their addresses from one step to
the next (what a CUDA graph replays on).

A decode step of n requests is padded to the next batch bucket B (a power of two) and its block
tables to the next width bucket W (a power of two): rows n..B-1 are padding, with token 0 at
position 0, slot -1 (no KV is written) and context length 0 (attention gives zeros), and their
logits are dropped. Every tensor the forward reads is a view of a buffer allocated once (block
tables: one buffer per (B, W) bucket), filled by copies from the host (through pinned staging on
CUDA); nothing is allocated per step once the buckets were seen.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from pyserve.model.attention import AttentionMetadata


class DecodeRows(NamedTuple):
    """A decode step's arrays as `StepBuffers.stage` reads them (a SchedulerOutput has the same
    fields): one token per row."""

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray  # int32 [rows, width]


def bucket(n: int) -> int:
    """The smallest power of two >= n (n >= 1)."""
    return 1 << (n - 1).bit_length()


class StepBuffers:
    def __init__(self, device: torch.device, max_batch: int):
        self.device = device
        self.max_batch = bucket(max_batch)
        size = self.max_batch
        self.input_ids = self._pair(size, torch.int64)
        self.positions = self._pair(size, torch.int64)
        self.slots = self._pair(size, torch.int64)
        self.seq_lens = self._pair(size, torch.int32)
        self.query_start_loc = torch.arange(size + 1, dtype=torch.int32, device=device)  # one token a row
        self.query_start_loc_host = np.arange(size + 1, dtype=np.int32)
        self.tables: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def _pair(self, size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(host staging, device buffer); the same tensor on a CPU."""
        dev = torch.empty(size, dtype=dtype, device=self.device)
        if self.device.type != "cuda":
            return dev, dev
        return torch.empty(size, dtype=dtype, pin_memory=True), dev

    def stage(self, out) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, int]:
        """(input_ids, positions, metadata, batch bucket B) of a decode-only SchedulerOutput `out`
        (one token per request, every request with logits) or DecodeRows, padded to B rows."""
        n = len(out.input_ids)
        b = bucket(n)
        if b > self.max_batch:
            raise ValueError(f"a decode step of {n} requests exceeds the buffers' {self.max_batch}")
        width = out.block_tables.shape[1]
        w = bucket(max(width, 1))
        for (host, dev), values, pad in ((self.input_ids, out.input_ids, 0), (self.positions, out.positions, 0),
                                         (self.slots, out.slot_mapping, -1), (self.seq_lens, out.seq_lens, 0)):
            h = host.numpy()
            h[:n] = values
            h[n:b] = pad
            if dev is not host:
                dev[:b].copy_(host[:b], non_blocking=True)
        host_t, dev_t = self._table(b, w)
        t = host_t.numpy()
        t[:n, :width] = out.block_tables
        t[:n, width:] = 0
        t[n:] = 0
        if dev_t is not host_t:
            dev_t.copy_(host_t, non_blocking=True)
        meta = AttentionMetadata(
            slot_mapping=self.slots[1][:b], block_tables=dev_t, seq_lens=self.seq_lens[1][:b],
            seq_lens_host=self.seq_lens[0].numpy()[:b].copy(), query_start_loc=self.query_start_loc[:b + 1],
            query_start_loc_host=self.query_start_loc_host[:b + 1], all_decode=True, slots_valid=b == n,
        )
        return self.input_ids[1][:b], self.positions[1][:b], meta, b

    def _table(self, b: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        pair = self.tables.get((b, w))
        if pair is None:
            dev = torch.empty(b, w, dtype=torch.int32, device=self.device)
            host = dev if self.device.type != "cuda" else torch.empty(b, w, dtype=torch.int32, pin_memory=True)
            pair = self.tables[(b, w)] = (host, dev)
        return pair
