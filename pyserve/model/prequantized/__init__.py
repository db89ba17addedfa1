"""Pre-quantized Hugging Face checkpoints, detected from `quantization_config` in config.json:
compressed-tensors (pack-quantized W4A16 / W8A16, int-quantized W8A16 / W8A8), GPTQ (4 and 8
bits, act-order included) and AWQ (GEMM packing). Each format's reader unpacks a layer's tensors
into `IntWeights`, which int_weights.to_layer serves with pyserve's own quantized layers (see
there for which)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pyserve.model.config import UnsupportedModelError
from pyserve.model.errors import WeightsError
from pyserve.model.prequantized.awq import AwqFormat
from pyserve.model.prequantized.compressed_tensors import CompressedTensorsFormat
from pyserve.model.prequantized.gptq import GptqFormat
from pyserve.model.prequantized.int_weights import to_layer

FORMATS = {"gptq": GptqFormat, "awq": AwqFormat, "compressed-tensors": CompressedTensorsFormat}


class QuantizedCheckpoint:
    """How one checkpoint's quantized layers are read: which tensor names are theirs, and the
    served layer of each."""

    def __init__(self, fmt):
        self.format = fmt
        self.method = fmt.method  # e.g. "gptq-int4", for stats()

    def owns(self, tensor_name: str, tensor: torch.Tensor) -> bool:
        """Whether the tensor is part of a quantized layer: a format's suffix, except a floating
        `weight` (an int-quantized layer's weight is integer; a layer left unquantized keeps its
        float one)."""
        leaf = tensor_name.rpartition(".")[2]
        return leaf in self.format.suffixes and (leaf != "weight" or not tensor.is_floating_point())

    def layer(self, module_name: str, tensors: dict[str, torch.Tensor], linear: nn.Linear, dtype: torch.dtype,
              device: torch.device) -> nn.Module:
        """The served layer for `linear` (its bias already loaded) from its packed `tensors`
        (by suffix)."""
        missing = [s for s in self.format.required if s not in tensors]
        if missing:
            raise WeightsError(f"checkpoint is missing tensors: {module_name}.{missing[0]}")
        weights = self.format.int_weights(module_name, tensors, linear.in_features, linear.out_features)
        bias = None if linear.bias is None else linear.bias.detach()
        return to_layer(weights, bias, dtype, device)


def checkpoint_quantization(raw_config: dict[str, Any]) -> QuantizedCheckpoint | None:
    """The checkpoint's quantization (None: full precision), its config checked: a method or
    setting pyserve does not serve is an UnsupportedModelError naming the key."""
    qc = raw_config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise UnsupportedModelError("quantization_config: must be an object")
    method = qc.get("quant_method")
    if method not in FORMATS:
        raise UnsupportedModelError(f"quantization_config.quant_method: {method!r} is not supported "
                                    f"({', '.join(FORMATS)})")
    return QuantizedCheckpoint(FORMATS[method](qc))
