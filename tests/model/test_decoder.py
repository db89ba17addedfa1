"""The decoder's layers against transformers': the fp32 and bf16 RMSNorm has the same bits."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from pyserve.model.decoder import RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2048])
def test_rms_norm_has_the_bits_of_transformers(dtype, rows):
    torch.manual_seed(0)
    ours, theirs = RMSNorm(512, 1e-5), LlamaRMSNorm(512, eps=1e-5)
    theirs.weight.data = ours.weight.data = torch.randn(512)
    ours.to(dtype), theirs.to(dtype)
    x = torch.randn(rows, 512).to(dtype)
    with torch.no_grad():
        assert torch.equal(ours(x), theirs(x))
