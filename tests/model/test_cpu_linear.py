"""CPU linear layers: F.linear's values on both paths (the Rust kernel at few rows, oneDNN or
MKL above), the same bits for a row whatever the rows beside it up to FEW_ROWS, and every
projection of a loaded model replaced (LoRA's base projections included)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pyserve import _core
from pyserve.config import EngineConfig
from pyserve.model.config import ModelConfig
from pyserve.model.cpu_linear import FEW_ROWS, MIN_PACKED_ELEMENTS, CpuLinear, can_use, use_cpu_linears
from pyserve.worker.model_worker import ModelWorker
from pyserve.testing import build_model


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, FEW_ROWS, FEW_ROWS + 1, 37])
@pytest.mark.parametrize("packed", [False, True])
def test_values_are_those_of_linear(bias, rows, packed):
    torch.manual_seed(0)
    linear = nn.Linear(96, 203, bias=bias)
    x = torch.randn(rows, 2 * 96)[:, ::2]  # strided rows, as a slice of a wider activation gives
    want = F.linear(x, linear.weight, linear.bias)
    layer = CpuLinear(linear, min_packed_elements=1 if packed else MIN_PACKED_ELEMENTS)
    got = layer(x)
    assert got.shape == (rows, 203)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_row_has_the_same_bits_alone_and_beside_up_to_few_rows_others():
    torch.manual_seed(1)
    layer = CpuLinear(nn.Linear(300, 517))
    x = torch.randn(FEW_ROWS, 300)
    full = layer(x)
    for lo, n in [(0, 1), (5, 1), (7, 3), (2, 9), (0, FEW_ROWS)]:
        assert torch.equal(layer(x[lo : lo + n]), full[lo : lo + n]), (lo, n)


def test_the_weight_is_shared_not_copied():
    embed = nn.Embedding(50, 24)
    head = nn.Linear(24, 50, bias=False)
    head.weight = embed.weight
    layer = CpuLinear(head)
    assert layer.weight.data_ptr() == embed.weight.data_ptr()


def test_the_kernel_refuses_bad_shapes_naming_the_argument():
    w = np.zeros((4, 8), dtype=np.float32)
    with pytest.raises(ValueError, match="x and out"):
        _core.linear(np.zeros((2, 7), np.float32), w, None, np.zeros((2, 4), np.float32))
    with pytest.raises(ValueError, match="bias"):
        _core.linear(np.zeros((2, 8), np.float32), w, np.zeros(3, np.float32), np.zeros((2, 4), np.float32))
    with pytest.raises(ValueError, match="weight must be C-contiguous"):
        _core.linear(np.zeros((2, 8), np.float32), np.zeros((8, 4), np.float32).T, None, np.zeros((2, 4), np.float32))


def test_only_fp32_on_cpu():
    assert can_use(torch.device("cpu"), torch.float32)
    assert not can_use(torch.device("cpu"), torch.bfloat16)
    assert not can_use(torch.device("cuda"), torch.float32)


def test_use_cpu_linears_replaces_every_projection():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 8, bias=False)), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    want = model(x)
    assert use_cpu_linears(model, min_packed_elements=32) == 3
    assert [type(m).__name__ for m in (model[0], model[2][0], model[3])] == ["CpuLinear"] * 3
    assert [m.packed is not None for m in (model[0], model[2][0], model[3])] == [True, True, False]
    torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("max_loras", [0, 2])
def test_a_loaded_model_packs_only_its_large_projections(tmp_path, max_loras):
    # hidden 512: fused q/k/v (512x1024), gate/up and down get a packed copy; o_proj (512x512) and
    # the head (vocab 300) do not. With LoRA the projections stay separate: only gate, up, down.
    model_dir = build_model(tmp_path, "llama", hidden_size=512, intermediate_size=1024, num_hidden_layers=1,
                            num_attention_heads=8, num_key_value_heads=4)
    cfg = ModelConfig.from_dir(model_dir)
    config = EngineConfig(model=str(model_dir), device="cpu", dtype="float32", num_kv_blocks=8, max_model_len=64,
                          enable_lora=max_loras > 0, max_loras=max_loras)
    worker = ModelWorker.from_config(config, cfg, model_dir=str(model_dir), max_model_len=64, speculative=None,
                                     draft_config=None, head_config=None)
    layers = {n: m for n, m in worker.model.named_modules() if isinstance(m, CpuLinear)}
    packed = sorted(n for n, m in layers.items() if m.packed is not None)
    layer = "model.layers.0"
    if max_loras:
        want = [f"{layer}.mlp.{p}.base" for p in ("down_proj", "gate_proj", "up_proj")]
    else:
        want = [f"{layer}.mlp.down_proj", f"{layer}.mlp.gate_up_proj", f"{layer}.self_attn.qkv_proj"]
    assert packed == want
    assert not any(isinstance(m, nn.Linear) for m in worker.model.modules())
    assert "lm_head" in layers
