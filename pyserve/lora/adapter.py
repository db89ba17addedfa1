"""Loading a PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) and
checking it against the base model before it can touch the engine. Every refusal is a LoraError
(a ValueError) that says why."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
PICKLED = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")


class LoraError(ValueError):
    pass


@dataclass(slots=True)
class LoraAdapter:
    """One adapter's weights on the CPU: (layer, module) -> (A [r, in], B [out, r])."""

    rank: int
    scaling: float  # lora_alpha / r, or lora_alpha / sqrt(r) for rsLoRA
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    path: str = ""  # where it was loaded from (tensor-parallel ranks load it from there too)


def load_adapter(path: str | Path, shapes: dict[str, tuple[int, int]], num_layers: int,
                 max_rank: int) -> LoraAdapter:
    """`shapes`: module name -> (in_features, out_features) of the base model."""
    path = Path(path)
    if not path.is_dir():
        raise LoraError(f"lora_path: {path} is not a directory")
    if any((path / name).exists() for name in PICKLED):
        raise LoraError("lora_path: pickled adapter weights are refused; use adapter_model.safetensors")
    config_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not config_file.is_file() or not weights_file.is_file():
        raise LoraError("lora_path: needs adapter_config.json and adapter_model.safetensors")
    try:
        cfg = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise LoraError(f"adapter_config.json is not valid JSON ({e})") from None
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"adapter_config.json: peft_type {cfg.get('peft_type')!r} is not LORA")
    if cfg.get("use_dora") or cfg.get("rank_pattern") or cfg.get("alpha_pattern") or cfg.get("bias", "none") != "none":
        raise LoraError("adapter_config.json: DoRA, per-module rank/alpha patterns and LoRA biases are not supported")
    rank = cfg.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise LoraError(f"adapter_config.json: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoraError(f"adapter rank {rank} exceeds max_lora_rank {max_rank}")
    targets = cfg.get("target_modules") or []
    if isinstance(targets, str) or not set(targets) <= set(TARGETS):
        raise LoraError(f"adapter_config.json: target_modules {targets!r} must be a list drawn from {list(TARGETS)}")
    alpha = cfg.get("lora_alpha", rank)
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(weights_file, "pt") as f:
            for key in f.keys():
                m = _KEY.match(key)
                if m is None or m.group(3) not in targets:
                    raise LoraError(f"adapter weight {key} is not a LoRA weight of a target module")
                layer, module, which = int(m.group(1)), m.group(3), m.group(4)
                if layer >= num_layers:
                    raise LoraError(f"adapter weight {key}: the base model has {num_layers} layers")
                tensor = f.get_tensor(key).float()
                if not bool(torch.isfinite(tensor).all()):
                    raise LoraError(f"adapter weight {key} holds NaN or infinite values")
                pairs.setdefault((layer, module), {})[which] = tensor
    except SafetensorError as e:  # a truncated or corrupt file
        raise LoraError(f"adapter_model.safetensors cannot be read: {e}") from e
    weights = {}
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoraError(f"adapter layer {layer} {module}: needs both lora_A and lora_B")
        fan_in, fan_out = shapes[module]
        if tuple(ab["A"].shape) != (rank, fan_in) or tuple(ab["B"].shape) != (fan_out, rank):
            raise LoraError(f"adapter layer {layer} {module}: lora_A {tuple(ab['A'].shape)} / lora_B "
                            f"{tuple(ab['B'].shape)} do not fit the base ({fan_in} -> {fan_out}) at rank {rank}")
        weights[(layer, module)] = (ab["A"], ab["B"])
    if not weights:
        raise LoraError("adapter_model.safetensors holds no LoRA weights")
    return LoraAdapter(rank, scaling, weights, str(path))
