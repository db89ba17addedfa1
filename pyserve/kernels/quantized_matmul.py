"""Weight-only quantized matmuls for CUDA: W8A16 (int8 or fp8 e4m3, one scale per output channel)
and W4A16 (4 bits two to a byte, a scale and an offset per group of inputs), the weights dequantized in
registers and multiplied through tl.dot in the activations' dtype with f32 accumulation.

Each program computes a BLOCK_M x BLOCK_N tile of y, streaming BLOCK_K-wide slices of x and of
the quantized weight: at decode's few rows the weight bytes are the traffic, a quarter (int8) or
an eighth (4-bit) of f32's, half or a quarter of bf16's.

Layouts (row-major, the CPU kernels' and model/quantized_linear's):
  x:       [M, K] float16 / bfloat16 / float32
  W8A16:   qweight int8 or float8_e4m3fn [N, K], scales f32 [N]   y = (x q^T) * scales + bias
  W4A16:   packed uint8 [N, K / 2] (input 2j in the low nibble of byte j), scales and offsets
           f16 [N, K / group]                              y = x (q * scale + offset)^T + bias
  bias:    f32 [N] or None;  y: [M, N] in x's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pyserve.kernels._checks import FLOAT_DTYPES, check_shape, check_tensor
from pyserve.kernels._launch import launch

BLOCK_M = 16  # tl.dot's least; decode steps have fewer rows (masked)
BLOCK_N = 64
BLOCK_K = 64
RUNTIME = ("m",)  # the row count changes every step: not specialised on


@triton.jit
def _x_tile(x_ptr, rows, row_ok, ks, k_ok, stride_x):
    """x[rows, ks], zeros outside."""
    return tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                   other=0.0)


@triton.jit
def _store_tile(acc, bias_ptr, y_ptr, rows, cols, row_ok, col_ok, stride_y, HAS_BIAS: tl.constexpr):
    """y[rows, cols] = acc (+ bias[cols]), in y's dtype."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0)[None, :]
    tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_y + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=RUNTIME)
def _w8a16_kernel(x_ptr, q_ptr, scales_ptr, bias_ptr, y_ptr, m, n, k, stride_x, stride_q, stride_y,
                  HAS_BIAS: tl.constexpr, FP8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """FP8: q holds e4m3 bytes (read as uint8 and reinterpreted), else int8 values."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < m, cols < n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k
        x = _x_tile(x_ptr, rows, row_ok, ks, k_ok, stride_x)
        q = tl.load(q_ptr + cols[:, None].to(tl.int64) * stride_q + ks[None, :],
                    mask=col_ok[:, None] & k_ok[None, :], other=0)
        if FP8:
            w = q.to(tl.float8e4nv, bitcast=True).to(x.dtype)
        else:
            w = q.to(x.dtype)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
    acc = acc * tl.load(scales_ptr + cols, mask=col_ok, other=0.0)[None, :]
    _store_tile(acc, bias_ptr, y_ptr, rows, cols, row_ok, col_ok, stride_y, HAS_BIAS)


@triton.jit(do_not_specialize=RUNTIME)
def _w4a16_kernel(x_ptr, packed_ptr, scales_ptr, offsets_ptr, bias_ptr, y_ptr, m, n, k, stride_x, stride_p,
                  stride_s, stride_y, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < m, cols < n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k
        w_mask = col_ok[:, None] & k_ok[None, :]
        x = _x_tile(x_ptr, rows, row_ok, ks, k_ok, stride_x)
        # each byte is loaded for its two inputs (the second load hits the cache), then shifted
        byte = tl.load(packed_ptr + cols[:, None].to(tl.int64) * stride_p + ks[None, :] // 2, mask=w_mask, other=0)
        q = ((byte >> ((ks[None, :] % 2) * 4).to(tl.uint8)) & 0xF).to(tl.float32)
        group = cols[:, None].to(tl.int64) * stride_s + ks[None, :] // GROUP
        scale = tl.load(scales_ptr + group, mask=w_mask, other=0.0).to(tl.float32)
        w = q * scale + tl.load(offsets_ptr + group, mask=w_mask, other=0.0).to(tl.float32)
        acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=DOT_PRECISION)
    _store_tile(acc, bias_ptr, y_ptr, rows, cols, row_ok, col_ok, stride_y, HAS_BIAS)


def _check_common(x, weight, scales, bias, scales_dtype=torch.float32):
    check_tensor("x", x, 2, FLOAT_DTYPES)
    check_tensor("scales", scales, scales.dim(), (scales_dtype,), x.device)
    if bias is not None:
        check_tensor("bias", bias, 1, (torch.float32,), x.device)
        check_shape("bias", bias, weight.shape[:1])


def _precision(x: torch.Tensor) -> str:
    return "ieee" if x.dtype == torch.float32 else "tf32"


def w8a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """Triton launcher, checked: y [M, N] = (x q^T) * scales + bias, in x's dtype; qweight int8
    or float8_e4m3fn (fp8 needs a GPU of compute capability 8.9+, or the interpreter)."""
    check_tensor("qweight", qweight, 2, (torch.int8, torch.float8_e4m3fn), x.device)
    _check_common(x, qweight, scales, bias)
    fp8 = qweight.dtype == torch.float8_e4m3fn
    n, k = qweight.shape
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} features, qweight expects {k}")
    check_shape("scales", scales, (n,))
    m = x.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        launch(_w8a16_kernel, (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N)), RUNTIME,
               x_ptr=x, q_ptr=qweight.view(torch.uint8) if fp8 else qweight, scales_ptr=scales,
               bias_ptr=scales if bias is None else bias, y_ptr=y, m=m, n=n, k=k, stride_x=x.stride(0),
               stride_q=qweight.stride(0), stride_y=y.stride(0), HAS_BIAS=bias is not None, FP8=fp8,
               BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
               DOT_PRECISION=_precision(x))
    return y


def w4a16_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """Triton launcher, checked: y [M, N] = x (q * scale + offset)^T + bias, in x's dtype; scales
    and offsets float16."""
    check_tensor("packed", packed, 2, (torch.uint8,), x.device)
    _check_common(x, packed, scales, bias, torch.float16)
    check_tensor("offsets", offsets, 2, (torch.float16,), x.device)
    n, k = packed.shape[0], 2 * packed.shape[1]
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} features, packed expects {k}")
    if group < 2 or group % 2 or k % group:
        raise ValueError(f"group must be an even size dividing {k} inputs, got {group}")
    check_shape("scales", scales, (n, k // group))
    check_shape("offsets", offsets, (n, k // group))
    m = x.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        launch(_w4a16_kernel, (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N)), RUNTIME,
               x_ptr=x, packed_ptr=packed, scales_ptr=scales, offsets_ptr=offsets,
               bias_ptr=scales if bias is None else bias, y_ptr=y, m=m, n=n, k=k, stride_x=x.stride(0),
               stride_p=packed.stride(0), stride_s=scales.stride(0), stride_y=y.stride(0), GROUP=group,
               HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
               DOT_PRECISION=_precision(x))
    return y


def w8a16_ref(x, qweight, scales, bias=None):
    """Torch reference: the dequantized weight in f32, the result in x's dtype."""
    return F.linear(x.float(), qweight.float() * scales[:, None], bias).to(x.dtype)


def w4a16_ref(x, packed, scales, offsets, group, bias=None):
    """Torch reference: the dequantized weight in f32, the result in x's dtype."""
    q = torch.stack([packed & 0xF, packed >> 4], dim=2).reshape(packed.shape[0], -1).float()
    w = (q.reshape(q.shape[0], -1, group) * scales.float()[..., None] + offsets.float()[..., None]).reshape(q.shape)
    return F.linear(x.float(), w, bias).to(x.dtype)
