"""fp32 linear layers on the CPU: a few rows through pyserve's Rust kernel, many through oneDNN
with the weight packed once at load.

At up to FEW_ROWS rows (decode steps of small batches, draft verification) a linear layer is a
stream of its weights. torch's `F.linear` hands it to MKL, which packs the weight on every call
and, measured on the AMD EPYC here, reads 17 MB of decode-step weights at 5-6 GB/s where one
pass over them takes a quarter of that time; oneDNN's packed path is no faster there.
`pyserve._core.linear` reads the row-major weight as it lies, once per call whatever the number of
rows (22 GB/s on those 17 MB at one row, on torch's two threads), and gives a row the same bits
whatever rows are beside it.

Above FEW_ROWS (prefill chunks, large decode batches) oneDNN on a weight reordered once into its
blocked layout reaches 40-125 GFLOP/s where MKL reaches 30-90, and 1.1-1.4x MKL on prefill
chunks. Each oneDNN call costs ~25 us more than MKL's, which small weights never earn back, so
only weights of at least MIN_PACKED_ELEMENTS (2 MiB of fp32) get a packed copy; those hold
their weights twice. torch exposes the pair as `mkldnn::_reorder_linear_weight` and
`mkldnn::_linear_pointwise`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pyserve import _core

FEW_ROWS = 16
MIN_PACKED_ELEMENTS = 1 << 19


def can_use(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether CpuLinear serves this placement: fp32 on a CPU."""
    return device.type == "cpu" and dtype == torch.float32


def _can_pack() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class CpuLinear(nn.Module):
    """`linear`'s function on fp32 CPU tensors; its weight is shared with `linear` (a head tied to
    the embedding stays tied)."""

    def __init__(self, linear: nn.Linear, min_packed_elements: int = MIN_PACKED_ELEMENTS):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # Detached: with autograd on, a bias that requires grad sends one-row calls down another
        # path, whose bits differ.
        self.register_buffer("weight", linear.weight.detach().contiguous())
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())
        self.weight_view = self.weight.numpy()  # numpy views for the kernels (no copies)
        self.bias_view = None if self.bias is None else self.bias.numpy()
        self.packed = None
        if self.weight.numel() >= min_packed_elements and _can_pack():
            with torch.no_grad():
                self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= FEW_ROWS:
            out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
            _core.linear(x.contiguous().numpy(), self.weight_view, self.bias_view, out.numpy(),
                         threads=torch.get_num_threads())
            return out
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def use_cpu_linears(model: nn.Module, min_packed_elements: int = MIN_PACKED_ELEMENTS) -> int:
    """Replaces every nn.Linear inside `model` by a CpuLinear; returns how many."""
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear)]
    for parent, name, child in targets:
        setattr(parent, name, CpuLinear(child, min_packed_elements))
    return len(targets)
