"""The model's `config.json`, read into one validated dataclass.

Anything pyserve cannot serve exactly (an unknown architecture, activation, RoPE variant, or a
sliding window shorter than the served context) is refused here, at load time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
DEFAULT_MAX_MODEL_LEN = 8192  # the served context when none is asked for, if the model's is longer


class UnsupportedModelError(ValueError):
    """The checkpoint uses an architecture or feature pyserve does not serve."""


@dataclass(slots=True, frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(slots=True, frozen=True)
class ModelConfig:
    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    torch_dtype: str
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"no config.json in model directory {path}")
        return cls.from_dict(json.loads(config_path.read_text()))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModelError(
                f"architecture {archs or raw.get('model_type')!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported (only 'silu')")
        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}"
            )
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        window = _sliding_window(raw, family)
        attention_bias = bool(raw.get("attention_bias", False)) and family in ("llama", "qwen3")
        return cls(
            architecture=arch,
            family=family,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=int(raw.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=_rope(raw),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or attention_bias,
            o_bias=attention_bias,
            mlp_bias=family == "llama" and bool(raw.get("mlp_bias", False)),
            qk_norm=family == "qwen3",
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=window,
            raw=raw,
        )

    def served_length(self, max_model_len: int | None) -> int:
        """The context served: `max_model_len` when given, else the model's own, at most
        DEFAULT_MAX_MODEL_LEN."""
        return max_model_len or min(self.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)

    def check_context(self, max_model_len: int) -> None:
        """Refuses a served context the model cannot attend over exactly, or was not trained for
        (past its positions, as vLLM refuses; linear RoPE scaling stretches them by its factor)."""
        trained = int(self.max_position_embeddings * (self.rope.factor if self.rope.rope_type == "linear" else 1))
        if max_model_len > trained:
            raise UnsupportedModelError(
                f"max_model_len {max_model_len} is longer than the model's context of {trained} tokens "
                "(max_position_embeddings in its config): positions past it were never trained"
            )
        if self.sliding_window is not None and self.sliding_window < max_model_len:
            raise UnsupportedModelError(
                f"sliding_window {self.sliding_window} is shorter than max_model_len {max_model_len}; "
                "sliding-window attention is not supported (serve with a shorter max_model_len)"
            )


def _rope(raw: dict[str, Any]) -> RopeConfig:
    # transformers 5 writes `rope_parameters`; earlier versions `rope_theta` + `rope_scaling`.
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return RopeConfig(theta=theta)
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def _sliding_window(raw: dict[str, Any], family: str) -> int | None:
    window = raw.get("sliding_window")
    if window is None:
        return None
    if family in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False):
        return None
    return int(window)
