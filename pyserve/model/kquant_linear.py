"""A linear layer over a GGUF file's quantized rows as the file holds them, served in place on a
CPU: Q4_K, Q6_K, Q5_0, Q8_0, Q4_0 and Q4_1 (4.5, 6.56, 5.5, 8.5, 4.5 and 5 bits a weight).
`_core.linear_kquant` reads the blocks with x quantized to int8 per 256 inputs (per 32 for Q5_0),
llama.cpp's arithmetic for these types, and for Q8_0, Q4_0 and Q4_1 to int16 per 32 inputs
(rust/cpu_kernels/src/linear_kquant.rs, linear_q8_0.rs, linear_q4_blocks.rs). Held as
Int4Linear's groups or Int8Linear's rows instead, the load would convert them (and, for the
K-quants and Q5_0, every decode step would read more bytes). Off the CPU (CUDA) the GGUF loader
converts them for the Triton kernels; `forward` on inputs other than f32 on a CPU multiplies the
widened weight, the reference the kernel is tested against."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pyserve import _core
from pyserve.model.gguf.blocks import fan_in, row_bytes, widened

KQUANT_TYPES = ("Q4_K", "Q6_K", "Q5_0", "Q8_0", "Q4_0", "Q4_1")


class KQuantLinear(nn.Module):
    """The rows of `blocks`, uint8 rows of `kind` (one of KQUANT_TYPES) in output order: one tensor
    [out_features, row bytes], or several whose rows follow one another (projections over the same
    inputs that the file holds apart, joined without a copy: `joined`)."""

    def __init__(self, blocks: torch.Tensor | Sequence[torch.Tensor], kind: str, bias: torch.Tensor | None):
        super().__init__()
        if kind not in KQUANT_TYPES:
            raise ValueError(f"kind: {kind} is not a block type this layer serves ({', '.join(KQUANT_TYPES)})")
        parts = (blocks,) if isinstance(blocks, torch.Tensor) else tuple(blocks)
        if not parts:
            raise ValueError("blocks: a layer needs at least one tensor of rows")
        for part in parts:
            if part.dtype != torch.uint8 or part.dim() != 2 or part.shape[1] != parts[0].shape[1] or \
                    row_bytes(kind, fan_in(kind, part.shape[1])) != part.shape[1]:
                raise ValueError(f"blocks: {tuple(part.shape)} {part.dtype} is not rows of whole {kind} blocks "
                                 f"(uint8) of the same length as the first's ({parts[0].shape[1]} bytes)")
        self.kind = kind
        self.parts = tuple(p.contiguous() for p in parts)
        self.out_features = sum(p.shape[0] for p in parts)
        self.in_features = fan_in(kind, parts[0].shape[1])
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        self.cpu = parts[0].device.type == "cpu"
        if self.cpu:
            self.views = ([p.numpy() for p in self.parts], kind, None if self.bias is None else self.bias.numpy())

    @staticmethod
    def joined(layers: Sequence[KQuantLinear]) -> KQuantLinear | None:
        """One layer whose outputs are those of `layers` in order (their rows where they are), or
        None where they differ in type or inputs, or some have a bias and others not."""
        first = layers[0]
        if any(m.kind != first.kind or m.in_features != first.in_features or (m.bias is None) != (first.bias is None)
               for m in layers):
            return None
        bias = None if first.bias is None else torch.cat([m.bias for m in layers])
        return KQuantLinear([p for m in layers for p in m.parts], first.kind, bias)

    @property
    def weight_bytes(self) -> int:
        return sum(p.numel() for p in self.parts)

    def kernel_weights(self) -> tuple | None:
        """The layer as `_core.decoder_layer` takes a K-quant projection."""
        return self.views if self.cpu else None

    def dequantized(self) -> torch.Tensor:
        """The weight [out, in] in f32, widened with gguf's arithmetic."""
        threads = torch.get_num_threads()
        weight = np.concatenate([widened(p.cpu().numpy(), self.kind, threads) for p in self.parts])
        return torch.from_numpy(weight).to(self.parts[0].device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu and x.dtype == torch.float32:
            out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
            blocks, kind, bias = self.views
            _core.linear_kquant(x.contiguous().numpy(), blocks, kind, bias, out.numpy(),
                                threads=torch.get_num_threads())
            return out
        return F.linear(x, self.dequantized().to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
