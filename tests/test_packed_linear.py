"""Linear layers on oneDNN-packed weights: F.linear's values, the same bits for a row whatever the
batch around it, and every projection of a loaded model packed (LoRA's base projections included)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pyserve.model.config import ModelConfig
from pyserve.model.packed_linear import PackedLinear, can_pack, pack_linears
from pyserve.model.worker import ModelWorker

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


def test_pack_linears_replaces_every_projection():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 8, bias=False)))
    x = torch.randn(3, 4)
    want = model(x)
    assert pack_linears(model) == 2
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("max_loras", [0, 2])
def test_a_loaded_model_serves_from_packed_weights(llama_dir, max_loras):
    cfg = ModelConfig.from_dir(llama_dir)
    worker = ModelWorker(llama_dir, cfg, device="cpu", dtype="float32", num_kv_blocks=8, max_model_len=64,
                         max_loras=max_loras)
    layers = cfg.num_layers
    # fused q/k/v, o, gate/up, down per layer without LoRA; seven separate projections with it
    want = layers * (4 if max_loras == 0 else 7) + 1
    assert sum(isinstance(m, PackedLinear) for m in worker.model.modules()) == want
    assert not any(isinstance(m, nn.Linear) for m in worker.model.modules())
