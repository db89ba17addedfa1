"""LoRARequest: which adapter a request runs with (vLLM-style)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int  # > 0; the scheduler's adapter id (its prefix-cache namespace)
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_request.lora_int_id must be a positive integer, got {self.lora_int_id!r}")
