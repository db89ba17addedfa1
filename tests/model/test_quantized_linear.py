"""Quantization at load (int8, int4 in groups; w8a8): the quantizers, the CPU kernels against the
dequantized reference (w8a8: against exact integer sums), greedy parity with transformers running
the same arithmetic, and the engine with a quantized model (bytes, LoRA, speculation, refused
methods)."""

from __future__ import annotations

import shutil

import pytest
import torch
from torch import nn

from pyserve import LLM, LoRARequest, SamplingParams
from pyserve.default_model import ADAPTER_DIRS
from pyserve.model import quantized_linear
from pyserve.model.quantized_linear import (Fp8Linear, Int4Linear, Int8Linear, W8A8Linear, fast_int8_matmul,
                                            quantize_fp8, quantize_int4, quantize_int8, unpack_int4)
from pyserve.testing import MAX_TOKENS, assert_parity, hf_greedy, prompts
from pyserve.testing.quantized_reference import Int4Reference, W8A8Reference, use_int4_reference, use_w8a8_reference

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def test_quantize_int8_is_symmetric_per_output_channel():
    torch.manual_seed(0)
    w = torch.randn(33, 70) * torch.linspace(0.01, 3.0, 33)[:, None]
    q, scales = quantize_int8(w)
    assert q.dtype == torch.int8 and scales.shape == (33,)
    assert torch.allclose(scales, w.abs().amax(dim=1) / 127)
    assert q.abs().max() == 127 and (q.abs() == 127).any(dim=1).all()  # every row reaches its scale
    assert ((q.float() * scales[:, None] - w).abs() <= scales[:, None] / 2 + 1e-7).all()


def test_quantize_int4_fits_each_group_no_worse_than_min_max_and_packs_two_a_byte():
    torch.manual_seed(1)
    w = torch.randn(5, 128) + torch.linspace(-2, 2, 128)
    w[1, 32:64] = 0.25  # a constant group
    packed, scales, offsets = quantize_int4(w, 32)
    assert packed.shape == (5, 64) and scales.shape == offsets.shape == (5, 4)
    assert scales.dtype == offsets.dtype == torch.float16
    q = unpack_int4(packed).reshape(5, 4, 32)
    dq = (q.float() * scales.float()[..., None] + offsets.float()[..., None]).reshape(5, 128)
    error = (dq - w).square().reshape(5, 4, 32).sum(dim=2)
    # min-max's pair (offset the smallest weight, 15 steps over the range) rounded to f16 alike
    groups = w.reshape(5, 4, 32)
    lo = groups.amin(dim=2).half().float()
    step = ((groups.amax(dim=2) - lo) / 15).clamp_min(torch.finfo(torch.float16).tiny).half().float()
    mq = torch.round((groups - lo[..., None]) / step[..., None]).clamp(0, 15)
    min_max_error = (mq * step[..., None] + lo[..., None] - groups).square().sum(dim=2)
    assert (error <= min_max_error).all()
    assert error.sum() < 0.9 * min_max_error.sum()  # the fitted pairs gain on these weights
    assert torch.equal(dq[1, 32:64], torch.full((32,), 0.25))
    q = q.reshape(5, 128)
    assert torch.equal(packed[0, 0] & 0xF, q[0, 0].to(torch.uint8)) and torch.equal(packed[0, 0] >> 4, q[0, 1])
    with pytest.raises(ValueError, match="quantization_group_size"):
        quantize_int4(torch.randn(4, 96), 64)


@pytest.mark.parametrize("rows", [1, 2, 7, 16, 17, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_the_int8_cpu_kernel_computes_with_the_dequantized_weight(rows, bias):
    torch.manual_seed(rows)
    layer = Int8Linear.from_linear(nn.Linear(128, 37, bias=bias))
    x = torch.randn(rows, 128)
    reference = nn.functional.linear(x, layer.dequantized(), layer.bias)
    assert torch.allclose(layer(x), reference, rtol=1e-5, atol=1e-5)
    # a row's result does not depend on the rows beside it
    assert torch.equal(layer(x[3 % rows :][:1]), layer(x)[3 % rows][None])


@pytest.mark.parametrize("rows", [1, 2, 5, 7, 16, 17, 40])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("group", [32, 64])
def test_the_int4_cpu_kernel_multiplies_int16_blocks_of_x(rows, bias, group):
    torch.manual_seed(rows)
    layer = Int4Linear.from_linear(nn.Linear(128, 37, bias=bias), group)
    x = torch.randn(rows, 128) * torch.linspace(0.1, 10.0, 128)  # blocks of different scales
    got = layer(x)
    assert torch.allclose(got, Int4Reference(layer)(x), rtol=1e-5, atol=1e-4)
    # within an int16 step of each block of the dequantized weight's f32 result
    f32 = nn.functional.linear(x, layer.dequantized(), layer.bias)
    assert torch.allclose(got, f32, rtol=1e-4, atol=1e-4 * float(f32.abs().max()))
    assert torch.equal(layer(x[3 % rows :][:1]), got[3 % rows][None])  # alone or beside other rows


@pytest.mark.parametrize("rows", [1, 2, 7, 16, 17, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_w8a8_quantizes_each_row_of_x_and_sums_exactly(rows, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 37, bias=bias)
    layer = W8A8Linear.from_linear(linear)
    x = torch.randn(rows, 96) * torch.linspace(0.1, 10.0, rows)[:, None]  # rows of different scales
    got = layer(x)  # up to 16 rows on the Rust kernel, more on torch._int_mm: the same bits
    assert torch.equal(got, W8A8Reference(layer)(x))
    assert torch.equal(layer(x[3 % rows :][:1]), got[3 % rows][None])  # alone or beside other rows
    # an int8 step of each row's largest value: within a few percent of the f32 layer
    assert torch.allclose(got, linear(x), rtol=0.05, atol=0.02 * float(x.abs().max()))
    assert layer.kernel_weights()[-1] == "w8a8"  # _core.decoder_layer's form of it


def test_w8a8_is_refused_where_int8_matmuls_are_not_fast_and_over_ranks(monkeypatch):
    monkeypatch.setattr(quantized_linear, "fast_int8_matmul", lambda: True)  # as on a CPU with VNNI
    with pytest.raises(ValueError, match="quantization: w8a8 is not split over ranks"):
        LLM(quantization="w8a8", tensor_parallel_size=2)
    monkeypatch.setattr(quantized_linear, "fast_int8_matmul", lambda: False)
    with pytest.raises(ValueError, match=r"quantization: w8a8 \(int8 activations\) runs on CPUs with VNNI"):
        LLM(quantization="w8a8")


def test_quantize_fp8_scales_each_row_to_e4m3s_largest_value():
    torch.manual_seed(2)
    w = torch.randn(9, 64) * torch.linspace(0.01, 5.0, 9)[:, None]
    q, scales = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and scales.shape == (9,)
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((9,), 448.0))
    # e4m3 keeps 3 mantissa bits: each weight within half a step (1/16 relative) of its value
    assert ((q.float() * scales[:, None] - w).abs() <= w.abs() / 16 + scales[:, None] * 2**-9).all()
    layer = Fp8Linear.from_linear(nn.Linear(64, 9))
    x = torch.randn(3, 64)
    assert torch.allclose(layer(x), nn.functional.linear(x, layer.dequantized(), layer.bias), atol=1e-6)
    assert layer.weight_bytes == 9 * 64 + 4 * 9


def test_fp8_is_refused_off_a_gpu_that_computes_it():
    with pytest.raises(ValueError, match=r"quantization: fp8 weights need a CUDA GPU of compute capability 8\.9"):
        LLM(quantization="fp8", device="cpu")


def test_unknown_methods_and_group_sizes_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="quantization must be one of int8, int4"):
        LLM(quantization="int3")
    with pytest.raises(ValueError, match="quantization_group_size must be one of 32, 64, 128"):
        LLM(quantization="int4", quantization_group_size=48)


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
                m.weight.copy_(Int8Linear.from_linear(m).dequantized())
    hf.save_pretrained(dst, safe_serialization=True)
    return dst


@pytest.mark.parametrize("arch, method", [("llama", "int8"), ("qwen2", "int8"), ("llama", "int4"), ("qwen2", "int4")])
def test_greedy_parity_with_transformers_running_the_same_arithmetic(arch, method, model_dirs, tmp_path):
    """int8: transformers on the dequantized weights; int4: on Int4Linear's CPU arithmetic. There a
    sum's f32 rounding (~1e-7) may move an activation across an int16 rounding boundary, a step of
    1/65534 of its block's largest value, which these random models amplify to ~1e-3 in the
    logits: a divergence is accepted where the reference's margin is under 1e-2."""
    if method == "int8":
        reference = hf_greedy(_dequantized_checkpoint(model_dirs[arch], tmp_path / arch), prompts(300))
    else:
        reference = hf_greedy(model_dirs[arch], prompts(300), prepare=lambda m: use_int4_reference(m, 32))
    with LLM(str(model_dirs[arch]), quantization=method, quantization_group_size=32, block_size=4,
             num_kv_blocks=512) as llm:
        outs = llm.generate(prompts(300), GREEDY, use_tqdm=False)
        stats = llm.stats()
    assert_parity([o.outputs[0].token_ids for o in outs], reference, near_tie=1e-4 if method == "int8" else 1e-2)
    with LLM(str(model_dirs[arch]), block_size=4, num_kv_blocks=512) as full:
        assert stats["weight_bytes"] < (0.6 if method == "int8" else 0.45) * full.stats()["weight_bytes"]
    assert stats["quantization"] == method


def test_int4_keeps_the_lm_head_at_int8(model_dirs):
    with LLM(str(model_dirs["llama"]), quantization="int4", quantization_group_size=32, block_size=4,
             num_kv_blocks=64) as llm:
        model = llm.engine.worker.model
        kinds = {type(m) for name, m in model.named_modules() if ".layers." in name and hasattr(m, "weight_bytes")}
        assert type(model.lm_head) is Int8Linear and kinds == {Int4Linear}


@pytest.mark.skipif(not fast_int8_matmul(), reason="w8a8 is served only where oneDNN multiplies int8 (VNNI)")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_w8a8_greedy_parity_with_transformers_running_its_arithmetic(arch, model_dirs):
    reference = hf_greedy(model_dirs[arch], prompts(300), prepare=use_w8a8_reference)
    with LLM(str(model_dirs[arch]), quantization="w8a8", block_size=4, num_kv_blocks=512) as llm:
        outs = llm.generate(prompts(300), GREEDY, use_tqdm=False)
        stats = llm.stats()
    assert_parity([o.outputs[0].token_ids for o in outs], reference)
    assert stats["quantization"] == "w8a8"


@pytest.mark.parametrize("method", ["int8", pytest.param("w8a8", marks=pytest.mark.skipif(
    not fast_int8_matmul(), reason="w8a8 is served only where oneDNN multiplies int8 (VNNI)"))])
def test_embedded_model_quantized_with_lora_and_speculation(method):
    prompt = ["def read_config(path):\n"]
    with LLM(quantization=method) as q8:
        plain = q8.generate(prompt, SamplingParams(temperature=0.0, max_tokens=48), use_tqdm=False)[0]
        assert q8.stats()["weight_bytes"] < 0.55 * 16_786_432  # the embedding (4 MB) stays f32
    with LLM(quantization=method, speculative_config={"method": "draft_model", "num_speculative_tokens": 4,
                                                      "adaptive": False}) as spec:
        fast = spec.generate(prompt, SamplingParams(temperature=0.0, max_tokens=48), use_tqdm=False)[0]
        assert spec.stats()["spec_decode_num_accepted_tokens"] > 0
    assert fast.outputs[0].token_ids == plain.outputs[0].token_ids
    with LLM(quantization=method, enable_lora=True, max_lora_rank=16) as lora:
        adapter = LoRARequest("docstrings", 1, str(ADAPTER_DIRS["docstrings"]))
        base, tuned = lora.generate(prompt * 2, SamplingParams(temperature=0.0, max_tokens=48),
                                    lora_request=[None, adapter], use_tqdm=False)
    assert base.outputs[0].token_ids == plain.outputs[0].token_ids  # unfused projections: same bits per row
    assert tuned.outputs[0].token_ids != base.outputs[0].token_ids
