"""Reads safetensors weights (one file or sharded with an index). Pickled weights are refused."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from pyserve.model.config import ModelConfig
from pyserve.model.decoder import CausalLM

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class WeightsError(ValueError):
    """The model directory has no usable safetensors weights."""


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a model directory, in index order when sharded."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (model_dir / n).is_file()]
        if missing:
            raise WeightsError(f"shards listed in {index.name} are missing: {', '.join(missing)}")
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    pickled = sorted(p.name for p in model_dir.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickled:
        raise WeightsError(
            f"{model_dir} holds only pickled weights ({', '.join(pickled)}); pyserve loads safetensors "
            "only, since unpickling can run arbitrary code. Convert them with safetensors first."
        )
    raise WeightsError(f"no *.safetensors weights in {model_dir}")


def iter_weights(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs from every shard, on the CPU."""
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_model(
    model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_positions: int
) -> CausalLM:
    """Builds the model on `device` and fills every parameter from the checkpoint, strictly: a
    missing or unexpected tensor, or a shape mismatch, is an error naming it."""
    with torch.device("meta"):
        model = CausalLM(cfg, dtype, max_positions)
    model = model.to_empty(device=device).to(dtype)
    if cfg.tie_word_embeddings:  # moving off `meta` unties shared parameters
        model.lm_head.weight = model.model.embed_tokens.weight
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    unexpected = []
    for name, tensor in iter_weights(model_dir):
        if name.endswith("rotary_emb.inv_freq"):
            continue  # a cached buffer some exporters keep
        param = params.get(name)
        if param is None:
            unexpected.append(name)
            continue
        if param.shape != tensor.shape:
            raise WeightsError(f"weight {name} has shape {tuple(tensor.shape)}, the config implies {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(tensor.to(dtype))
        loaded.add(name)
    if unexpected:
        raise WeightsError(f"checkpoint has tensors this architecture does not use: {', '.join(unexpected[:8])}")
    if cfg.tie_word_embeddings:
        loaded.add("lm_head.weight")
    missing = sorted(set(params) - loaded)
    if missing:
        raise WeightsError(f"checkpoint is missing tensors: {', '.join(missing[:8])}")
    model.model.rotary.reset()
    return model.eval()
