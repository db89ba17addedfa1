"""AWQ checkpoints in GEMM packing (AutoAWQ, `quant_method: awq`, `version: gemm`), 4 bits.

Per layer, for a weight W [out, in] read as its transpose [in, out]:
- `qweight` int32 [in, out / 8]: eight output columns to a word, column 8c + i in the nibble
  INTERLEAVE[i] of word c (AWQ's order, chosen for its CUDA kernel's dequantization);
- `qzeros` int32 [groups, out / 8]: the zero points, packed the same way;
- `scales` [groups, out] half.
W[o, j] = (q - zero) * scale of group j // group_size.
"""

from __future__ import annotations

from typing import Any

import torch

from pyserve.model.config import UnsupportedModelError
from pyserve.model.errors import WeightsError
from pyserve.model.prequantized.int_weights import IntWeights, check_shape, unpack_words

INTERLEAVE = (0, 4, 1, 5, 2, 6, 3, 7)  # the nibble holding column 8c + i of word c


def _deinterleaved(values: torch.Tensor) -> torch.Tensor:
    """Columns in order from nibble-order values [rows, out] (nibble i of word c at 8c + i)."""
    index = (torch.arange(values.shape[1]) // 8) * 8 + torch.tensor(INTERLEAVE).repeat(values.shape[1] // 8)
    return values[:, index]


class AwqFormat:
    suffixes = ("qweight", "qzeros", "scales")
    required = suffixes

    def __init__(self, qc: dict[str, Any]):
        self.bits = qc.get("bits", qc.get("w_bit"))
        if self.bits != 4:
            raise UnsupportedModelError(f"quantization_config.bits: AWQ with {self.bits} bits is not supported (4)")
        self.group_size = qc.get("group_size", qc.get("q_group_size", 128))
        if not isinstance(self.group_size, int) or self.group_size <= 0:
            raise UnsupportedModelError(f"quantization_config.group_size: {self.group_size!r} is not a positive "
                                        "integer")
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise UnsupportedModelError(f"quantization_config.version: AWQ {version!r} packing is not supported "
                                        "(gemm)")
        if not qc.get("zero_point", True):
            raise UnsupportedModelError("quantization_config.zero_point: AWQ without zero points is not supported")
        self.method = "awq-int4"

    def int_weights(self, name: str, tensors: dict[str, torch.Tensor], in_features: int,
                    out_features: int) -> IntWeights:
        group = self.group_size
        if in_features % group or out_features % 8:
            raise WeightsError(f"{name}: AWQ packing needs out features ({out_features}) divisible by 8 and in "
                               f"features ({in_features}) by group_size {group}")
        groups = in_features // group
        check_shape(f"{name}.qweight", tensors["qweight"], (in_features, out_features // 8))
        check_shape(f"{name}.qzeros", tensors["qzeros"], (groups, out_features // 8))
        check_shape(f"{name}.scales", tensors["scales"], (groups, out_features))
        q = _deinterleaved(unpack_words(tensors["qweight"], 4, dim=1)).T
        zeros = _deinterleaved(unpack_words(tensors["qzeros"], 4, dim=1)).T.float()
        return IntWeights(name, 4, q.contiguous(), zeros.contiguous(), tensors["scales"].float().T.contiguous(),
                          group)
