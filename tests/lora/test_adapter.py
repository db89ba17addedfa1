"""PEFT adapter validation before use: rank, directory, pickled weights, target modules, shapes,
a corrupt file and non-finite weights are checked, and a refused adapter leaves the engine serving."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from pyserve import LLM, LoRARequest, SamplingParams
from pyserve.lora.adapter import LoraError, load_adapter


def test_adapters_are_validated_before_use(llama_dir, adapters, tmp_path):
    shapes = {"q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32), "o_proj": (64, 64),
              "gate_proj": (64, 128), "up_proj": (64, 128), "down_proj": (128, 64)}
    load_adapter(adapters["all8"], shapes, num_layers=2, max_rank=8)
    with pytest.raises(LoraError, match="max_lora_rank"):
        load_adapter(adapters["mlp16rs"], shapes, num_layers=2, max_rank=8)
    with pytest.raises(LoraError, match="directory"):
        load_adapter(tmp_path / "missing", shapes, num_layers=2, max_rank=64)
    pickled = tmp_path / "pickled"
    shutil.copytree(adapters["attn4"], pickled)
    (pickled / "adapter_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(LoraError, match="pickled"):
        load_adapter(pickled, shapes, num_layers=2, max_rank=64)
    wrong = tmp_path / "wrong"
    shutil.copytree(adapters["attn4"], wrong)
    cfg = json.loads((wrong / "adapter_config.json").read_text())
    (wrong / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": ["q_proj", "lm_head"]}))
    with pytest.raises(LoraError, match="target_modules"):
        load_adapter(wrong, shapes, num_layers=2, max_rank=64)
    with pytest.raises(LoraError, match="do not fit"):
        load_adapter(adapters["attn4"], {**shapes, "q_proj": (64, 48)}, num_layers=2, max_rank=64)
    truncated = tmp_path / "truncated"
    shutil.copytree(adapters["attn4"], truncated)
    weights = truncated / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(LoraError, match="cannot be read"):
        load_adapter(truncated, shapes, num_layers=2, max_rank=64)
    poisoned = tmp_path / "poisoned"
    shutil.copytree(adapters["attn4"], poisoned)
    tensors = load_file(poisoned / "adapter_model.safetensors")
    key = next(iter(tensors))
    tensors[key][0, 0] = float("nan")
    save_file(tensors, poisoned / "adapter_model.safetensors")
    with pytest.raises(LoraError, match=f"{key} holds NaN"):
        load_adapter(poisoned, shapes, num_layers=2, max_rank=64)
    with LLM(str(llama_dir), block_size=4, num_kv_blocks=64, enable_lora=True, max_lora_rank=8) as llm:
        with pytest.raises(ValueError, match="max_lora_rank"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2),
                         lora_request=LoRARequest("big", 3, str(adapters["mlp16rs"])), use_tqdm=False)
        ok = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
        assert len(ok[0].outputs[0].token_ids) == 2  # the engine carries on
