"""Reads safetensors weights (one file or sharded with an index), or a GGUF file's tensors
(model/gguf). Pickled weights are refused.

The files are memory-mapped (safetensors does it): a checkpoint tensor already in the serving
dtype on the CPU becomes the parameter itself, with no copy; others are converted or moved once.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import structlog
import torch
from safetensors import safe_open
from torch import nn
from torch.overrides import TorchFunctionMode

from pyserve.model.config import ModelConfig
from pyserve.model.decoder import CausalLM
from pyserve.model.errors import WeightsError
from pyserve.model.gguf import gguf_path, open_gguf
from pyserve.model.gguf.weights import GgufWeights
from pyserve.model.prequantized import checkpoint_quantization

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# What the layers' reset_parameters call to fill a new tensor in place (nn.init's functions reach a
# TorchFunctionMode themselves, before the tensor methods they call).
_INIT_CALLS = {nn.init.normal_, nn.init.uniform_, nn.init.kaiming_uniform_,
               torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.fill_, torch.Tensor.zero_}

log = structlog.get_logger("pyserve.model")


class _SkipInit(TorchFunctionMode):
    """Leaves tensors built under it uninitialized: on `meta` there is nothing to fill, yet torch
    runs `normal_` (and `empty_like`) there through its Python decompositions, whose first use
    imports torch._dynamo and sympy (~2 s of a start)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _INIT_CALLS:
            return args[0] if args else kwargs["tensor"]  # nn.init passes its tensor by name
        return func(*args, **(kwargs or {}))


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
    """(name, tensor) pairs from every shard, on the CPU: views of the memory-mapped file, which
    stay valid after the file is closed (the mapping lives as long as a tensor uses it)."""
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_model(
    model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_positions: int,
    gguf_dequantize: bool,
) -> CausalLM:
    """Builds the model on `device` with every parameter taken from the checkpoint, strictly: a
    missing or unexpected tensor, or a shape mismatch, is an error naming it. The linear layers of a
    pre-quantized checkpoint (`quantization_config`: model/prequantized) are read into pyserve's
    quantized layers and the method is kept as `model.checkpoint_quantization`. Logs
    `weights_loaded` (tensors, bytes, seconds, GB/s, how many were used in place) where structlog
    is configured. A GGUF file (model/gguf) is read the same way, its quantized projections served as
    model/gguf/weights.py says, or widened to `dtype` with `gguf_dequantize`.

    NOTE: a tensor used in place is the file's pages, mapped copy-on-write and read from the page
    cache when first touched: the file must not be truncated or rewritten in place while the model
    is served (replacing it by a rename is safe)."""
    start = time.perf_counter()
    with torch.device("meta"), _SkipInit():
        model = CausalLM(cfg, dtype, max_positions)
    for module in model.modules():  # buffers (the RoPE tables) are computed, not loaded
        for name, buf in module.named_buffers(recurse=False):  # NOTE: not to_empty: see _SkipInit
            setattr(module, name, torch.empty(buf.shape, dtype=buf.dtype, device=device))
    params = dict(model.named_parameters(remove_duplicate=False))
    gguf = gguf_path(model_dir)
    if gguf is None:
        quantized, tensors = checkpoint_quantization(cfg.raw), iter_weights(model_dir)
    else:
        quantized = GgufWeights(open_gguf(gguf), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, gguf_dequantize,
                                device)
        tensors = quantized.tensors()
    packed: dict[str, dict[str, torch.Tensor]] = {}  # quantized layer -> its tensors, by suffix
    loaded: set[str] = set()
    unexpected = []
    num_tensors = num_bytes = in_place = 0
    for name, tensor in tensors:
        if name.endswith("rotary_emb.inv_freq"):
            continue  # a cached buffer some exporters keep
        param = params.get(name)
        if quantized is not None and quantized.owns(name, tensor):
            owner, _, leaf = name.rpartition(".")
            packed.setdefault(owner, {})[leaf] = tensor
            num_tensors, num_bytes = num_tensors + 1, num_bytes + tensor.nbytes
            continue
        if param is None:
            unexpected.append(name)
            continue
        if param.shape != tensor.shape:
            raise WeightsError(f"weight {name} has shape {tuple(tensor.shape)}, the config implies {tuple(param.shape)}")
        value = tensor.to(device=device, dtype=dtype)
        num_tensors, num_bytes, in_place = num_tensors + 1, num_bytes + tensor.nbytes, in_place + (value is tensor)
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, nn.Parameter(value, requires_grad=param.requires_grad))
        loaded.add(name)
    for owner, tensors in packed.items():  # after the loop: a layer's bias may come after its packed tensors
        module = model.get_submodule(owner) if f"{owner}.weight" in params else None
        parent, _, child = owner.rpartition(".")
        if isinstance(module, nn.Embedding) and hasattr(quantized, "embedding"):  # a GGUF table in its blocks
            setattr(model.get_submodule(parent), child, quantized.embedding(tensors["weight"], module, dtype))
        elif isinstance(module, nn.Linear):
            setattr(model.get_submodule(parent), child, quantized.layer(owner, tensors, module, dtype, device))
        else:
            unexpected.extend(f"{owner}.{leaf}" for leaf in tensors)
            continue
        loaded.add(f"{owner}.weight")
    if unexpected:
        raise WeightsError(f"checkpoint has tensors this architecture does not use: {', '.join(unexpected[:8])}")
    if cfg.tie_word_embeddings:  # the head is the input embedding, whatever the checkpoint holds
        model.lm_head.weight = model.model.embed_tokens.weight
        loaded.add("lm_head.weight")
    missing = sorted(set(params) - loaded)
    if missing:
        raise WeightsError(f"checkpoint is missing tensors: {', '.join(missing[:8])}")
    model.model.rotary.reset()
    model.checkpoint_quantization = None if quantized is None else quantized.method
    seconds = max(round(time.perf_counter() - start, 6), 1e-6)  # the rate is of the seconds logged
    if structlog.is_configured():  # by the server (pyserve.logs); an offline LLM's stdout stays clean
        log.info("weights_loaded", path=str(model_dir), tensors=num_tensors, bytes=num_bytes, in_place=in_place,
                 seconds=seconds, gb_per_s=round(num_bytes / seconds / 1e9, 2))
    return model.eval()
