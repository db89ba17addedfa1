"""A linear layer over a GGUF file's quantized rows as the file holds them, served in place on a
CPU: Q4_K, Q6_K, Q5_0 and Q8_0 (4.5, 6.56, 5.5 and 8.5 bits a weight). `_core.linear_kquant` reads
the blocks with x quantized to int8 per 256 inputs (per 32 for Q5_0), llama.cpp's arithmetic for
these types, and for Q8_0 to int16 per 32 inputs (rust/cpu_kernels/src/linear_kquant.rs,
linear_q8_0.rs). Held as Int4Linear's groups (5 bits) or Int8Linear's rows (8 bits, re-rounded)
instead, the load would convert them and, for the K-quants and Q5_0, every decode step would read
more bytes. (Q4_0 / Q4_1 are Int4Linear's groups as they are, on int16 activations: linear_q4.rs.)
Off the CPU (CUDA) the GGUF loader converts them for the Triton kernels; `forward` on inputs
other than f32 on a CPU multiplies the widened weight, the reference the kernel is tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pyserve import _core
from pyserve.model.gguf.blocks import fan_in, row_bytes, widened

KQUANT_TYPES = ("Q4_K", "Q6_K", "Q5_0", "Q8_0")


class KQuantLinear(nn.Module):
    """`blocks` [out_features, row bytes] uint8 of `kind` (one of KQUANT_TYPES), rows in output order."""

    def __init__(self, blocks: torch.Tensor, kind: str, bias: torch.Tensor | None):
        super().__init__()
        if kind not in KQUANT_TYPES:
            raise ValueError(f"kind: {kind} is not a block type this layer serves ({', '.join(KQUANT_TYPES)})")
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or \
                row_bytes(kind, fan_in(kind, blocks.shape[1])) != blocks.shape[1]:
            raise ValueError(f"blocks: {tuple(blocks.shape)} {blocks.dtype} is not rows of whole {kind} blocks (uint8)")
        self.kind = kind
        self.out_features = blocks.shape[0]
        self.in_features = fan_in(kind, blocks.shape[1])
        self.register_buffer("blocks", blocks.contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        self.cpu = blocks.device.type == "cpu"
        if self.cpu:
            self.views = (self.blocks.numpy(), kind, None if self.bias is None else self.bias.numpy())

    @property
    def weight_bytes(self) -> int:
        return self.blocks.numel()

    def kernel_weights(self) -> tuple | None:
        """The layer as `_core.decoder_layer` takes a K-quant projection."""
        return self.views if self.cpu else None

    def dequantized(self) -> torch.Tensor:
        """The weight [out, in] in f32, widened with gguf's arithmetic."""
        weight = widened(self.blocks.cpu().numpy(), self.kind, torch.get_num_threads())
        return torch.from_numpy(weight).to(self.blocks.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu and x.dtype == torch.float32:
            out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
            blocks, kind, bias = self.views
            _core.linear_kquant(x.contiguous().numpy(), blocks, kind, bias, out.numpy(),
                                threads=torch.get_num_threads())
            return out
        return F.linear(x, self.dequantized().to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
