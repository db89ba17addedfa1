"""Loading a model directory's weights: safetensors (one file or sharded with an index), strict
matching of tensors to the architecture, tied embeddings, pickled weights refused unread, and the
tensors used in place from the mapped file (converted once when the dtype differs)."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import structlog
import torch
from safetensors.torch import load_file, save_file

from pyserve import LLM, SamplingParams
from pyserve.model.config import ModelConfig
from pyserve.model.loader import WeightsError, load_model, weight_files
from pyserve.testing import copy_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 17, 42, 99, 3, 250, 8], [7, 8, 9]]
POOL = dict(block_size=4, num_kv_blocks=64)


def load(model_dir: Path):
    cfg = ModelConfig.from_dir(model_dir)
    return load_model(model_dir, cfg, torch.float32, torch.device("cpu"), max_positions=64, gguf_dequantize=False)


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


# --- in place, converted, and built without compiler imports ------------------------------------


def test_parameters_are_the_checkpoint_tensors_used_in_place(model_dirs):
    path = model_dirs["llama"]
    want = load_file(path / "model.safetensors")
    with structlog.testing.capture_logs() as logs:
        model = load(path)
    got = model.state_dict()
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) and got[k].dtype == torch.float32 for k in want)
    event = next(e for e in logs if e["event"] == "weights_loaded")
    nbytes = sum(t.nbytes for t in want.values())
    assert (event["tensors"], event["in_place"], event["bytes"]) == (len(want), len(want), nbytes)
    assert event["gb_per_s"] == round(nbytes / event["seconds"] / 1e9, 2)


def test_a_checkpoint_in_another_dtype_is_converted_once(model_dirs, tmp_path):
    dst = copy_model(model_dirs["llama"], tmp_path / "half")
    _edit_weights(dst, lambda t: t.update({k: v.half() for k, v in t.items()}))
    want = load_file(dst / "model.safetensors")
    with structlog.testing.capture_logs() as logs:
        got = load(dst).state_dict()
    assert all(got[k].dtype == torch.float32 and torch.equal(got[k], want[k].float()) for k in want)
    assert next(e for e in logs if e["event"] == "weights_loaded")["in_place"] == 0


def test_tied_embeddings_stay_tied_when_the_checkpoint_also_holds_the_head(model_dirs, tmp_path):
    dst = copy_model(model_dirs["qwen2"], tmp_path / "m")
    _edit_weights(dst, lambda t: t.update({"lm_head.weight": torch.randn_like(t["model.embed_tokens.weight"])}))
    model = load(dst)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, load_file(dst / "model.safetensors")["model.embed_tokens.weight"])


def test_loading_imports_neither_dynamo_nor_sympy(model_dirs, tmp_path):
    """Building the model on `meta` ran torch's Python decompositions, which import torch._dynamo
    and sympy: ~2 s of every start."""
    code = ("import sys, torch\nfrom pyserve.model.config import ModelConfig\n"
            "from pyserve.model.loader import load_model\n"
            f"path = {str(model_dirs['llama'])!r}\n"
            "load_model(path, ModelConfig.from_dir(path), torch.float32, torch.device('cpu'), 64, False)\n"
            "print(sorted(m for m in ('torch._dynamo', 'sympy') if m in sys.modules))")
    # from outside the repository: the installed package, with its native module
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert (run.returncode, run.stdout.strip()) == (0, "[]"), run.stderr  # nor a log line: structlog unconfigured
