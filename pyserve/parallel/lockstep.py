"""Rank 0 runs the engine; the other ranks replay its model calls in lockstep.

Before each call that runs collectives (a forward, a logits projection) or touches the KV cache
(a block copy), rank 0 broadcasts a header of int64s and the call's flat input arrays as tensors;
the followers rebuild the same call on their own shard and run it, meeting rank 0 in every
all-reduce and all-gather inside. No Python object crosses the wire.
"""

from __future__ import annotations

import numpy as np
import torch

from pyserve.model.attention import AttentionBackend, AttentionMetadata
from pyserve.model.decoder import CausalLM
from pyserve.model.kv_cache import copy_blocks
from pyserve.parallel.group import TensorParallelGroup

FORWARD, LOGITS, COPY_BLOCKS, STOP = 1, 2, 3, 4
HEADER = 5
_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


class Lockstep:
    def __init__(self, group: TensorParallelGroup, model: CausalLM, kv_caches, backend: AttentionBackend):
        self.group, self.model, self.kv_caches, self.backend = group, model, kv_caches, backend
        self.stopped = False

    def _header(self, *values: int) -> torch.Tensor:
        header = torch.zeros(HEADER, dtype=torch.int64, device=self.group.device)
        header[: len(values)] = torch.tensor(values, dtype=torch.int64)
        return self.group.broadcast(header)

    # Rank 0: announce a call, then make it.

    def announce_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        n, (seqs, width) = input_ids.shape[0], meta.block_tables.shape
        self._header(FORWARD, n, seqs, width)
        parts = (input_ids, positions, meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.query_start_loc)
        self.group.broadcast(torch.cat([p.reshape(-1).to(self.group.device, torch.int64) for p in parts]))

    def announce_logits(self, hidden: torch.Tensor) -> None:
        self._header(LOGITS, hidden.shape[0], hidden.shape[1], _DTYPES.index(hidden.dtype))
        self.group.broadcast(hidden.contiguous())

    def announce_copy_blocks(self, pairs: torch.Tensor) -> None:
        self._header(COPY_BLOCKS, pairs.shape[0])
        self.group.broadcast(pairs.to(self.group.device, torch.int64).contiguous())

    def stop(self) -> None:
        """Tells the followers to leave their loop (once)."""
        if not self.stopped:
            self.stopped = True
            self._header(STOP)

    # The other ranks.

    @torch.inference_mode()
    def follow(self) -> None:
        """Replays rank 0's calls until it says stop (or a collective fails: the error rises)."""
        dev = self.group.device
        while True:
            op, a, b, c, _ = self._header().tolist()
            if op == STOP:
                return
            if op == FORWARD:
                n, seqs, width = a, b, c
                flat = self.group.broadcast(torch.empty(3 * n + seqs * width + 2 * seqs + 1, dtype=torch.int64,
                                                        device=dev)).cpu().numpy()
                ids, pos, slots, tables, lens, starts = np.split(
                    flat, np.cumsum([n, n, n, seqs * width, seqs]))
                meta = AttentionMetadata.build(slots, tables.astype(np.int32).reshape(seqs, width),
                                               lens.astype(np.int32), starts.astype(np.int32), dev)
                self.model(torch.from_numpy(ids).to(dev), torch.from_numpy(pos).to(dev), self.kv_caches, meta,
                           self.backend)
            elif op == LOGITS:
                hidden = self.group.broadcast(torch.empty(a, b, dtype=_DTYPES[c], device=dev))
                self.model.compute_logits(hidden)
            elif op == COPY_BLOCKS:
                copy_blocks(self.kv_caches, self.group.broadcast(torch.empty(a, 2, dtype=torch.int64, device=dev)))
            else:
                raise RuntimeError(f"tensor-parallel follower: unknown op {op} from rank 0")
