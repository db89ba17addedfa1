"""fp32 linear layers on the CPU through oneDNN, with each weight packed once at load.

torch's `F.linear` hands fp32 CPU matmuls to MKL, which on the AMD EPYC measured here reaches 30-90
GFLOP/s on the skinny matrices of decode steps (8-48 rows) and 10-40 on the vocabulary head; oneDNN
on a weight reordered once into its blocked layout reaches 40-125 there, and 1.1-1.3x MKL on
2048-row prefill chunks. Its rows also come out the same bits whatever the number of rows in the
call (MKL's do not below 6 rows). torch exposes the pair as `mkldnn::_reorder_linear_weight` and
`mkldnn::_linear_pointwise`, the ops its compiler emits for CPU linears.

Each oneDNN call costs ~25 us more than MKL's (primitive lookup, wrapping), which small weights
never earn back: measured, a 128x256 weight is slower packed at every batch size, a 512x512 one
takes 79 vs 43 us for one row, and from 512x1024 up packed wins or ties at every size. So only
weights of at least MIN_PACKED_ELEMENTS (2 MiB of fp32) are packed.
"""

from __future__ import annotations

import torch
from torch import nn

MIN_PACKED_ELEMENTS = 1 << 19


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether packed linears serve this placement: fp32 on a CPU whose torch has oneDNN."""
    return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class PackedLinear(nn.Module):
    """`linear`'s function with its weight held only in oneDNN's packed layout."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        # Detached: with autograd on, a bias that requires grad sends one-row calls down another
        # path, whose bits differ.
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears(model: nn.Module, min_elements: int = MIN_PACKED_ELEMENTS) -> int:
    """Replaces every nn.Linear inside `model` whose weight has at least `min_elements` entries by a
    PackedLinear; returns how many. A head tied to the embedding gets its own packed copy (the
    embedding keeps the plain one)."""
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear) and child.weight.numel() >= min_elements]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    return len(targets)
