"""Rank 0 runs the engine; the other ranks replay its model calls in lockstep.

Before each call that runs collectives (a forward, a logits projection), touches the KV cache
(a block copy) or changes the LoRA adapters (one added, from its path, or removed), rank 0 broadcasts a header of int64s and the call's flat input arrays as tensors;
the followers rebuild the same call on their own shard and run it, meeting rank 0 in every
all-reduce and all-gather inside. No Python object crosses the wire.
"""

from __future__ import annotations

import numpy as np
import torch

from pyserve.lora.adapter import load_adapter
from pyserve.lora.slots import LoraSlots
from pyserve.model.attention import AttentionBackend, AttentionMetadata
from pyserve.model.decoder import CausalLM
from pyserve.model.kv_cache import copy_blocks
from pyserve.parallel.group import TensorParallelGroup

FORWARD, LOGITS, COPY_BLOCKS, STOP, LORA_ADD, LORA_REMOVE = 1, 2, 3, 4, 5, 6
HEADER = 5
_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


class Lockstep:
    def __init__(self, group: TensorParallelGroup, model: CausalLM, kv_caches, backend: AttentionBackend,
                 lora: LoraSlots | None, max_lora_rank: int):
        self.group, self.model, self.kv_caches, self.backend = group, model, kv_caches, backend
        self.lora, self.max_lora_rank = lora, max_lora_rank
        # Rank 0: the adapter of each request of the next forward (set by the worker after
        # LoraSlots.prepare_step; None without LoRA).
        self.adapter_ids: np.ndarray | None = None
        self.stopped = False

    def _header(self, *values: int) -> torch.Tensor:
        header = torch.zeros(HEADER, dtype=torch.int64, device=self.group.device)
        header[: len(values)] = torch.tensor(values, dtype=torch.int64)
        return self.group.broadcast(header)

    # Rank 0: announce a call, then make it.

    def announce_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        n, (seqs, width) = input_ids.shape[0], meta.block_tables.shape
        adapters = self.adapter_ids
        self.adapter_ids = None
        self._header(FORWARD, n, seqs, width, int(adapters is not None))
        parts = [input_ids, positions, meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.query_start_loc]
        if adapters is not None:
            parts.append(torch.from_numpy(np.asarray(adapters, dtype=np.int64)))
        self.group.broadcast(torch.cat([p.reshape(-1).to(self.group.device, torch.int64) for p in parts]))

    def announce_lora(self, adapter_id: int, path: str | None) -> None:
        """An adapter rank 0 just added (from `path`) or removed (None), before the forward that
        may use it."""
        if path is None:
            self._header(LORA_REMOVE, adapter_id)
            return
        data = path.encode()
        self._header(LORA_ADD, adapter_id, len(data))
        self.group.broadcast(torch.tensor(list(data), dtype=torch.uint8, device=self.group.device))

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
            op, a, b, c, d = self._header().tolist()
            if op == STOP:
                return
            if op == FORWARD:
                n, seqs, width, with_adapters = a, b, c, d
                size = 3 * n + seqs * width + 2 * seqs + 1 + (seqs if with_adapters else 0)
                flat = self.group.broadcast(torch.empty(size, dtype=torch.int64, device=dev)).cpu().numpy()
                ids, pos, slots, tables, lens, starts, adapters = np.split(
                    flat, np.cumsum([n, n, n, seqs * width, seqs, seqs + 1]))
                if self.lora is not None:
                    self.lora.prepare_step(adapters if with_adapters else None, np.diff(starts), dev)
                meta = AttentionMetadata.build(slots, tables.astype(np.int32).reshape(seqs, width),
                                               lens.astype(np.int32), starts.astype(np.int32), dev)
                self.model(torch.from_numpy(ids).to(dev), torch.from_numpy(pos).to(dev), self.kv_caches, meta,
                           self.backend)
            elif op == LOGITS:
                hidden = self.group.broadcast(torch.empty(a, b, dtype=_DTYPES[c], device=dev))
                self.model.compute_logits(hidden)
            elif op == LORA_ADD:
                path = bytes(self.group.broadcast(torch.empty(b, dtype=torch.uint8, device=dev)).tolist()).decode()
                self.lora.add(a, load_adapter(path, self.lora.shapes(), len(self.model.model.layers),
                                              self.max_lora_rank))
            elif op == LORA_REMOVE:
                self.lora.remove(a)
            elif op == COPY_BLOCKS:
                copy_blocks(self.kv_caches, self.group.broadcast(torch.empty(a, 2, dtype=torch.int64, device=dev)))
            else:
                raise RuntimeError(f"tensor-parallel follower: unknown op {op} from rank 0")
