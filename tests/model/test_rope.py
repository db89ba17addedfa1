"""RoPE: the inverse frequencies read from a config (llama3 scaling; linear, in the legacy
`rope_scaling` form) equal transformers'."""

from __future__ import annotations

import torch

from pyserve.model.config import ModelConfig
from pyserve.model.rope import inv_frequencies
from pyserve.testing import LLAMA_CONFIG


def test_llama3_rope_inv_frequencies_equal_transformers(model_dirs):
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = ModelConfig.from_dir(model_dirs["llama"])
    assert cfg.rope.rope_type == "llama3" and cfg.rope.factor == 8.0
    want, scale = ROPE_INIT_FUNCTIONS["llama3"](AutoConfig.from_pretrained(model_dirs["llama"]), "cpu")
    assert scale == 1.0
    assert torch.equal(inv_frequencies(cfg.rope, cfg.head_dim), want.float())


def test_legacy_rope_scaling_linear_equals_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    raw = dict(LLAMA_CONFIG, rope_theta=10000.0, rope_scaling={"type": "linear", "factor": 4.0})
    cfg = ModelConfig.from_dict(raw)
    assert (cfg.rope.rope_type, cfg.rope.factor, cfg.rope.theta) == ("linear", 4.0, 10000.0)
    hf = LlamaConfig(**{k: v for k, v in raw.items() if k != "architectures"})
    want, _ = ROPE_INIT_FUNCTIONS["linear"](hf, "cpu")
    assert torch.allclose(inv_frequencies(cfg.rope, cfg.head_dim), want.float(), rtol=1e-6, atol=0)
