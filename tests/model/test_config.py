"""A model directory's config.json: the family features read from it, and the load-time refusals
of configs pyserve cannot serve exactly (architecture, activation, RoPE type, head counts,
sliding windows shorter than the context)."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest

from pyserve import LLM, SamplingParams
from pyserve.model.config import ModelConfig, UnsupportedModelError
from pyserve.testing import LLAMA_CONFIG, copy_model, edit_config

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 17, 42, 99, 3, 250, 8], [7, 8, 9]]
POOL = dict(block_size=4, num_kv_blocks=64)


def greedy_tokens(model_dir: Path, **kwargs) -> list[list[int]]:
    with LLM(str(model_dir), **POOL, **kwargs) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("arch, qkv_bias, qk_norm, head_dim", [
    ("llama", False, False, 16), ("mistral", False, False, 16), ("qwen2", True, False, 16), ("qwen3", False, True, 32),
])
def test_family_features_are_read_from_config(model_dirs, arch, qkv_bias, qk_norm, head_dim):
    cfg = ModelConfig.from_dir(model_dirs[arch])
    assert cfg.family == arch
    assert (cfg.qkv_bias, cfg.qk_norm, cfg.head_dim) == (qkv_bias, qk_norm, head_dim)
    assert (cfg.num_heads, cfg.num_kv_heads) == (4, 2)  # grouped-query attention
    assert cfg.eos_token_ids == (1,)


@pytest.mark.parametrize("changes, message", [
    (dict(architectures=["GPT2LMHeadModel"], model_type="gpt2"),
     r"architecture \['GPT2LMHeadModel'\] is not supported; supported: LlamaForCausalLM, "),
    (dict(architectures=[], model_type="falcon"), "architecture 'falcon' is not supported"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_type 'yarn' is not supported"),
    (dict(rope_scaling={"type": "dynamic", "factor": 2.0}), "rope_type 'dynamic' is not supported"),
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}), "rope_type 'longrope' is not supported"),
    (dict(num_key_value_heads=3), "not a multiple of num_key_value_heads 3"),
])
def test_unsupported_config_is_refused_with_a_clear_message(changes, message):
    with pytest.raises(UnsupportedModelError, match=message):
        ModelConfig.from_dict({**LLAMA_CONFIG, **changes})


@pytest.mark.parametrize("changes, message", [
    (dict(architectures=["GPT2LMHeadModel"], model_type="gpt2"), "GPT2LMHeadModel"),
    (dict(hidden_act="gelu_pytorch_tanh"), "hidden_act"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}), "yarn"),
])
def test_llm_refuses_unsupported_model_at_construction(model_dirs, tmp_path, monkeypatch, changes, message):
    dst = copy_model(model_dirs["llama"], tmp_path / "m")
    edit_config(dst, **changes)
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    with pytest.raises(UnsupportedModelError, match=message):
        LLM(str(dst), **POOL)
    gc.collect()
    assert unraisable == []  # the half-built LLM is collected without errors


def test_mistral_sliding_window_shorter_than_context_is_refused(model_dirs, tmp_path):
    dst = copy_model(model_dirs["mistral"], tmp_path / "m")
    edit_config(dst, sliding_window=64)  # max_position_embeddings is 512
    with pytest.raises(UnsupportedModelError, match="sliding_window 64 is shorter than max_model_len 512"):
        LLM(str(dst), **POOL)
    with pytest.raises(UnsupportedModelError, match="sliding_window"):
        LLM(str(dst), **POOL, max_model_len=65)


def test_a_context_longer_than_the_models_is_refused_naming_both(model_dirs, tmp_path):
    with pytest.raises(UnsupportedModelError, match="max_model_len 513 is longer than the model's context of 512"):
        LLM(str(model_dirs["llama"]), **POOL, max_model_len=513)
    dst = copy_model(model_dirs["llama"], tmp_path / "m")
    edit_config(dst, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    with LLM(str(dst), **POOL, max_model_len=1024) as llm:  # linear scaling stretches the positions
        assert llm.engine.max_model_len == 1024


def test_mistral_sliding_window_covering_the_context_loads(model_dirs, tmp_path):
    dst = copy_model(model_dirs["mistral"], tmp_path / "m")
    edit_config(dst, sliding_window=512)
    want = greedy_tokens(model_dirs["mistral"])
    assert greedy_tokens(dst) == want  # the window covers every position: full attention
    edit_config(dst, sliding_window=64)
    with LLM(str(dst), **POOL, max_model_len=64) as llm:
        assert llm.engine.max_model_len == 64
        out = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == want


def test_qwen2_sliding_window_disabled_by_use_sliding_window_false_loads(model_dirs, tmp_path):
    dst = copy_model(model_dirs["qwen2"], tmp_path / "m")
    edit_config(dst, sliding_window=64, use_sliding_window=False)
    assert ModelConfig.from_dir(dst).sliding_window is None
    assert greedy_tokens(dst) == greedy_tokens(model_dirs["qwen2"])
    edit_config(dst, use_sliding_window=True)
    with pytest.raises(UnsupportedModelError, match="sliding_window 64"):
        LLM(str(dst), **POOL)
