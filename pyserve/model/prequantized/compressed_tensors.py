"""compressed-tensors checkpoints (llm-compressor's output, `quant_method: compressed-tensors`):
integer weights packed (`pack-quantized`: W4A16, W8A16, activations unquantized) or stored as int8
(`int-quantized`: W8A16, and W8A8 with dynamic per-token int8 activations, served by w8a8's
layer where the CPU has VNNI).

Per quantized layer, W [out, in], pack-quantized:
- `weight_packed` int32 [out, ceil(in * bits / 32)]: values packed along the input dimension,
  value i of a word in its bits [i * bits, (i + 1) * bits), each stored as value + 2**(bits-1);
- `weight_scale` [out, groups] ([out, 1] per channel, one value per tensor);
- `weight_zero_point` int32 [ceil(out * bits / 32), groups], packed down the output dimension
  (asymmetric schemes only; a symmetric zero is 0);
- `weight_shape` [2]: (out, in);
- `weight_g_idx` [in]: each input column's group (`actorder: group`).
int-quantized: `weight` int8 [out, in] (the signed values), `weight_scale` as above and, for
an asymmetric scheme, `weight_zero_point` int8 [out, groups] unpacked.
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
FORMATS = ("pack-quantized", "int-quantized")
INT8_ACTIVATIONS = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": True, "strategy": "token"}


def _int8_activations(key: str, args: Any) -> bool:
    """Whether a scheme's input_activations are W8A8's (int8, symmetric, a scale per token computed
    as the layer runs: what w8a8's layer does); None is unquantized; anything else is refused."""
    if args is None:
        return False
    if not isinstance(args, dict):
        raise UnsupportedModelError(f"{key}: must be an object")
    for field, want in INT8_ACTIVATIONS.items():
        if args.get(field) != want:
            raise UnsupportedModelError(f"{key}.{field}: {args.get(field)!r} is not supported; activations are "
                                        "served as dynamic, symmetric, per-token int8 only")
    return True


class _Scheme:
    def __init__(self, key: str, scheme: Any):
        if not isinstance(scheme, dict):
            raise UnsupportedModelError(f"{key}: a preset name for targets is not supported, only a full scheme")
        if scheme.get("output_activations") is not None:
            raise UnsupportedModelError(f"{key}.output_activations: output quantization is not supported")
        self.int8_activations = _int8_activations(f"{key}.input_activations", scheme.get("input_activations"))
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
        if fmt not in (None, *FORMATS):
            raise UnsupportedModelError(f"{key}.format: {fmt!r} is not supported ({', '.join(FORMATS)})")
        self.symmetric = weights.get("symmetric", True)
        if self.int8_activations and (self.bits != 8 or not self.symmetric or self.strategy == "group"):
            raise UnsupportedModelError(f"{key}.weights: int8 activations are served with 8-bit symmetric weights, "
                                        "one scale per channel or tensor (W8A8)")
        self.targets = [str(t) for t in scheme.get("targets", [])]

    def matches(self, name: str) -> bool:
        return any(t == "Linear" or t == name or (t.startswith("re:") and re.match(t[3:], name))
                   for t in self.targets)


class CompressedTensorsFormat:
    def __init__(self, qc: dict[str, Any]):
        fmt = qc.get("format")
        if fmt not in FORMATS:
            raise UnsupportedModelError(f"quantization_config.format: {fmt!r} is not supported ({', '.join(FORMATS)})")
        self.packed = fmt == "pack-quantized"
        if self.packed:
            self.suffixes = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")
            self.required = ("weight_packed", "weight_scale", "weight_shape")
        else:  # an integer `weight` (QuantizedCheckpoint.owns tells it from a float one)
            self.suffixes = ("weight", "weight_scale", "weight_zero_point")
            self.required = ("weight", "weight_scale")
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
        if self.packed and any(s.int8_activations for s in self.schemes):
            raise UnsupportedModelError("quantization_config.format: int8 activations come in int-quantized "
                                        "checkpoints, not pack-quantized ones")
        kinds = sorted({"w8a8" if s.int8_activations else f"int{s.bits}" for s in self.schemes})
        self.method = "compressed-tensors-" + "+".join(kinds)

    def _scheme(self, name: str) -> _Scheme:
        for scheme in self.schemes:
            if scheme.matches(name):
                return scheme
        raise WeightsError(f"{name}.weight_scale: no quantization_config.config_groups scheme targets this layer")

    def int_weights(self, name: str, tensors: dict[str, torch.Tensor], in_features: int,
                    out_features: int) -> IntWeights:
        scheme = self._scheme(name)
        bits, offset = scheme.bits, 1 << (scheme.bits - 1)
        if self.packed:
            shape = tuple(int(v) for v in tensors["weight_shape"].tolist())
            if shape != (out_features, in_features):
                raise WeightsError(f"{name}.weight_shape is {shape}, the config implies {(out_features, in_features)}")
            words = -(-in_features * bits // 32)
            check_shape(f"{name}.weight_packed", tensors["weight_packed"], (out_features, words))
        else:
            if bits != 8 or tensors["weight"].dtype != torch.int8:
                raise WeightsError(f"{name}.weight: an int-quantized weight must be int8 (8 bits), "
                                   f"got {tensors['weight'].dtype} for {bits} bits")
            check_shape(f"{name}.weight", tensors["weight"], (out_features, in_features))
        group = {"group": scheme.group_size}.get(scheme.strategy, in_features)
        if in_features % group:
            raise WeightsError(f"{name}: group_size {group} does not divide its {in_features} input features")
        groups = in_features // group
        scales = tensors["weight_scale"].float()
        if scheme.strategy == "tensor":
            scales = scales.reshape(-1)[:1].expand(out_features, 1) if scales.numel() == 1 else scales
        check_shape(f"{name}.weight_scale", scales, (out_features, groups))
        if self.packed:
            q = unpack_words(tensors["weight_packed"], bits, dim=1)[:, :in_features]
        else:
            q = tensors["weight"].int() + offset
        zeros = torch.full((out_features, groups), float(offset))
        if not scheme.symmetric and scheme.strategy != "tensor":
            if "weight_zero_point" not in tensors:
                raise WeightsError(f"{name}.weight_zero_point: missing for an asymmetric scheme")
            zp = tensors["weight_zero_point"]
            if self.packed:
                check_shape(f"{name}.weight_zero_point", zp, (-(-out_features * bits // 32), groups))
                zeros = unpack_words(zp, bits, dim=0)[:out_features].float()
            else:
                check_shape(f"{name}.weight_zero_point", zp, (out_features, groups))
                zeros = zp.float() + offset
        elif not scheme.symmetric:
            raise WeightsError(f"{name}.weight_zero_point: an asymmetric per-tensor scheme is not supported")
        g_idx = tensors.get("weight_g_idx")
        return IntWeights(name, bits, q.contiguous(), zeros, scales.contiguous(), group,
                          None if g_idx is None else g_idx.long(), scheme.int8_activations)
