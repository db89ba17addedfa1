"""The CPU kernels of the decoder's small ops against their torch references (decoder.py,
rope.py), and a whole model on the CPU kernels against the same model on torch ops alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pyserve.model import cpu_ops
from pyserve.model.attention import AttentionMetadata, make_backend
from pyserve.model.checkpoint import load_config
from pyserve.model.config import ModelConfig, RopeConfig
from pyserve.model.cpu_linear import use_cpu_linears
from pyserve.model.decoder import RMSNorm
from pyserve.model.kv_cache import allocate_kv_cache
from pyserve.model.loader import load_model
from pyserve.model.rope import RotaryEmbedding, apply_rotary
from pyserve.model.whole_model import WholeModel
from pyserve.testing import build_model
from pyserve.testing.tiny_gguf import gguf_from_hf


@pytest.mark.parametrize("rows", [1, 5])
def test_rms_norm_and_its_residual_add_match_the_reference(rows):
    torch.manual_seed(0)
    norm = RMSNorm(96, 1e-6)
    norm.weight.data = torch.randn(96)
    x, delta = torch.randn(rows, 96), torch.randn(rows, 96)
    with torch.no_grad():
        want = norm(x)
        torch.testing.assert_close(cpu_ops.rms_norm(x, cpu_ops.weight_view(norm.weight), 1e-6), want,
                                   rtol=1e-5, atol=1e-6)
        residual = x - delta
        got = cpu_ops.add_rms_norm(delta, residual, cpu_ops.weight_view(norm.weight), 1e-6)
    torch.testing.assert_close(residual, x, rtol=0, atol=1e-6)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_silu_mul_matches_torch():
    torch.manual_seed(1)
    gate_up = torch.randn(3, 2 * 40) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(cpu_ops.silu_mul(gate_up), F.silu(gate) * up, rtol=1e-5, atol=1e-6)


def test_rotary_has_the_bits_of_apply_rotary_and_leaves_v_alone():
    torch.manual_seed(2)
    rope = RotaryEmbedding(RopeConfig(theta=10000.0), 16, 64, torch.float32)
    positions = torch.tensor([0, 7, 63])
    tables = rope.tables(positions)
    qkv = torch.randn(3, (4 + 2 + 2) * 16)
    want = apply_rotary(qkv[:, : 6 * 16].view(3, 6, 16), tables).reshape(3, -1)
    v = qkv[:, 6 * 16 :].clone()
    cpu_ops.rotary_(qkv, 6, 16, tables)
    assert torch.equal(qkv[:, : 6 * 16], want)
    assert torch.equal(qkv[:, 6 * 16 :], v)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen2-gguf-mixed"])
def test_a_model_on_the_cpu_kernels_matches_it_on_torch_ops(tmp_path, arch):
    """Same greedy tokens and close logits as the torch reference; the whole-layer kernel, and the
    whole model in one call, give the bits of the same kernels called op by op. The GGUF's q, k
    and gate are 4-bit and its v and up int8 (as llama.cpp's Q4_K_M mixes store them): its fused
    projections run as parts side by side."""
    mixed = arch.endswith("-gguf-mixed")
    model_dir = build_model(tmp_path / "hf", arch.removesuffix("-gguf-mixed"))
    if mixed:
        model_dir = gguf_from_hf(model_dir, tmp_path / "mixed.gguf", projections="Q4_0",
                                 by_role={"attn_v": "Q8_0", "ffn_up": "Q8_0"})
    cfg = load_config(model_dir)

    def load(kernels: bool, layer_kernel: bool = False):
        model = load_model(model_dir, cfg, torch.float32, torch.device("cpu"), 64, gguf_dequantize=False)
        model.fuse_projections()
        if kernels:
            use_cpu_linears(model)
            model.use_cpu_ops()
            assert model.layer_kernel
            model.layer_kernel = layer_kernel
        return model

    # 4-bit layers' kernels quantize x to int16 per block (the torch reference does not)
    tolerance, cache_tolerance = (1e-2, 1e-3) if mixed else (1e-4, 1e-5)
    models = {"torch": load(False), "ops": load(True), "layers": load(True, layer_kernel=True),
              "whole": load(True, layer_kernel=True)}
    backend = make_backend("torch")
    prompt = [5, 17, 3, 99, 42, 8, 250, 11, 64]
    tokens = {name: list(prompt) for name in models}
    caches = {name: allocate_kv_cache(cfg, 9, 4, torch.float32, torch.device("cpu")) for name in models}
    whole = WholeModel.of(models["whole"], caches["whole"])
    table = np.arange(1, 9, dtype=np.int32)[None]  # block 0 is the null block: slot = position + 4
    start = 0
    with torch.inference_mode():
        for _ in range(6):  # the prompt (9 rows), then one-row decode steps
            logits = {}
            for name, model in models.items():
                ids = tokens[name][start:]
                n, end = len(ids), len(tokens[name])
                if name == "whole":
                    logits[name] = whole.forward(ids, np.arange(start, end), np.zeros(n), table, np.arange(n))
                else:
                    meta = AttentionMetadata.build(np.arange(start, end, dtype=np.int64) + 4, table,
                                                   np.array([end], np.int32), np.array([0, n], np.int32),
                                                   torch.device("cpu"))
                    h = model(torch.tensor(ids), torch.arange(start, end), caches[name], meta, backend)
                    logits[name] = model.compute_logits(h)
                tokens[name].append(int(logits[name][-1].argmax()))
            torch.testing.assert_close(logits["ops"], logits["torch"], rtol=tolerance, atol=tolerance)
            assert torch.equal(logits["layers"], logits["ops"])
            assert torch.equal(logits["whole"], logits["ops"])
            start = len(tokens["torch"]) - 1
    assert tokens["whole"] == tokens["layers"] == tokens["ops"] == tokens["torch"]
    for (k, v), (k_ops, v_ops) in zip(caches["whole"], caches["ops"]):
        assert torch.equal(k, k_ops) and torch.equal(v, v_ops)
    for name in ("ops", "layers"):
        for (k, v), (k_ref, v_ref) in zip(caches[name], caches["torch"]):
            torch.testing.assert_close(k, k_ref, rtol=10 * cache_tolerance, atol=cache_tolerance)
            torch.testing.assert_close(v, v_ref, rtol=10 * cache_tolerance, atol=cache_tolerance)
