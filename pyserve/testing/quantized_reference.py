"""References of quantized arithmetic that transformers does not have, for greedy parity tests and
the quality bench: W8A8Linear's with the integer sums in int64 (exact by construction), and
Int4Linear's on a CPU (its groups of 32 or more multiply int16 activations, quantized per block
of 32 inputs)."""

from __future__ import annotations

import torch
from torch import nn

from pyserve.model.quantized_linear import Int4Linear, Int8Linear, W8A8Linear, quantize_int8, unpack_int4

ACTIVATION_BLOCK = 32  # inputs per scale of Int4Linear's int16 activations on a CPU
ACTIVATION_MAX = 32767.0


class W8A8Reference(nn.Module):
    def __init__(self, layer: W8A8Linear):
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        xq, x_scales = quantize_int8(rows)
        out = (xq.long() @ self.layer.qweight.long().t()).float() * x_scales[:, None] * self.layer.scales
        if self.layer.bias is not None:
            out += self.layer.bias
        return out.reshape(*x.shape[:-1], -1)


def activation_blocks(x: torch.Tensor) -> torch.Tensor:
    """x [rows, K] as Int4Linear's CPU kernel multiplies the nibbles with: each block of 32 inputs
    quantized to int16 (scale max |x| / 32767, rounded half to even) and scaled back."""
    blocks = x.float().reshape(x.shape[0], -1, ACTIVATION_BLOCK)
    scales = blocks.abs().amax(dim=2, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / ACTIVATION_MAX
    return (torch.round(blocks / scales).clamp_(-ACTIVATION_MAX, ACTIVATION_MAX) * scales).reshape(x.shape)


class Int4Reference(nn.Module):
    """Int4Linear's CPU arithmetic: the scaled nibbles meet x's int16 blocks, the offsets x itself."""

    def __init__(self, layer: Int4Linear):
        super().__init__()
        n, groups = layer.scales.shape
        scales = layer.scales.float()[..., None]
        self.scaled = (unpack_int4(layer.packed).float().reshape(n, groups, -1) * scales).reshape(n, -1)
        self.offsets = layer.offsets.float().repeat_interleave(layer.group_size, dim=1)
        self.bias = layer.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).float()
        out = activation_blocks(rows) @ self.scaled.t() + rows @ self.offsets.t()
        if self.bias is not None:
            out += self.bias
        return out.reshape(*x.shape[:-1], -1)


def _replace_linears(model: nn.Module, reference) -> None:
    """Every linear layer of a transformers model replaced by `reference(layer)`; a tied head
    untied first (pyserve quantizes the head, not the embedding)."""
    model.config.tie_word_embeddings = False
    model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear)]
    for parent, name, child in targets:
        setattr(parent, name, reference(child))


def use_w8a8_reference(model: nn.Module) -> None:
    _replace_linears(model, lambda linear: W8A8Reference(W8A8Linear.from_linear(linear)))


class Int8Reference(nn.Module):
    """Int8Linear's arithmetic: x times the dequantized weight."""

    def __init__(self, layer: Int8Linear):
        super().__init__()
        self.weight, self.bias = layer.dequantized(), layer.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


def use_int8_reference(model: nn.Module) -> None:
    _replace_linears(model, lambda linear: Int8Reference(Int8Linear.from_linear(linear)))


def use_int4_reference(model: nn.Module, group_size: int, head: str = "int8") -> None:
    """`--quantization int4`'s arithmetic: every projection on Int4Reference, the LM head on int8
    (quantize_linears' rule) or, with head="int4", on int4 too."""
    def reference(linear: nn.Linear) -> nn.Module:
        if linear is model.lm_head and head == "int8":
            return Int8Reference(Int8Linear.from_linear(linear))
        return Int4Reference(Int4Linear.from_linear(linear, group_size))

    _replace_linears(model, reference)
