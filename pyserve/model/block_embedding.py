"""An embedding table kept as a GGUF file's blocks (Q4_0, Q4_1, Q4_K, Q5_0, Q6_K or Q8_0, the
types `_core.gguf_widen` reads), each looked-up row widened with gguf's arithmetic as a step
asks for it: the same values as the table widened once, without holding it in f32 (Qwen2.5-Coder-
1.5B's Q4_K table is 0.9 GB widened, and widening it took ~1.5 s of the load). The whole-model
kernel looks rows up from the blocks the same way (rust/cpu_kernels/src/whole_model.rs)."""

from __future__ import annotations

import torch
from torch import nn

from pyserve.model.gguf.blocks import fan_in, widened


class BlockEmbedding(nn.Module):
    """`blocks` [num_embeddings, row bytes] uint8 of GGUF type `kind`; rows are looked up as `dtype`
    (the model's)."""

    def __init__(self, blocks: torch.Tensor, kind: str, dtype: torch.dtype):
        super().__init__()
        self.kind, self.dtype = kind, dtype
        self.num_embeddings, self.embedding_dim = blocks.shape[0], fan_in(kind, blocks.shape[1])
        self.register_buffer("blocks", blocks.contiguous())
        self.view = (self.blocks.numpy(), kind)  # as `_core.model_forward` takes an embedding

    @property
    def weight_bytes(self) -> int:
        return self.blocks.numel()

    def dequantized(self) -> torch.Tensor:
        """The whole table in f32 (what tensor parallelism shards)."""
        return torch.from_numpy(widened(self.blocks.numpy(), self.kind, torch.get_num_threads()))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.blocks.index_select(0, input_ids.reshape(-1))  # IndexError for an id out of range
        out = torch.from_numpy(widened(rows.numpy(), self.kind, 1)).reshape(*input_ids.shape, self.embedding_dim)
        return out.to(self.dtype)
