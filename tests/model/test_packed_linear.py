"""Linear layers on oneDNN-packed weights: F.linear's values, the same bits for a row whatever the
batch around it, and every projection of a loaded model packed (LoRA's base projections included)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pyserve.model.config import ModelConfig
from pyserve.model.packed_linear import MIN_PACKED_ELEMENTS, PackedLinear, can_pack, pack_linears
from pyserve.model.worker import ModelWorker
from pyserve.testing import build_model

pytestmark = pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.float32), reason="torch without oneDNN")


@pytest.mark.parametrize("bias", [False, True])
def test_values_are_those_of_linear(bias):
    torch.manual_seed(0)
    linear = nn.Linear(96, 200, bias=bias)
    x = torch.randn(37, 2 * 96)[:, ::2]  # strided rows, as a slice of a wider activation gives
    want = F.linear(x, linear.weight, linear.bias)
    got = PackedLinear(linear)(x)
    assert got.shape == (37, 200)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_row_has_the_same_bits_alone_and_in_a_batch():
    torch.manual_seed(1)
    packed = PackedLinear(nn.Linear(256, 512))
    x = torch.randn(300, 256)
    full = packed(x)
    for lo, n in [(0, 1), (5, 1), (7, 3), (11, 48), (0, 300)]:
        assert torch.equal(packed(x[lo : lo + n]), full[lo : lo + n]), (lo, n)


def test_only_fp32_on_cpu_is_packed():
    assert not can_pack(torch.device("cpu"), torch.bfloat16)
    assert not can_pack(torch.device("cuda"), torch.float32)


def test_pack_linears_replaces_the_large_projections():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 8, bias=False)), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    want = model(x)
    assert pack_linears(model, min_elements=32) == 2
    assert [type(m).__name__ for m in (model[0], model[2][0], model[3])] == ["PackedLinear", "PackedLinear", "Linear"]
    torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("max_loras", [0, 2])
def test_a_loaded_model_packs_its_large_projections(tmp_path, max_loras):
    # hidden 512: fused q/k/v (512x1024), gate/up and down are packed; o_proj (512x512) and the
    # head (vocab 300) stay plain. With LoRA the projections stay separate: only gate, up, down.
    model_dir = build_model(tmp_path, "llama", hidden_size=512, intermediate_size=1024, num_hidden_layers=1,
                            num_attention_heads=8, num_key_value_heads=4)
    cfg = ModelConfig.from_dir(model_dir)
    worker = ModelWorker(model_dir, cfg, device="cpu", dtype="float32", num_kv_blocks=8, max_model_len=64,
                         max_loras=max_loras)
    packed = sorted(n for n, m in worker.model.named_modules() if isinstance(m, PackedLinear))
    layer = "model.layers.0"
    if max_loras:
        want = [f"{layer}.mlp.{p}.base" for p in ("down_proj", "gate_proj", "up_proj")]
    else:
        want = [f"{layer}.mlp.down_proj", f"{layer}.mlp.gate_up_proj", f"{layer}.self_attn.qkv_proj"]
    assert packed == want
    plain = [m for m in worker.model.modules() if isinstance(m, nn.Linear)]
    assert plain and all(m.weight.numel() < MIN_PACKED_ELEMENTS for m in plain)
