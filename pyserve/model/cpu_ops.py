"""The decoder layer's small ops on fp32 CPU tensors of a few rows, each one call of pyserve's
Rust kernels (`rust/cpu_kernels/src/layer_ops.rs`) where torch takes five to ten ops; the torch
code in decoder.py and rope.py is their reference. Weights come as numpy views (`weight_view`),
made once at load."""

from __future__ import annotations

import numpy as np
import torch

from pyserve import _core


def weight_view(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a parameter (no copy)."""
    return t.detach().numpy()


def rms_norm(x: torch.Tensor, weight: np.ndarray, eps: float) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=torch.float32)
    _core.rms_norm(x.contiguous().numpy(), weight, eps, out.numpy())
    return out


def add_rms_norm(delta: torch.Tensor, residual: torch.Tensor, weight: np.ndarray, eps: float) -> torch.Tensor:
    """residual += delta (in place), then rms_norm(residual)."""
    out = torch.empty(residual.shape, dtype=torch.float32)
    _core.add_rms_norm(delta.contiguous().numpy(), residual.numpy(), weight, eps, out.numpy())
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, gate and up the halves of each row."""
    out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=torch.float32)
    _core.silu_mul(gate_up.numpy(), out.numpy())
    return out


def rotary_(x: torch.Tensor, heads: int, head_dim: int, tables: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Rotates the first `heads` heads of each row of x [tokens, width] in place; `tables` from
    RotaryEmbedding.tables."""
    cos, sin = tables
    _core.rotary(x.numpy(), heads, head_dim, cos.numpy(), sin.numpy())
