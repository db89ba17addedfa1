"""The W8A16 and W4A16 Triton matmuls (under the interpreter without CUDA) against their torch
references and a float64 computation of the dequantized weights, and their argument checks."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pyserve.kernels.quantized_matmul import w4a16_matmul, w4a16_ref, w8a16_matmul, w8a16_ref  # noqa: E402
from pyserve.model.quantized_linear import quantize_fp8, quantize_int4, quantize_int8  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16, torch.float16] if torch.cuda.is_available() else [])
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}


FP8_OK = not torch.cuda.is_available() or torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, k, n, bias", [(1, 64, 96, True), (5, 100, 70, False), (17, 128, 64, True)])
@pytest.mark.parametrize("quantize", [quantize_int8] + ([quantize_fp8] if FP8_OK else []), ids=["int8", "fp8"][:1 + FP8_OK])
def test_w8a16_matches_the_dequantized_weight(m, k, n, bias, dtype, quantize):
    g = torch.Generator().manual_seed(m)
    q, scales = quantize(torch.randn(n, k, generator=g))
    x = torch.randn(m, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    want = x.double() @ (q.double() * scales.double()[:, None]).T + (0 if b is None else b.double())
    dev = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    got = w8a16_matmul(dev(x).to(dtype), dev(q), dev(scales), dev(b))
    ref = w8a16_ref(dev(x).to(dtype), dev(q), dev(scales), dev(b))
    assert got.dtype == dtype and got.shape == (m, n)
    scale = want.abs().max().item()
    assert (got.double().cpu() - want).abs().max().item() <= TOL[dtype] * scale
    assert (ref.double().cpu() - want).abs().max().item() <= TOL[dtype] * scale


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, k, n, group, bias", [(1, 64, 96, 32, False), (3, 256, 40, 64, True),
                                                  (16, 128, 64, 128, False), (2, 96, 24, 32, True)])
def test_w4a16_matches_the_dequantized_weight(m, k, n, group, bias, dtype):
    g = torch.Generator().manual_seed(k + m)
    packed, scales, offsets = quantize_int4(torch.randn(n, k, generator=g), group)
    x = torch.randn(m, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    q = torch.stack([packed & 0xF, packed >> 4], dim=2).reshape(n, k).double()
    w = q * scales.double().repeat_interleave(group, 1) + offsets.double().repeat_interleave(group, 1)
    want = x.double() @ w.T + (0 if b is None else b.double())
    dev = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    got = w4a16_matmul(dev(x).to(dtype), dev(packed), dev(scales), dev(offsets), group, dev(b))
    ref = w4a16_ref(dev(x).to(dtype), dev(packed), dev(scales), dev(offsets), group, dev(b))
    scale = want.abs().max().item()
    assert got.dtype == dtype and got.shape == (m, n)
    assert (got.double().cpu() - want).abs().max().item() <= TOL[dtype] * scale
    assert (ref.double().cpu() - want).abs().max().item() <= TOL[dtype] * scale


def test_bad_arguments_are_errors_naming_them():
    x, q, s = torch.zeros(2, 64), torch.zeros(8, 64, dtype=torch.int8), torch.ones(8)
    with pytest.raises(ValueError, match="qweight must have dtype"):
        w8a16_matmul(x, q.float(), s)
    with pytest.raises(ValueError, match="x has 32 features, qweight expects 64"):
        w8a16_matmul(torch.zeros(2, 32), q, s)
    with pytest.raises(ValueError, match="scales must have shape"):
        w8a16_matmul(x, q, torch.ones(7))
    packed, s4 = torch.zeros(8, 32, dtype=torch.uint8), torch.ones(8, 2, dtype=torch.float16)
    with pytest.raises(ValueError, match="scales must have dtype"):
        w4a16_matmul(x, packed, s4.float(), s4, 32)
    with pytest.raises(ValueError, match="group must be an even size dividing 64"):
        w4a16_matmul(x, packed, s4, s4, 48)
    with pytest.raises(ValueError, match="offsets must have shape"):
        w4a16_matmul(x, packed, s4, torch.ones(8, 3, dtype=torch.float16), 32)
    with pytest.raises(ValueError, match="bias must have shape"):
        w4a16_matmul(x, packed, s4, s4, 32, torch.ones(9))
