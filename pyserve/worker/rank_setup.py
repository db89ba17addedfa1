"""What every rank of a model resolves and builds alike from the EngineConfig: the device, the
dtype, the attention backend, the LoRA slots, the spec a follower rank builds from, the check that
a model can be split over ranks, and the finishing of a loaded model (fuse, quantize, CPU kernels).
"""

from __future__ import annotations

from pathlib import Path

import torch

from pyserve.config import EngineConfig
from pyserve.model.config import ModelConfig
from pyserve.model.cpu_linear import can_use, use_cpu_linears
from pyserve.model.quantized_linear import quantize_linears
from pyserve.parallel.launch import RankSpec
from pyserve.parallel.layers import check_divisible

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def check_parallel(cfg: ModelConfig, size: int, device: torch.device, quantization: str | None) -> None:
    """ValueError naming the field when the model cannot be served over `size` ranks here."""
    check_divisible(cfg, size)
    if quantization == "w8a8":  # a rank's slice of x would be quantized by a scale of its own
        raise ValueError("quantization: w8a8 is not split over ranks (tensor_parallel_size 1, or int8)")
    if device.type == "cuda" and torch.cuda.device_count() < size:
        raise ValueError(f"tensor_parallel_size {size} is more ranks than this machine's "
                         f"{torch.cuda.device_count()} CUDA devices")
    if torch.distributed.is_initialized():
        raise ValueError("tensor_parallel_size: this process already belongs to a torch.distributed group "
                         "(one tensor-parallel model per process)")


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was requested but CUDA is not available")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    return dev


def resolve_dtype(dtype: str, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32  # half precision matmuls are slow on CPUs
        return DTYPES.get(cfg.torch_dtype, torch.bfloat16)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def attention_backend(config: EngineConfig, device: torch.device) -> str:
    """The backend `config` names, else Triton on CUDA and torch's (with the CPU kernels) elsewhere."""
    return config.attention_backend or ("triton" if device.type == "cuda" else "torch")


def lora_slots(config: EngineConfig) -> int:
    """Adapters resident per step: `max_loras` where LoRA is enabled, else none."""
    return config.max_loras if config.enable_lora else 0


def rank_spec(config: EngineConfig, model_dir: str, max_model_len: int, dtype: torch.dtype, backend: str) -> RankSpec:
    """What a follower rank builds its shard from: `config` as rank 0 resolved it."""
    return RankSpec(str(Path(model_dir).resolve()), next(k for k, v in DTYPES.items() if v == dtype),
                    config.block_size, max_model_len, config.seed, config.quantization,
                    config.quantization_group_size, config.gguf_dequantize, backend, lora_slots(config),
                    config.max_lora_rank)


def finish_model(model, device: torch.device, dtype: torch.dtype, *, fuse: bool, quantization: str | None,
                 group_size: int) -> None:
    """A loaded model made ready to serve, in place: q/k/v and gate/up fused (`fuse`: no LoRA
    wraps them), quantized (after LoRA wrapped its base projections: those are quantized too),
    and on fp32 CPUs given the CPU kernels (after both: every projection is replaced)."""
    if fuse:
        model.fuse_projections()
    if quantization is not None:
        quantize_linears(model, quantization, group_size)
    if can_use(device, dtype):
        use_cpu_linears(model)
        model.use_cpu_ops()
