"""An EAGLE-3 head's config.json (the layout its authors release), checked against the target it
drafts for. No torch here: the engine reads it before the worker is built."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pyserve.model.config import ModelConfig

HEAD_ARCHITECTURES = ("LlamaForCausalLMEagle3",)


@dataclass(frozen=True, slots=True)
class HeadConfig:
    layer: ModelConfig  # the midlayer's shape (num_layers 1), its rope, its norms' eps
    target_hidden_size: int
    draft_vocab_size: int
    aux_layer_ids: tuple[int, int, int]

    @classmethod
    def from_dir(cls, path: str | Path, target: ModelConfig) -> HeadConfig:
        """The head at `path` (config.json + safetensors), checked against the target it drafts
        for; a mismatch is a ValueError naming it."""
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise ValueError(f"speculative_config.model: no config.json in the head directory {path}")
        raw = json.loads(config_path.read_text())
        archs = raw.get("architectures") or []
        if not any(a in HEAD_ARCHITECTURES for a in archs):
            raise ValueError(f"speculative_config.model: {path} is not an EAGLE-3 head (architectures {archs}; "
                             f"expected {HEAD_ARCHITECTURES[0]})")
        return cls.from_raw(raw, target)

    @classmethod
    def from_raw(cls, raw: dict, target: ModelConfig) -> HeadConfig:
        layer = ModelConfig.from_dict({**raw, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1})
        target_hidden = int(raw.get("target_hidden_size") or layer.hidden_size)
        eagle = raw.get("eagle_config") or {}
        ids = tuple(eagle.get("eagle_aux_hidden_state_layer_ids") or default_aux_layer_ids(target.num_layers))
        config = cls(layer, target_hidden, int(raw.get("draft_vocab_size") or layer.vocab_size), ids)
        config.check(target)
        return config

    def check(self, target: ModelConfig) -> None:
        problems = []
        if self.target_hidden_size != target.hidden_size:
            problems.append(f"it reads hidden states of size {self.target_hidden_size}, the target's are "
                            f"{target.hidden_size}")
        if self.layer.vocab_size != target.vocab_size:
            problems.append(f"its vocabulary has {self.layer.vocab_size} tokens, the target's {target.vocab_size}")
        if self.draft_vocab_size > self.layer.vocab_size:
            problems.append(f"draft_vocab_size {self.draft_vocab_size} exceeds vocab_size {self.layer.vocab_size}")
        ids = self.aux_layer_ids
        if len(ids) != 3 or list(ids) != sorted(set(ids)) or not all(0 <= i < target.num_layers for i in ids):
            problems.append(f"eagle_aux_hidden_state_layer_ids {list(ids)} are not three of the "
                            f"target's {target.num_layers} layers, in increasing order")
        if problems:
            raise ValueError("speculative_config.model: the head does not match the target: " + "; ".join(problems))

    def to_dict(self) -> dict:
        """config.json as the EAGLE-3 layout writes it."""
        c = self.layer
        return {
            "architectures": [HEAD_ARCHITECTURES[0]], "model_type": "llama", "hidden_act": "silu",
            "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
            "num_hidden_layers": 1, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope.theta,
            "max_position_embeddings": c.max_position_embeddings, "vocab_size": c.vocab_size,
            "draft_vocab_size": self.draft_vocab_size, "target_hidden_size": self.target_hidden_size,
            "tie_word_embeddings": False, "torch_dtype": "float32",
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids)},
        }


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """The layers whose inputs a head reads when its config names none: EAGLE-3's (2, L // 2,
    L - 3) where those are three layers in order, else (L // 4, L // 2, L - 1) (models of fewer
    than 8 layers)."""
    n = num_layers
    return (2, n // 2, n - 3) if 2 < n // 2 < n - 3 else (n // 4, n // 2, n - 1)
