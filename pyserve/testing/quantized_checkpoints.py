"""Tiny pre-quantized checkpoints for the tests, each written from one tiny full-precision model:
its decoder's linear layers quantized (min-max, in groups) and packed as compressed-tensors
(by that library's own compressors: pack-quantized, or int-quantized with or without int8
activations), GPTQ (by AutoAWQ's exllama packer, which writes GPTQ's
layout) or AWQ (GEMM packing, written here by the format's definition), beside a full-precision
reference checkpoint holding exactly the weights pyserve serves for the packed one (`Quantized.served`).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the column of word c's nibble i is 8c + AWQ_ORDER[i]


def awq_packing_utils():
    """AutoAWQ's `awq/utils/packing_utils.py`, loaded by path: importing the `awq` package itself
    loads its models, which need an older transformers."""
    spec = importlib.util.find_spec("awq")
    path = Path(spec.submodule_search_locations[0]) / "utils" / "packing_utils.py"
    module_spec = importlib.util.spec_from_file_location("awq_packing_utils", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


@dataclass
class Quantized:
    """One layer's integers: W [out, in] ~ (q - zeros[:, g]) * scales[:, g], g = g_idx[j]."""

    q: torch.Tensor  # int32 [out, in], 0 .. 2**bits - 1
    zeros: torch.Tensor  # int32 [out, groups]
    scales: torch.Tensor  # float16 [out, groups]
    g_idx: torch.Tensor  # int32 [in]
    bits: int

    def dequantized(self) -> torch.Tensor:
        g = self.g_idx.long()
        return (self.q - self.zeros[:, g]).float() * self.scales.float()[:, g]

    def served(self) -> torch.Tensor:
        """The weights pyserve serves: `dequantized`, except that a 4-bit layer holds each group's
        offset -zeros * scales rounded to f16 (Int4Linear), and computes q * scales + offset."""
        if self.bits != 4:
            return self.dequantized()
        g = self.g_idx.long()
        offsets = (-self.zeros.float() * self.scales.float()).half().float()
        return self.q.float() * self.scales.float()[:, g] + offsets[:, g]


def quantize(w: torch.Tensor, bits: int, group: int, symmetric: bool, act_order: bool, seed: int) -> Quantized:
    """Min-max quantization of `w` in groups of `group` inputs; `act_order`: the groups gather
    a random permutation of the columns (as GPTQ's desc_act does)."""
    n, k = w.shape
    order = torch.randperm(k, generator=torch.Generator().manual_seed(seed)) if act_order else torch.arange(k)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // group).int()
    cols = w[:, order].reshape(n, k // group, group)
    top = (1 << bits) - 1
    if symmetric:
        scales = (cols.abs().amax(dim=2) / (top // 2)).clamp_min(1e-6).half()
        zeros = torch.full(scales.shape, (top + 1) // 2, dtype=torch.int32)
    else:
        lo, hi = cols.amin(dim=2).clamp(max=0), cols.amax(dim=2).clamp(min=0)
        scales = ((hi - lo) / top).clamp_min(1e-6).half()
        zeros = torch.round(-lo / scales.float()).clamp(0, top).int()
    g = g_idx.long()
    q = torch.round(w / scales.float()[:, g]) + zeros[:, g]
    return Quantized(q.clamp(0, top).int(), zeros, scales, g_idx, bits)


def _decoder_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear) and ".layers." in name]


def write_quantized(src: Path, dst: Path, ref: Path, method: str, bits: int = 4, group: int = 32,
                    symmetric: bool = True, act_order: bool = False) -> dict[str, Quantized]:
    """Writes `dst` (the packed checkpoint, `method` one of gptq / awq / compressed-tensors /
    compressed-tensors-int (int-quantized, W8A16) / compressed-tensors-w8a8 (int-quantized, dynamic
    per-token int8 activations)) and `ref` (full precision, the weights `dst` decodes to) from the
    model in `src`; returns each layer's integers."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    layers = {}
    for i, (name, linear) in enumerate(_decoder_linears(model)):
        layer_group = linear.in_features if group == -1 else group
        layers[name] = quantize(linear.weight.detach(), bits, layer_group, symmetric, act_order, seed=i)
        with torch.no_grad():
            linear.weight.copy_(layers[name].served())
    shutil.copytree(src, ref, dirs_exist_ok=True)
    model.save_pretrained(ref, safe_serialization=True)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        del tensors["lm_head.weight"]
    packers = {"gptq": _gptq_tensors, "awq": _awq_tensors, "compressed-tensors": _compressed_tensors,
               "compressed-tensors-int": _int_quantized, "compressed-tensors-w8a8": _int_quantized}
    for name, quantized in layers.items():
        del tensors[f"{name}.weight"]
        for suffix, t in packers[method](quantized, bits, group, symmetric).items():
            tensors[f"{name}.{suffix}"] = t.contiguous()
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = _config(method, bits, group, symmetric, act_order)
    (dst / "config.json").write_text(json.dumps(config))
    return layers


def _config(method: str, bits: int, group: int, symmetric: bool, act_order: bool) -> dict:
    if method == "gptq":
        return {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order, "sym": symmetric,
                "checkpoint_format": "gptq", "damp_percent": 0.01, "true_sequential": True}
    if method == "awq":
        return {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True, "version": "gemm"}
    from compressed_tensors.quantization import QuantizationConfig

    fmt = "pack-quantized" if method == "compressed-tensors" else "int-quantized"
    scheme = _scheme(bits, group, symmetric, method == "compressed-tensors-w8a8")
    return QuantizationConfig(config_groups={"group_0": scheme}, format=fmt, ignore=["lm_head"],
                              quantization_status="compressed").model_dump(mode="json")


def _scheme(bits: int, group: int, symmetric: bool, int8_activations: bool = False):
    """compressed-tensors' scheme of the layers (-1: one group a row); with int8 activations,
    W8A8's dynamic per-token ones."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    strategy = "channel" if group == -1 else "group"
    weights = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy=strategy,
                               group_size=None if group == -1 else group)
    activations = QuantizationArgs(num_bits=8, type="int", symmetric=True, dynamic=True,
                                   strategy="token") if int8_activations else None
    return QuantizationScheme(targets=["Linear"], weights=weights, input_activations=activations)


def _gptq_tensors(qz: Quantized, bits: int, group: int, symmetric: bool) -> dict[str, torch.Tensor]:
    """GPTQ v1 ("gptq" checkpoint format): the zero points stored minus one."""
    pack_exllama = awq_packing_utils().pack_exllama
    qweight, qzeros = pack_exllama(qz.q.T.contiguous(), (qz.zeros - 1).T.contiguous(), bits)
    return {"qweight": qweight, "qzeros": qzeros, "scales": qz.scales.T, "g_idx": qz.g_idx}


def _awq_tensors(qz: Quantized, bits: int, group: int, symmetric: bool) -> dict[str, torch.Tensor]:
    def pack(values: torch.Tensor) -> torch.Tensor:  # [rows, out] -> [rows, out / 8], AWQ's column order
        words = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int64)
        for i, col in enumerate(AWQ_ORDER):
            words |= values[:, col::8].long() << (4 * i)
        return torch.where(words >= 1 << 31, words - (1 << 32), words).int()

    return {"qweight": pack(qz.q.T), "qzeros": pack(qz.zeros.T), "scales": qz.scales.T}


def _compressed_tensors(qz: Quantized, bits: int, group: int, symmetric: bool) -> dict[str, torch.Tensor]:
    """Packed by compressed-tensors' own compressor from the weight and its signed scale and zero."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    return dict(PackedQuantizationCompressor.compress(_state(qz, bits), _scheme(bits, group, symmetric)))


def _int_quantized(qz: Quantized, bits: int, group: int, symmetric: bool) -> dict[str, torch.Tensor]:
    """int8 weights as they are, by compressed-tensors' int-quantized compressor (the activations'
    scheme does not change the weights' tensors)."""
    from compressed_tensors.compressors.naive_quantized.base import IntQuantizationCompressor

    return dict(IntQuantizationCompressor.compress(_state(qz, bits), _scheme(bits, group, symmetric, True)))


def _state(qz: Quantized, bits: int) -> dict[str, torch.Tensor]:
    """What a compressor quantizes: the weight (exactly on the grid), its scale and signed zero."""
    offset = 1 << (bits - 1)
    return {"weight": qz.dequantized(), "weight_scale": qz.scales,
            "weight_zero_point": (qz.zeros - offset).to(torch.int8)}
