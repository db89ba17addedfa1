"""GPTQ checkpoints (AutoGPTQ / GPTQModel, `quant_method: gptq`), 4 or 8 bits.

Per layer, for a weight W [out, in] read as its transpose [in, out]:
- `qweight` int32 [in * bits / 32, out]: values packed down the input dimension, value i of a
  word in its bits [i * bits, (i + 1) * bits);
- `qzeros` int32 [groups, out * bits / 32]: zero points packed along the output dimension the
  same way; the "gptq" (v1) checkpoint format stores zero - 1, "gptq_v2" the zero itself;
- `scales` [groups, out] half;
- `g_idx` int32 [in]: each input column's group (act-order, `desc_act`, scrambles it).
W[o, j] = (q - zero) * scale of group g_idx[j]. `group_size: -1` is one group per row. Keys of
the config that only describe the calibration (damp_percent, true_sequential, desc_act: g_idx
says it) are not read; those that change the arithmetic are checked.
"""

from __future__ import annotations

from typing import Any

import torch

from pyserve.model.config import UnsupportedModelError
from pyserve.model.errors import WeightsError
from pyserve.model.prequantized.int_weights import IntWeights, check_shape, unpack_words

FORMATS = ("gptq", "gptq_v2")


class GptqFormat:
    suffixes = ("qweight", "qzeros", "scales", "g_idx")
    required = ("qweight", "qzeros", "scales")

    def __init__(self, qc: dict[str, Any]):
        self.bits = qc.get("bits")
        if self.bits not in (4, 8):
            raise UnsupportedModelError(f"quantization_config.bits: GPTQ with {self.bits} bits is not supported "
                                        "(4 or 8)")
        self.group_size = qc.get("group_size", 128)
        if not isinstance(self.group_size, int) or (self.group_size <= 0 and self.group_size != -1):
            raise UnsupportedModelError(f"quantization_config.group_size: {self.group_size!r} is not -1 or a "
                                        "positive integer")
        fmt = qc.get("checkpoint_format", qc.get("format", "gptq"))
        if fmt not in FORMATS:
            raise UnsupportedModelError(f"quantization_config.checkpoint_format: {fmt!r} is not supported "
                                        f"({' or '.join(FORMATS)})")
        self.zero_offset = 1 if fmt == "gptq" else 0
        if qc.get("pack_dtype", "int32") != "int32":
            raise UnsupportedModelError(f"quantization_config.pack_dtype: {qc['pack_dtype']!r} is not supported "
                                        "(int32)")
        if qc.get("dynamic"):
            raise UnsupportedModelError("quantization_config.dynamic: per-module GPTQ overrides are not supported")
        self.method = f"gptq-int{self.bits}"

    def int_weights(self, name: str, tensors: dict[str, torch.Tensor], in_features: int,
                    out_features: int) -> IntWeights:
        bits, per_word = self.bits, 32 // self.bits
        group = in_features if self.group_size == -1 else self.group_size
        if in_features % group or in_features % per_word or out_features % per_word:
            raise WeightsError(f"{name}: GPTQ {bits}-bit packing needs in ({in_features}) and out ({out_features}) "
                               f"features divisible by {per_word} and in by group_size {group}")
        groups = in_features // group
        check_shape(f"{name}.qweight", tensors["qweight"], (in_features // per_word, out_features))
        check_shape(f"{name}.qzeros", tensors["qzeros"], (groups, out_features // per_word))
        check_shape(f"{name}.scales", tensors["scales"], (groups, out_features))
        q = unpack_words(tensors["qweight"], bits, dim=0).T
        zeros = unpack_words(tensors["qzeros"], bits, dim=1).T.float() + self.zero_offset
        g_idx = tensors.get("g_idx")
        return IntWeights(name, bits, q.contiguous(), zeros.contiguous(), tensors["scales"].float().T.contiguous(),
                          group, None if g_idx is None else g_idx.long())
