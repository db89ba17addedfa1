"""Engine configuration: the knobs of `LLM(...)` and `pyserve serve`, validated on construction.

A floor of its own, below both the engine and the model worker, which are built from it: it
imports nothing of pyserve but `options`."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from pyserve.options import option


@dataclass(slots=True)
class EngineConfig:
    """Every engine default, spelled once: `LLM(...)` takes these fields as keywords and
    `pyserve serve` / `pyserve batch` derive their flags from them (pyserve.options)."""

    model: str  # a model directory, a GGUF file, or a hub id (ORG/NAME, ORG/NAME:FILE.gguf): model/hub.py
    revision: str | None = option(None, "hub ids: the branch, tag or commit to download", type=str)
    gguf_file: str | None = option(None, "the GGUF file to serve from a hub repository or a local folder", type=str)
    device: str = option("auto", "auto | cpu | cuda")
    dtype: str = option("auto", "auto | float32 | float16 | bfloat16")
    block_size: int = option(16, "tokens per KV block")
    num_kv_blocks: int | None = option(None, "KV blocks in the pool (default: as many as memory allows)", type=int)
    max_num_seqs: int = option(256, "sequences in one step at most")
    max_num_batched_tokens: int = option(2048, "tokens in one step at most")
    max_model_len: int | None = option(None, "context length (default: the model's, at most 8192)", type=int)
    enable_prefix_caching: bool = option(True, "turn the radix prefix cache off", flag="--no-prefix-caching")
    max_background_seqs: int = option(
        4, "batch-job sequences in a step while interactive requests run, or ran within the last "
           "second (otherwise batch jobs fill the step)")
    enable_lora: bool = option(False, "serve LoRA adapters (per-request, batched)")
    max_loras: int = option(4, "adapters resident on the device per step")
    max_lora_rank: int = option(64, "largest adapter rank accepted")
    seed: int = option(0, "seed of the shared sampling generator")
    quantization: str | None = option(  # checked by the model worker (model/quantized_linear.py)
        None, "quantization at load: int8 (weights only, symmetric, one scale per output channel), int4 "
        "(weights only, a scale and zero point per group of inputs), fp8 (e4m3 weights, one scale per output "
        "channel; CUDA compute capability 8.9+) or w8a8 (int8's weights and int8 activations, a scale per "
        "row; CPUs with VNNI: for batches, where int8's f32 arithmetic is the limit)", type=str)
    quantization_group_size: int = option(32, "int4: inputs per group of a scale and an offset (32, 64 or 128)")
    gguf_dequantize: bool = option(
        False, "GGUF: widen the file's quantized weights to the serving dtype once at load, instead of serving its "
        "4- and 8-bit blocks on the int4 and int8 paths")
    tensor_parallel_size: int = option(
        1, "ranks the model is split over (heads, MLP features and vocabulary), each a process on this machine "
        "(on CUDA one device each; on CPUs torch.distributed's gloo)")
    distributed_timeout: float = option(
        60.0, "seconds a tensor-parallel collective may wait on a rank before the engine is failed")
    enforce_eager: bool = option(False, "CUDA: run decode steps op by op instead of replaying CUDA graphs "
                                        "(captured per batch and context bucket the first time one runs)")
    gpu_memory_fraction: float = option(  # not vLLM's gpu_memory_utilization, a share of all memory
        0.85, "CUDA: the share of the device memory free once the weights are loaded that the KV cache takes (the "
        "rest is left to activations)")
    kv_cache_share: float = 1.0  # of the automatic KV budget, for servers of several models (server/model_specs.py)
    attention_backend: str | None = None
    speculative_config: dict[str, Any] | str | None = option(  # parsed by SpeculativeConfig.parse
        None, 'JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' or {"method": "draft_model"}', type=str)
    max_inter_token_latency: float | None = option(  # 0 or None = off
        0.125, "seconds: while streams decode, a prompt is computed in chunks sized from the measured cost of a step "
        "so that each step's forward stays under this (0 = off: chunks of max-num-batched-tokens)", type=float)
    grammar_forced_tokens: bool = option(
        True, "compute the tokens a grammar forces one per step instead of verifying them all in one step",
        flag="--no-grammar-forced-tokens")
    watchdog_timeout: float | None = option(  # None = off
        60.0, "seconds with requests held but no step completed before the engine is stalled and /health fails "
        "(0 = off)", type=float)

    def __post_init__(self) -> None:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1) or self.block_size > 1024:
            raise ValueError(f"block_size must be a power of two in [1, 1024], got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be at least 2, got {self.num_kv_blocks}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError(
                f"max_num_batched_tokens must be at least block_size ({self.block_size}), "
                f"got {self.max_num_batched_tokens}"
            )
        if self.max_background_seqs < 0:
            raise ValueError(f"max_background_seqs must be >= 0, got {self.max_background_seqs}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise ValueError(f"gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction}")
        if not 0.0 < self.kv_cache_share <= 1.0:
            raise ValueError(f"kv_cache_share must be in (0, 1], got {self.kv_cache_share}")
        if self.max_inter_token_latency is not None and not 0 <= self.max_inter_token_latency < math.inf:
            raise ValueError(f"max_inter_token_latency must be >= 0 seconds or None, got {self.max_inter_token_latency}")
        if self.watchdog_timeout is not None and not self.watchdog_timeout > 0:
            raise ValueError(f"watchdog_timeout must be positive or None, got {self.watchdog_timeout}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}")
        if not self.distributed_timeout > 0:
            raise ValueError(f"distributed_timeout must be positive, got {self.distributed_timeout}")
        if self.max_loras < 0 or self.max_lora_rank < 1:
            raise ValueError("max_loras must be >= 0 and max_lora_rank >= 1")
