"""int8 weight-only quantization: the quantizer, the CPU kernel against the dequantized
reference, greedy parity with transformers running the dequantized weights, and the engine
with a quantized model (bytes, LoRA, speculation, refused methods)."""

from __future__ import annotations

import shutil

import pytest
import torch
from torch import nn

from pyserve import LLM, LoRARequest, SamplingParams
from pyserve.default_model import ADAPTER_DIRS
from pyserve.model.quantized_linear import Int8Linear, quantize_int8
from pyserve.testing import MAX_TOKENS, assert_parity, hf_greedy, prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def test_quantize_int8_is_symmetric_per_output_channel():
    torch.manual_seed(0)
    w = torch.randn(33, 70) * torch.linspace(0.01, 3.0, 33)[:, None]
    q, scales = quantize_int8(w)
    assert q.dtype == torch.int8 and scales.shape == (33,)
    assert torch.allclose(scales, w.abs().amax(dim=1) / 127)
    assert q.abs().max() == 127 and (q.abs() == 127).any(dim=1).all()  # every row reaches its scale
    assert ((q.float() * scales[:, None] - w).abs() <= scales[:, None] / 2 + 1e-7).all()


@pytest.mark.parametrize("rows", [1, 2, 7, 16, 17, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_the_cpu_kernel_computes_with_the_dequantized_weight(rows, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(72, 37, bias=bias)
    layer = Int8Linear(linear)
    x = torch.randn(rows, 72)
    reference = nn.functional.linear(x, layer.dequantized(), layer.bias)
    assert torch.allclose(layer(x), reference, rtol=1e-5, atol=1e-5)
    # a row's result does not depend on the rows beside it
    assert torch.equal(layer(x[3 % rows :][:1]), layer(x)[3 % rows][None])


def test_unknown_methods_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="quantization must be one of int8"):
        LLM(quantization="int3")


def _dequantized_checkpoint(src, dst):
    """`src` with every linear weight of the decoder and the head replaced by its int8
    dequantization, an untied head (pyserve quantizes the head, not the embedding)."""
    from transformers import AutoModelForCausalLM

    shutil.copytree(src, dst)
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    head = hf.lm_head.weight.detach().clone()
    hf.config.tie_word_embeddings = False
    hf.lm_head.weight = nn.Parameter(head)
    with torch.no_grad():
        for m in hf.modules():
            if isinstance(m, nn.Linear):
                q, s = quantize_int8(m.weight)
                m.weight.copy_(q.float() * s[:, None])
    hf.save_pretrained(dst, safe_serialization=True)
    return dst


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_parity_with_transformers_on_the_dequantized_weights(arch, model_dirs, tmp_path):
    reference = hf_greedy(_dequantized_checkpoint(model_dirs[arch], tmp_path / arch), prompts(300))
    with LLM(str(model_dirs[arch]), quantization="int8", block_size=4, num_kv_blocks=512) as llm:
        outs = llm.generate(prompts(300), GREEDY, use_tqdm=False)
        stats = llm.stats()
    assert_parity([o.outputs[0].token_ids for o in outs], reference)
    with LLM(str(model_dirs[arch]), block_size=4, num_kv_blocks=512) as full:
        assert stats["weight_bytes"] < 0.6 * full.stats()["weight_bytes"]
    assert stats["quantization"] == "int8"


def test_embedded_model_int8_with_lora_and_speculation():
    prompt = ["def read_config(path):\n"]
    with LLM(quantization="int8") as q8:
        plain = q8.generate(prompt, SamplingParams(temperature=0.0, max_tokens=48), use_tqdm=False)[0]
        assert q8.stats()["weight_bytes"] < 0.55 * 16_786_432  # the embedding (4 MB) stays f32
    with LLM(quantization="int8", speculative_config={"method": "draft_model", "num_speculative_tokens": 4,
                                                      "adaptive": False}) as spec:
        fast = spec.generate(prompt, SamplingParams(temperature=0.0, max_tokens=48), use_tqdm=False)[0]
        assert spec.stats()["spec_decode_num_accepted_tokens"] > 0
    assert fast.outputs[0].token_ids == plain.outputs[0].token_ids
    with LLM(quantization="int8", enable_lora=True, max_lora_rank=16) as lora:
        adapter = LoRARequest("docstrings", 1, str(ADAPTER_DIRS["docstrings"]))
        base, tuned = lora.generate(prompt * 2, SamplingParams(temperature=0.0, max_tokens=48),
                                    lora_request=[None, adapter], use_tqdm=False)
    assert base.outputs[0].token_ids == plain.outputs[0].token_ids  # unfused projections: same bits per row
    assert tuned.outputs[0].token_ids != base.outputs[0].token_ids
