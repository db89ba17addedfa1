"""Pre-quantized checkpoints (compressed-tensors, GPTQ, AWQ): the loader decodes each format to
exactly the weights its reference library packed, serves them with pyserve's quantized layers,
matches transformers greedy on those weights, and refuses what it does not support, naming the
key or the tensor."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from pyserve import LLM, LoRARequest, SamplingParams
from pyserve.model.config import UnsupportedModelError
from pyserve.model.errors import WeightsError
from pyserve.model import quantized_linear
from pyserve.model.quantized_linear import Int4Linear, Int8Linear, W8A8Linear, fast_int8_matmul
from pyserve.testing import MAX_TOKENS, assert_parity, hf_greedy, prompts
from pyserve.testing.quantized_checkpoints import AWQ_ORDER, awq_packing_utils, write_quantized
from pyserve.testing.quantized_reference import W8A8Reference
from pyserve.testing.tiny_models import make_adapter

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

CASES = {  # id: (method, bits, group, symmetric, act_order, the layer pyserve serves it with)
    "ct-w4a16-sym": ("compressed-tensors", 4, 32, True, False, Int4Linear),
    "ct-w4a16-asym": ("compressed-tensors", 4, 64, False, False, Int4Linear),
    "ct-w8a16-channel": ("compressed-tensors", 8, -1, True, False, Int8Linear),
    "ct-int-w8a16": ("compressed-tensors-int", 8, -1, True, False, Int8Linear),
    "ct-int-w8a8": ("compressed-tensors-w8a8", 8, -1, True, False, W8A8Linear),
    "gptq-4bit-sym": ("gptq", 4, 32, True, False, Int4Linear),
    "gptq-4bit-asym-act-order": ("gptq", 4, 32, False, True, Int4Linear),
    "gptq-4bit-per-row": ("gptq", 4, -1, True, False, Int4Linear),
    "gptq-8bit-per-row": ("gptq", 8, -1, True, False, Int8Linear),
    "gptq-8bit-groups": ("gptq", 8, 32, True, True, torch.nn.Linear),
    "awq-gemm": ("awq", 4, 32, False, False, Int4Linear),
}


def _served_layers(llm: LLM) -> dict[str, torch.nn.Module]:
    model = llm.engine.worker.model
    return {name: m for name, m in model.named_modules()
            if isinstance(m, (Int4Linear, Int8Linear, torch.nn.Linear)) and ".layers." in name}


def _w8a8_reference(layers):
    """A transformers model's decoder linears replaced by W8A8Reference of the checkpoint's own
    integers (the head stays full precision, as the checkpoint leaves it)."""
    def prepare(model):
        for name, qz in layers.items():
            parent, _, child = name.rpartition(".")
            linear = model.get_submodule(name)
            layer = W8A8Linear((qz.q - 128).to(torch.int8), qz.scales.float()[:, 0], linear.bias)
            setattr(model.get_submodule(parent), child, W8A8Reference(layer))
    return prepare


@pytest.mark.parametrize("case", [c if c != "ct-int-w8a8" else pytest.param(c, marks=pytest.mark.skipif(
    not fast_int8_matmul(), reason="int8 activations are served only where oneDNN multiplies int8 (VNNI)"))
    for c in CASES])
def test_each_format_decodes_to_the_packed_weights_and_matches_transformers_greedy(case, model_dirs, tmp_path):
    method, bits, group, symmetric, act_order, served_as = CASES[case]
    src = model_dirs["qwen2" if case.startswith("awq") else "llama"]
    layers = write_quantized(src, tmp_path / "q", tmp_path / "ref", method, bits, group, symmetric, act_order)
    prepare = _w8a8_reference(layers) if served_as is W8A8Linear else None
    reference = hf_greedy(tmp_path / "ref", prompts(300), prepare=prepare)
    with LLM(str(tmp_path / "q"), block_size=4, num_kv_blocks=256) as llm:
        outs = llm.generate(prompts(300), GREEDY, use_tqdm=False)
        stats = llm.stats()
        served = _served_layers(llm)
    assert_parity([o.outputs[0].token_ids for o in outs], reference)
    expected_method = {"compressed-tensors": f"compressed-tensors-int{bits}", "compressed-tensors-int":
                       f"compressed-tensors-int{bits}"}.get(method, f"{method}-int{bits}")
    assert stats["quantization"] == (method if served_as is W8A8Linear else expected_method)
    # q/k/v and gate/up are fused where their layouts allow (act-order: the same input order)
    fused = {name: m for name, m in served.items() if name.endswith(("qkv_proj", "gate_up_proj"))}
    assert all(isinstance(m, served_as) or type(m).__name__ == "CpuLinear" for m in served.values())
    if served_as is not torch.nn.Linear:
        assert all(type(m) is served_as for m in served.values())
        down = served["model.layers.1.mlp.down_proj"]
        assert torch.equal(down.dequantized(), layers["model.layers.1.mlp.down_proj"].served())
    if not act_order:
        assert len(fused) == 4


def test_act_order_layers_gather_their_inputs_and_keep_the_column_order(model_dirs, tmp_path):
    layers = write_quantized(model_dirs["llama"], tmp_path / "q", tmp_path / "ref", "gptq", 4, 32, False, True)
    with LLM(str(tmp_path / "q"), block_size=4, num_kv_blocks=64) as llm:
        served = _served_layers(llm)
    o_proj = served["model.layers.0.self_attn.o_proj"]
    assert o_proj.input_order is not None and o_proj.kernel_weights() is None
    assert torch.equal(o_proj.dequantized(), layers["model.layers.0.self_attn.o_proj"].served())
    x = torch.randn(3, o_proj.in_features)
    want = torch.nn.functional.linear(x, o_proj.dequantized())
    assert torch.allclose(o_proj(x), want, atol=1e-3)  # within the int16 activations' steps


def test_the_awq_unpacking_is_autoawqs(model_dirs, tmp_path):
    layers = write_quantized(model_dirs["qwen2"], tmp_path / "q", tmp_path / "ref", "awq", 4, 32, False)
    tensors = load_file(str(tmp_path / "q" / "model.safetensors"))
    awq = awq_packing_utils()
    assert list(awq.AWQ_ORDER) == list(AWQ_ORDER)
    name = "model.layers.0.mlp.gate_proj"
    q, z = awq.unpack_awq(tensors[f"{name}.qweight"], tensors[f"{name}.qzeros"], 4)
    q, z = awq.reverse_awq_order(q, z, 4)
    assert torch.equal(q.int() & 0xF, layers[name].q.T.int()) and torch.equal(z.int() & 0xF, layers[name].zeros.T)
    with LLM(str(tmp_path / "q"), block_size=4, num_kv_blocks=64, enable_lora=True) as llm:  # unfused
        gate = _served_layers(llm)[name + ".base"]  # inside its LoraLinear
    assert torch.equal(gate.dequantized(), layers[name].served())


def test_compressed_tensors_decompression_agrees(model_dirs, tmp_path):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    write_quantized(model_dirs["llama"], tmp_path / "q", tmp_path / "ref", "compressed-tensors", 4, 64, False)
    tensors = load_file(str(tmp_path / "q" / "model.safetensors"))
    config = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    scheme = QuantizationScheme.model_validate(config["config_groups"]["group_0"])
    name = "model.layers.1.self_attn.o_proj"
    state = {k.rpartition(".")[2]: v for k, v in tensors.items() if k.startswith(name + ".")}
    state["weight_scale"] = state["weight_scale"].float()  # dequantized in float32, as pyserve does
    want = PackedQuantizationCompressor.decompress(state, scheme)["weight"]
    with LLM(str(tmp_path / "q"), block_size=4, num_kv_blocks=64) as llm:
        layer = _served_layers(llm)[name]
        got = layer.dequantized()
    # the same weights but for each group's offset -zero * scale, which a 4-bit layer holds in f16
    offsets = layer.offsets.float().repeat_interleave(layer.group_size, 1).abs()
    assert ((got - want).abs() <= offsets * 2**-11).all() and (got - want).abs().max() > 0


def test_a_quantized_base_with_lora_and_a_quantized_draft(model_dirs, tmp_path):
    src = model_dirs["llama"]
    write_quantized(src, tmp_path / "q", tmp_path / "ref", "gptq", 4, 32, True)
    adapter = make_adapter(src, tmp_path / "adapter", 8, ["q_proj", "v_proj", "down_proj"], seed=3)
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with LLM(str(tmp_path / "q"), block_size=4, num_kv_blocks=256) as plain_llm:
        plain = [o.outputs[0].token_ids for o in plain_llm.generate(prompts(300)[:3], sp, use_tqdm=False)]
    with LLM(str(tmp_path / "q"), block_size=4, num_kv_blocks=256, enable_lora=True, max_lora_rank=8) as llm:
        lora = LoRARequest("a", 1, str(adapter))
        outs = llm.generate(prompts(300)[:3] * 2, sp, lora_request=[None] * 3 + [lora] * 3, use_tqdm=False)
    base, tuned = [o.outputs[0].token_ids for o in outs[:3]], [o.outputs[0].token_ids for o in outs[3:]]
    assert base == plain and tuned != base
    spec = {"method": "draft_model", "model": str(tmp_path / "q"), "num_speculative_tokens": 3, "adaptive": False}
    with LLM(str(tmp_path / "q"), block_size=4, num_kv_blocks=256, speculative_config=spec) as llm:
        fast = [o.outputs[0].token_ids for o in llm.generate(prompts(300)[:3], sp, use_tqdm=False)]
        assert llm.stats()["spec_decode_num_accepted_tokens"] > 0
    assert fast == plain


def _edit(model_dir, config=None, tensors=None):
    if config is not None:
        path = model_dir / "config.json"
        raw = json.loads(path.read_text())
        config(raw["quantization_config"])
        path.write_text(json.dumps(raw))
    if tensors is not None:
        path = model_dir / "model.safetensors"
        t = load_file(str(path))
        tensors(t)
        save_file(t, str(path), metadata={"format": "pt"})


BAD_CONFIGS = [
    ("gptq", lambda c: c.update(quant_method="bitsandbytes"), "quantization_config.quant_method"),
    ("gptq", lambda c: c.update(bits=3), "quantization_config.bits"),
    ("gptq", lambda c: c.update(checkpoint_format="marlin"), "quantization_config.checkpoint_format"),
    ("gptq", lambda c: c.update(dynamic={"-:.*down": {}}), "quantization_config.dynamic"),
    ("awq", lambda c: c.update(version="gemv"), "quantization_config.version"),
    ("compressed-tensors", lambda c: c.update(format="float-quantized"), "quantization_config.format"),
    ("compressed-tensors", lambda c: c["config_groups"]["group_0"].update(input_activations={"num_bits": 8}),
     "quantization_config.config_groups.group_0.input_activations.type"),
    ("compressed-tensors", lambda c: c["config_groups"]["group_0"]["weights"].update(num_bits=2),
     "quantization_config.config_groups.group_0.weights.num_bits"),
]


@pytest.mark.parametrize("method, edit, key", BAD_CONFIGS, ids=[b[2].rpartition(".")[2] + "-" + b[0]
                                                                for b in BAD_CONFIGS])
def test_an_unsupported_quantization_config_is_refused_naming_the_key(method, edit, key, model_dirs, tmp_path):
    write_quantized(model_dirs["llama"], tmp_path / "q", tmp_path / "ref", method, 4, 32, method != "awq")
    _edit(tmp_path / "q", config=edit)
    with pytest.raises(UnsupportedModelError, match=key.replace(".", r"\.") + ":"):
        LLM(str(tmp_path / "q"), block_size=4, num_kv_blocks=64)


W8A8_BAD_CONFIGS = [
    (lambda c: c["config_groups"]["group_0"]["input_activations"].update(dynamic=False),
     "quantization_config.config_groups.group_0.input_activations.dynamic"),
    (lambda c: c["config_groups"]["group_0"]["input_activations"].update(strategy="tensor"),
     "quantization_config.config_groups.group_0.input_activations.strategy"),
    (lambda c: c["config_groups"]["group_0"]["weights"].update(symmetric=False),
     "quantization_config.config_groups.group_0.weights"),
    (lambda c: c.update(format="pack-quantized"), "quantization_config.format"),
]


@pytest.mark.parametrize("edit, key", W8A8_BAD_CONFIGS, ids=["static", "per-tensor", "asymmetric", "packed"])
def test_int8_activations_other_than_dynamic_per_token_are_refused_naming_the_key(edit, key, model_dirs, tmp_path):
    write_quantized(model_dirs["llama"], tmp_path / "q", tmp_path / "ref", "compressed-tensors-w8a8", 8, -1, True)
    _edit(tmp_path / "q", config=edit)
    with pytest.raises(UnsupportedModelError, match=key.replace(".", r"\.") + ":"):
        LLM(str(tmp_path / "q"), block_size=4, num_kv_blocks=64)


def test_a_w8a8_checkpoint_is_refused_where_int8_matmuls_are_not_fast(model_dirs, tmp_path, monkeypatch):
    write_quantized(model_dirs["llama"], tmp_path / "q", tmp_path / "ref", "compressed-tensors-w8a8", 8, -1, True)
    monkeypatch.setattr(quantized_linear, "fast_int8_matmul", lambda: False)
    with pytest.raises(UnsupportedModelError, match=r"quantization_config: model\.layers\.0\.\w+\.\w+ has int8 "
                                                    r"activations \(W8A8\): quantization: w8a8"):
        LLM(str(tmp_path / "q"), block_size=4, num_kv_blocks=64)


BAD_TENSORS = [
    (lambda t: t.update({"model.layers.0.mlp.up_proj.qweight": t["model.layers.0.mlp.up_proj.qweight"][:-1]}),
     r"model\.layers\.0\.mlp\.up_proj\.qweight has shape"),
    (lambda t: t.update({"model.layers.0.mlp.up_proj.qweight": t["model.layers.0.mlp.up_proj.qweight"].float()}),
     "packed weights must be int32"),
    (lambda t: t.pop("model.layers.1.self_attn.k_proj.qzeros"), r"missing tensors: model\.layers\.1\.self_attn\.k_proj"
                                                                 r"\.qzeros"),
    (lambda t: t.update({"model.layers.0.self_attn.o_proj.g_idx": torch.zeros(64, dtype=torch.int32)}),
     r"model\.layers\.0\.self_attn\.o_proj\.g_idx does not give"),
    (lambda t: t.update({"model.layers.0.self_attn.extra.qweight": torch.zeros(2, 2, dtype=torch.int32)}),
     r"does not use: model\.layers\.0\.self_attn\.extra\.qweight"),
]


@pytest.mark.parametrize("edit, message", BAD_TENSORS, ids=["shape", "dtype", "missing", "g_idx", "unexpected"])
def test_packed_tensors_of_the_wrong_shape_or_dtype_are_refused_naming_the_tensor(edit, message, model_dirs,
                                                                                  tmp_path):
    write_quantized(model_dirs["llama"], tmp_path / "q", tmp_path / "ref", "gptq", 4, 32, True)
    _edit(tmp_path / "q", tensors=edit)
    with pytest.raises(WeightsError, match=message):
        LLM(str(tmp_path / "q"), block_size=4, num_kv_blocks=64)


def test_quantizing_a_quantized_checkpoint_again_is_refused(model_dirs, tmp_path):
    write_quantized(model_dirs["llama"], tmp_path / "q", tmp_path / "ref", "awq", 4, 32, False)
    with pytest.raises(ValueError, match=r"quantization: the checkpoint is already quantized \(awq-int4\)"):
        LLM(str(tmp_path / "q"), quantization="int8", block_size=4, num_kv_blocks=64)
