"""Loading a model directory: safetensors (one file or sharded with an index), strict matching of
tensors to the architecture, tied embeddings, RoPE scaling, and the load-time refusals of
checkpoints pyserve cannot serve exactly."""

from __future__ import annotations

import gc
import json
import os
import pickle
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pyserve import LLM, SamplingParams
from pyserve.model.config import ModelConfig, UnsupportedModelError
from pyserve.model.loader import WeightsError, load_model, weight_files
from pyserve.model.rope import inv_frequencies

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 17, 42, 99, 3, 250, 8], [7, 8, 9]]
POOL = dict(block_size=4, num_kv_blocks=64)

_LLAMA_RAW = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=300, hidden_size=64,
    intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=512,
)


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(model_dir: Path, **changes) -> None:
    path = model_dir / "config.json"
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw))


def load(model_dir: Path):
    cfg = ModelConfig.from_dir(model_dir)
    return load_model(model_dir, cfg, torch.float32, torch.device("cpu"), max_positions=64)


def greedy_tokens(model_dir: Path, **kwargs) -> list[list[int]]:
    with LLM(str(model_dir), **POOL, **kwargs) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def llama_tokens(model_dirs) -> list[list[int]]:
    return greedy_tokens(model_dirs["llama"])


# --- safetensors files ---------------------------------------------------------------------------


def test_sharded_checkpoint_with_index_generates_like_single_file(model_dirs, tmp_path, llama_tokens):
    src = model_dirs["llama"]
    dst = copy_model(src, tmp_path / "sharded")
    tensors = load_file(dst / "model.safetensors")
    (dst / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, shard_names in shards.items():
        save_file({n: tensors[n].contiguous() for n in shard_names}, dst / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard_names, shard))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    assert [p.name for p in weight_files(dst)] == sorted(shards)
    sharded, single = load(dst).state_dict(), load(src).state_dict()
    assert sharded.keys() == single.keys()
    assert all(torch.equal(sharded[k], single[k]) for k in single)
    assert greedy_tokens(dst) == llama_tokens


def test_index_naming_a_missing_shard_is_refused(model_dirs, tmp_path):
    dst = copy_model(model_dirs["llama"], tmp_path / "m")
    (dst / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(WeightsError, match="model-00002-of-00002.safetensors"):
        weight_files(dst)


class _RunsCodeWhenUnpickled:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)


def test_pickled_weights_are_refused_without_unpickling(model_dirs, tmp_path):
    dst = copy_model(model_dirs["llama"], tmp_path / "pickled")
    (dst / "model.safetensors").unlink()
    marker = tmp_path / "unpickled"
    (dst / "pytorch_model.bin").write_bytes(pickle.dumps(_RunsCodeWhenUnpickled(marker)))
    with pytest.raises(WeightsError, match="safetensors") as err:
        LLM(str(dst), **POOL)
    assert "pytorch_model.bin" in str(err.value)
    assert not marker.exists()


def test_directory_without_weights_is_refused(model_dirs, tmp_path):
    dst = copy_model(model_dirs["llama"], tmp_path / "empty")
    (dst / "model.safetensors").unlink()
    with pytest.raises(WeightsError, match=r"no \*\.safetensors"):
        weight_files(dst)


def _edit_weights(model_dir: Path, edit) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


@pytest.mark.parametrize("case, edit, message", [
    ("missing", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),
     "missing tensors: model.layers.1.mlp.up_proj.weight"),
    ("unexpected", lambda t: t.update({"model.layers.0.self_attn.extra.weight": torch.zeros(2)}),
     "does not use: model.layers.0.self_attn.extra.weight"),
    ("wrong shape", lambda t: t.update({"model.norm.weight": torch.ones(65)}),
     r"model.norm.weight has shape \(65,\), the config implies \(64,\)"),
])
def test_checkpoint_not_matching_the_architecture_is_refused_naming_the_tensor(
    model_dirs, tmp_path, case, edit, message
):
    dst = copy_model(model_dirs["llama"], tmp_path / "m")
    _edit_weights(dst, edit)
    with pytest.raises(WeightsError, match=message):
        load(dst)


def test_cached_rotary_inv_freq_buffer_in_checkpoint_is_ignored(model_dirs, tmp_path):
    dst = copy_model(model_dirs["llama"], tmp_path / "m")
    _edit_weights(dst, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))
    load(dst)


# --- tied embeddings -----------------------------------------------------------------------------


def test_tied_embeddings_share_storage_with_the_input_embedding(model_dirs):
    path = model_dirs["qwen2"]
    assert "lm_head.weight" not in load_file(path / "model.safetensors")
    model = load(path)
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    want = load_file(path / "model.safetensors")["model.embed_tokens.weight"]
    assert torch.equal(model.lm_head.weight, want)


def test_untied_embeddings_load_their_own_lm_head(model_dirs):
    path = model_dirs["llama"]
    model = load(path)
    assert not model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert torch.equal(model.lm_head.weight, load_file(path / "model.safetensors")["lm_head.weight"])


# --- the model family ----------------------------------------------------------------------------


@pytest.mark.parametrize("arch, qkv_bias, qk_norm, head_dim", [
    ("llama", False, False, 16), ("mistral", False, False, 16), ("qwen2", True, False, 16), ("qwen3", False, True, 32),
])
def test_family_features_are_read_from_config(model_dirs, arch, qkv_bias, qk_norm, head_dim):
    cfg = ModelConfig.from_dir(model_dirs[arch])
    assert cfg.family == arch
    assert (cfg.qkv_bias, cfg.qk_norm, cfg.head_dim) == (qkv_bias, qk_norm, head_dim)
    assert (cfg.num_heads, cfg.num_kv_heads) == (4, 2)  # grouped-query attention
    assert cfg.eos_token_ids == (1,)


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

    raw = dict(_LLAMA_RAW, rope_theta=10000.0, rope_scaling={"type": "linear", "factor": 4.0})
    cfg = ModelConfig.from_dict(raw)
    assert (cfg.rope.rope_type, cfg.rope.factor, cfg.rope.theta) == ("linear", 4.0, 10000.0)
    hf = LlamaConfig(**{k: v for k, v in raw.items() if k != "architectures"})
    want, _ = ROPE_INIT_FUNCTIONS["linear"](hf, "cpu")
    assert torch.allclose(inv_frequencies(cfg.rope, cfg.head_dim), want.float(), rtol=1e-6, atol=0)


# --- load-time refusals --------------------------------------------------------------------------

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
        ModelConfig.from_dict({**_LLAMA_RAW, **changes})


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
