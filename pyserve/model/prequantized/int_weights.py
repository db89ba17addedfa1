"""One form for every pre-quantized checkpoint's linear layer, and the layer pyserve serves it as.

Each format's reader unpacks its tensors into `IntWeights`: unsigned integer values q [out, in],
and per output row and group a zero point z and a scale s, so that weight (o, j) =
(q[o, j] - z[o, g]) * s[o, g] with g = g_idx[j] (act-order) or j // group_size. `to_layer` turns
that into the layer with the fewest bytes that computes it exactly:
- 4 bits: an Int4Linear (offset = -z * s; an act-order layer stores its columns grouped, with
  the order its inputs are gathered in). Its kernel wants power-of-two groups of at least 8, so
  a group of another size (e.g. a whole 11008-wide row) is split into equal power-of-two groups
  sharing its scale and zero point.
- 8 bits with one symmetric scale per output row: an Int8Linear (q - z is the int8 value); with
  int8 activations (W8A8) a W8A8Linear, on a CPU with VNNI (check_device says why elsewhere).
- anything else (8 bits in groups or asymmetric): the dequantized weight as a plain nn.Linear in
  the serving dtype; right, but with full-precision bytes and speed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pyserve.model.config import UnsupportedModelError
from pyserve.model.errors import WeightsError
from pyserve.model.quantized_linear import Int4Linear, Int8Linear, W8A8Linear, check_device

MIN_KERNEL_GROUP = 8


@dataclass(slots=True)
class IntWeights:
    name: str  # the module, for errors
    bits: int
    q: torch.Tensor  # [out, in] int32, in 0 .. 2**bits - 1
    zeros: torch.Tensor  # [out, groups] float32
    scales: torch.Tensor  # [out, groups] float32
    group_size: int
    g_idx: torch.Tensor | None = None  # [in]: the group of each input column (act-order)
    int8_activations: bool = False  # W8A8: each row of the input quantized to int8 as the layer runs

    def groups_of_columns(self) -> torch.Tensor:
        if self.g_idx is not None:
            return self.g_idx
        return torch.arange(self.q.shape[1]) // self.group_size

    def dequantized(self) -> torch.Tensor:
        """The float32 weight [out, in]."""
        g = self.groups_of_columns()
        return (self.q.float() - self.zeros[:, g]) * self.scales[:, g]


def unpack_words(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The unsigned `bits`-wide values packed in int32 `words`, 32 / bits to a word along `dim`,
    value i of a word in its bits [i * bits, (i + 1) * bits) (GPTQ's and compressed-tensors'
    order): int32, `dim` grown by 32 / bits."""
    if words.dtype != torch.int32:
        raise WeightsError(f"packed weights must be int32, got {words.dtype}")
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    w = words.movedim(dim, -1)
    values = (w[..., None] >> shifts) & ((1 << bits) - 1)
    return values.reshape(*w.shape[:-1], w.shape[-1] * per_word).movedim(-1, dim)


def check_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != shape:
        raise WeightsError(f"{name} has shape {tuple(tensor.shape)}, expected {shape}")


def _act_order(w: IntWeights) -> torch.Tensor | None:
    """The input order that makes every group contiguous (None: it already is), checked."""
    k = w.q.shape[1]
    if w.g_idx is None:
        return None
    check_shape(f"{w.name}.g_idx", w.g_idx, (k,))
    order = torch.argsort(w.g_idx, stable=True)
    if not torch.equal(w.g_idx[order], torch.arange(k) // w.group_size):
        raise WeightsError(f"{w.name}.g_idx does not give each of the {w.scales.shape[1]} groups "
                           f"{w.group_size} input columns")
    return None if torch.equal(order, torch.arange(k)) else order


def to_layer(w: IntWeights, bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """The served layer of `w` (see the module docstring), on `device`."""
    n, k = w.q.shape
    if int(w.q.min()) < 0 or int(w.q.max()) >= 1 << w.bits:
        raise WeightsError(f"{w.name}: unpacked values outside 0..{(1 << w.bits) - 1}")
    order = _act_order(w)
    kernel_group = w.group_size & -w.group_size  # the largest power of two dividing it
    if w.bits == 4 and kernel_group >= MIN_KERNEL_GROUP:
        q = w.q if order is None else w.q[:, order]
        repeat = w.group_size // kernel_group
        scales = w.scales.repeat_interleave(repeat, dim=1)
        offsets = (-w.zeros * w.scales).repeat_interleave(repeat, dim=1)
        q = q.to(torch.uint8)
        packed = q[:, 0::2] | (q[:, 1::2] << 4)
        return Int4Linear(packed.to(device), scales.to(device), offsets.to(device), kernel_group,
                          None if bias is None else bias.to(device), None if order is None else order.to(device))
    symmetric_rows = w.bits == 8 and w.scales.shape[1] == 1 and torch.equal(w.zeros, torch.full_like(w.zeros, 128.0))
    if w.int8_activations:
        if not symmetric_rows:
            raise WeightsError(f"{w.name}: int8 activations need 8-bit symmetric weights, one scale per row")
        try:
            check_device("w8a8", device)
        except ValueError as e:
            raise UnsupportedModelError(f"quantization_config: {w.name} has int8 activations (W8A8): {e}") from None
    if symmetric_rows:
        q = (w.q - 128).to(torch.int8)
        layer = W8A8Linear if w.int8_activations else Int8Linear
        return layer(q.to(device), w.scales[:, 0].to(device), None if bias is None else bias.to(device))
    linear = nn.Linear(k, n, bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(w.dequantized().to(device=device, dtype=dtype), requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.to(device=device, dtype=dtype), requires_grad=False)
    return linear
