"""References of quantized arithmetic that transformers does not have, for greedy parity tests and
the quality bench: W8A8Linear's with the integer sums in int64 (exact by construction)."""

from __future__ import annotations

import torch
from torch import nn

from pyserve.model.quantized_linear import W8A8Linear, quantize_int8


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


def use_w8a8_reference(model: nn.Module) -> None:
    """Every linear layer of a transformers model replaced by W8A8Reference; a tied head untied
    first (pyserve quantizes the head, not the embedding)."""
    model.config.tie_word_embeddings = False
    model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear)]
    for parent, name, child in targets:
        setattr(parent, name, W8A8Reference(W8A8Linear.from_linear(child)))
