"""Engine configuration: the knobs of `LLM(...)` and `pyserve serve`, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class EngineConfig:
    model: str
    device: str = "auto"
    dtype: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 64
    seed: int = 0
    gpu_memory_fraction: float = 0.85
    attention_backend: str | None = None
    speculative_config: dict[str, Any] | str | None = None  # parsed by SpeculativeConfig.parse
    watchdog_timeout: float | None = 60.0  # seconds without a step before the engine is "stalled"; None = off

    def __post_init__(self) -> None:
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
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise ValueError(f"gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction}")
        if self.watchdog_timeout is not None and not self.watchdog_timeout > 0:
            raise ValueError(f"watchdog_timeout must be positive or None, got {self.watchdog_timeout}")
        if self.max_loras < 0 or self.max_lora_rank < 1:
            raise ValueError("max_loras must be >= 0 and max_lora_rank >= 1")
