"""compressed-tensors checkpoints (llm-compressor's output, `quant_method: compressed-tensors`) in
the `pack-quantized` format with integer weights only (W4A16, W8A16: activations unquantized).

Per quantized layer, W [out, in]:
- `weight_packed` int32 [out, ceil(in * bits / 32)]: values packed along the input dimension,
  value i of a word in its bits [i * bits, (i + 1) * bits), each stored as value + 2**(bits-1);
- `weight_scale` [out, groups] ([out, 1] per channel, one value per tensor);
- `weight_zero_point` int32 [ceil(out * bits / 32), groups], packed down the output dimension
  (asymmetric schemes only; a symmetric zero is 0);
- `weight_shape` [2]: (out, in);
- `weight_g_idx` [in]: each input column's group (`actorder: group`).
W[o, j] = (value - zero) * scale, value and zero signed. Which layers are quantized is what the
checkpoint holds; `config_groups` say with what (a layer takes the scheme whose `targets` name
it, its class `Linear`, or match it as `re:` patterns).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from pyserve.model.config import UnsupportedModelError
from pyserve.model.errors import WeightsError
from pyserve.model.prequantized.int_weights import IntWeights, check_shape, unpack_words

STRATEGIES = ("tensor", "channel", "group")


class _Scheme:
    def __init__(self, key: str, scheme: Any):
        if not isinstance(scheme, dict):
            raise UnsupportedModelError(f"{key}: a preset name for targets is not supported, only a full scheme")
        for part in ("input_activations", "output_activations"):
            if scheme.get(part) is not None:
                raise UnsupportedModelError(f"{key}.{part}: activation quantization is not supported "
                                            "(weight-only schemes: W4A16, W8A16)")
        weights = scheme.get("weights")
        if not isinstance(weights, dict):
            raise UnsupportedModelError(f"{key}.weights: a weight-only scheme must quantize the weights")
        if weights.get("type", "int") != "int":
            raise UnsupportedModelError(f"{key}.weights.type: {weights['type']!r} weights are not supported (int)")
        self.bits = weights.get("num_bits", 8)
        if self.bits not in (4, 8):
            raise UnsupportedModelError(f"{key}.weights.num_bits: {self.bits} bits are not supported (4 or 8)")
        self.strategy = weights.get("strategy") or "tensor"
        if self.strategy not in STRATEGIES:
            raise UnsupportedModelError(f"{key}.weights.strategy: {self.strategy!r} is not supported "
                                        f"({', '.join(STRATEGIES)})")
        self.group_size = weights.get("group_size")
        if self.strategy == "group" and (not isinstance(self.group_size, int) or self.group_size <= 0):
            raise UnsupportedModelError(f"{key}.weights.group_size: {self.group_size!r} is not a positive integer")
        if weights.get("dynamic"):
            raise UnsupportedModelError(f"{key}.weights.dynamic: dynamic weight scales are not supported")
        fmt = scheme.get("format")
        if fmt not in (None, "pack-quantized"):
            raise UnsupportedModelError(f"{key}.format: {fmt!r} is not supported (pack-quantized)")
        self.symmetric = weights.get("symmetric", True)
        self.targets = [str(t) for t in scheme.get("targets", [])]

    def matches(self, name: str) -> bool:
        return any(t == "Linear" or t == name or (t.startswith("re:") and re.match(t[3:], name))
                   for t in self.targets)


class CompressedTensorsFormat:
    suffixes = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")
    required = ("weight_packed", "weight_scale", "weight_shape")

    def __init__(self, qc: dict[str, Any]):
        fmt = qc.get("format")
        if fmt != "pack-quantized":
            raise UnsupportedModelError(f"quantization_config.format: {fmt!r} is not supported (pack-quantized)")
        status = qc.get("quantization_status", "compressed")
        if status != "compressed":
            raise UnsupportedModelError(f"quantization_config.quantization_status: {status!r} checkpoints are not "
                                        "supported (compressed)")
        for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
            if qc.get(key):
                raise UnsupportedModelError(f"quantization_config.{key}: not supported")
        groups = qc.get("config_groups") or {}
        if not isinstance(groups, dict) or not groups:
            raise UnsupportedModelError("quantization_config.config_groups: no quantization scheme given")
        self.schemes = [_Scheme(f"quantization_config.config_groups.{k}", v) for k, v in groups.items()]
        bits = sorted({s.bits for s in self.schemes})
        self.method = "compressed-tensors-" + "+".join(f"int{b}" for b in bits)

    def _scheme(self, name: str) -> _Scheme:
        for scheme in self.schemes:
            if scheme.matches(name):
                return scheme
        raise WeightsError(f"{name}.weight_packed: no quantization_config.config_groups scheme targets this layer")

    def int_weights(self, name: str, tensors: dict[str, torch.Tensor], in_features: int,
                    out_features: int) -> IntWeights:
        scheme = self._scheme(name)
        bits, offset = scheme.bits, 1 << (scheme.bits - 1)
        shape = tuple(int(v) for v in tensors["weight_shape"].tolist())
        if shape != (out_features, in_features):
            raise WeightsError(f"{name}.weight_shape is {shape}, the config implies {(out_features, in_features)}")
        words = -(-in_features * bits // 32)
        check_shape(f"{name}.weight_packed", tensors["weight_packed"], (out_features, words))
        group = {"group": scheme.group_size}.get(scheme.strategy, in_features)
        if in_features % group:
            raise WeightsError(f"{name}: group_size {group} does not divide its {in_features} input features")
        groups = in_features // group
        scales = tensors["weight_scale"].float()
        if scheme.strategy == "tensor":
            scales = scales.reshape(-1)[:1].expand(out_features, 1) if scales.numel() == 1 else scales
        check_shape(f"{name}.weight_scale", scales, (out_features, groups))
        q = unpack_words(tensors["weight_packed"], bits, dim=1)[:, :in_features]
        zeros = torch.full((out_features, groups), float(offset))
        if not scheme.symmetric and scheme.strategy != "tensor":
            if "weight_zero_point" not in tensors:
                raise WeightsError(f"{name}.weight_zero_point: missing for an asymmetric scheme")
            zp = tensors["weight_zero_point"]
            check_shape(f"{name}.weight_zero_point", zp, (-(-out_features * bits // 32), groups))
            zeros = unpack_words(zp, bits, dim=0)[:out_features].float()
        elif not scheme.symmetric:
            raise WeightsError(f"{name}.weight_zero_point: an asymmetric per-tensor scheme is not supported")
        g_idx = tensors.get("weight_g_idx")
        return IntWeights(name, bits, q.contiguous(), zeros, scales.contiguous(), group,
                          None if g_idx is None else g_idx.long())
