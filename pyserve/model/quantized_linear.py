"""Quantized linear layers, quantized at load: weight-only int8 (symmetric, one scale per output
channel) and int4 (asymmetric, a scale and a zero point per group of `group_size` inputs); and
w8a8, int8's weights with int8 activations (each row of x quantized like a weight row as the
layer runs), for CPUs whose oneDNN multiplies int8 (VNNI, AMX).

Decode reads every weight once per step, so a quarter of the bytes is up to four times the
speed where weights dominate. On a CPU every step runs `_core.linear_q8` (cpu_linear's few-rows
kernel with the int8 weights widened to f32 in registers; more than 16 rows take a pass over
the weights per 16 rows), and a decoder layer whose projections are all quantized or all f32
runs whole in `_core.decoder_layer`. torch's own int8 CPU matmul (`_weight_int8pack_mm`) was
measured beside it on this machine's AMD EPYC, 2 threads, a [5632, 1024] weight: 5.4 ms at one
row against 0.31 ms, 129 ms at 32 rows against 4.6 ms (the f32 weight on oneDNN: 2.1 and 5.5 ms),
so it is not used. On CUDA the layers run kernels/quantized_matmul's Triton W8A16 and W4A16
matmuls (dequantized in registers); elsewhere (half precision on a CPU) F.linear on the
dequantized weight, the reference the kernels are tested against.

The layers are built from their quantized tensors: `from_linear` quantizes a full-precision
layer at load, model/prequantized reads a quantized checkpoint's.

int8: q = round(w / s) clamped to [-127, 127] with s = max |w| / 127 per output row; the layer
computes (x q^T) * s + bias, i.e. x (q * s)^T + bias. int4: per row and group a scale s and an
offset, float16 (as GGUF's Q4_0 / Q4_1 store theirs: a group of 32 weights is 20 bytes, not 24 as
in f32), fitted to the group's weights (quantize_int4: min-max's pair or a least-squares one, the
better), q = round((w - offset) / s) in [0, 15], w ~ q * s + offset (`_core.linear_q4`; on a CPU,
groups of 32 or more multiply the nibbles with x quantized to int16 per block of 32 inputs, the
offsets with x itself: pyserve.testing.quantized_reference.Int4Reference is that arithmetic in
torch). `dequantized()` is what a layer multiplies by, in both cases.

w8a8: where a weight-only layer's arithmetic is f32 (at most the CPU's f32 FMA peak, which
oneDNN's f32 GEMM already nears at 32 rows), int8 products run 4x as many multiply-adds per
instruction (VNNI) or more (AMX tiles). The layer quantizes x per row like quantize_int8 (sx =
max |x| / 127), sums xq q^T exactly in int32 and computes ((xq q^T) * sx) * s + bias: a few rows
on `_core.linear_w8a8` (vpdpbusd, the weights streamed once, like linear_q8), more on
`torch._int_mm` (oneDNN where the CPU has VNNI, a plain loop elsewhere, which check_device
refuses to serve). Integer sums are exact, so both give the same bits and a row gets them alone
or in a batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pyserve import _core
from pyserve.kernels.quantized_matmul import w4a16_matmul, w8a16_matmul
from pyserve.model.block_embedding import BlockEmbedding
from pyserve.model.cpu_linear import FEW_ROWS
from pyserve.model.kquant_linear import KQuantLinear

METHODS = ("int8", "int4", "fp8", "w8a8")
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
GROUP_SIZES = (32, 64, 128)


def check_method(method: str | None, group_size: int = 64) -> None:
    if method is not None and method not in METHODS:
        raise ValueError(f"quantization must be one of {', '.join(METHODS)} (or none), got {method!r}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"quantization_group_size must be one of {', '.join(map(str, GROUP_SIZES))}, got {group_size}")


QUANTIZE_ROWS = 1024  # rows quantized at a time: their floats stay in the cache between the passes


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [N, K], scales f32 [N]) of a [N, K] weight: symmetric, per output channel. Done
    QUANTIZE_ROWS rows at a time, each pass in place: the same bits as the whole tensor at once,
    ~6x faster on a large one (a [40000, 1536] weight: 0.33 s -> 0.05 s on 2 cores)."""
    w = weight.detach().float()
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    scales = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
    tiny = torch.finfo(torch.float32).tiny
    for start in range(0, w.shape[0], QUANTIZE_ROWS):
        rows = w[start : start + QUANTIZE_ROWS]
        s = torch.amax(rows.abs(), dim=1).clamp_min_(tiny).div_(127.0)
        scales[start : start + QUANTIZE_ROWS] = s
        q[start : start + QUANTIZE_ROWS] = rows.div(s[:, None]).round_().clamp_(-127, 127)
    return q, scales


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn [N, K], scales f32 [N]) of a [N, K] weight: one scale per output channel,
    the row's largest magnitude at e4m3's largest finite value."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / FP8_MAX
    q = (w / scales[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.contiguous(), scales.contiguous()


# Grids tried beside min-max's 15 steps over a group's range: 14.5 and 15.5 steps (llama.cpp's
# make_qkx2_quants tries 21 from 14 to 16; on Qwen2.5-Coder-0.5B's layers these two keep nearly all
# of the gain: squared error 0.70-0.82x min-max's, against 0.68-0.81x with four)
INT4_GRID_STEPS = (-0.5, 0.5)
F16_TINY = torch.finfo(torch.float16).tiny


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed uint8 [N, K / 2], scales f16 [N, K / g], offsets f16 [N, K / g]) of a [N, K]
    weight: asymmetric 4-bit in groups of g inputs, w ~ q * scale + offset, weight 2j in the low
    nibble of byte j. Each group gets the pair of least squared error among: min-max's (offset
    the smallest weight, llama.cpp's Q4_1 rule) and, for each grid of INT4_GRID_STEPS, the
    least-squares fit of (scale, offset) to the weights on that grid; every pair is rounded to f16
    before q is chosen against it and its error counted, so no group is worse than min-max's.
    QUANTIZE_ROWS rows at a time."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"quantization_group_size: {group_size} does not divide a layer's {k} inputs")
    packed = torch.empty(n, k // 2, dtype=torch.uint8, device=weight.device)
    scales = torch.empty(n, k // group_size, dtype=torch.float16, device=weight.device)
    offsets = torch.empty_like(scales)
    for start in range(0, n, QUANTIZE_ROWS):
        rows = slice(start, start + QUANTIZE_ROWS)
        x = weight[rows].detach().float().reshape(-1, k // group_size, group_size)
        q, scales[rows], offsets[rows] = _fit_groups(x)
        q = q.to(torch.uint8).reshape(x.shape[0], k)
        packed[rows] = q[:, 0::2] | (q[:, 1::2] << 4)
    return packed, scales, offsets


def _fit_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, scale f16, offset f16) of each group of x [rows, groups, g] (see quantize_int4)."""
    lo, hi = x.amin(dim=2, keepdim=True), x.amax(dim=2, keepdim=True)
    span = hi - lo
    best = _on_grid(x, span / 15.0, lo)
    for step in INT4_GRID_STEPS:
        q = torch.round((x - lo) * ((15.0 + step) / span.clamp_min(F16_TINY))).clamp_(0, 15)
        candidate = _on_grid(x, *_least_squares(x, q, span, lo))
        better = candidate[3] < best[3]
        best = tuple(torch.where(better, c, b) for c, b in zip(candidate, best))
    q, scale, offset, _ = best
    return q, scale[..., 0], offset[..., 0]


def _on_grid(x, scale, offset):
    """(q, scale f16, offset f16, squared error) of x's groups for a (scale, offset) pair, the pair
    rounded to f16 first."""
    scale, offset = scale.clamp_min(F16_TINY).half(), offset.half()
    s, o = scale.float(), offset.float()
    q = torch.round((x - o) / s).clamp_(0, 15)
    return q, scale, offset, (q * s + o - x).square_().sum(dim=2, keepdim=True)


def _least_squares(x, q, span, lo):
    """The (scale, offset) minimizing sum (q * scale + offset - x)^2 over each group; min-max's
    where q does not vary or the slope is not positive."""
    g = x.shape[2]
    sq, sx = q.sum(dim=2, keepdim=True), x.sum(dim=2, keepdim=True)
    sqq, sqx = (q * q).sum(dim=2, keepdim=True), (q * x).sum(dim=2, keepdim=True)
    det = g * sqq - sq * sq
    scale = (g * sqx - sq * sx) / det.clamp_min(1.0)  # det is an integer: 0 or at least g - 1
    fit = (det > 0) & (scale > 0)
    scale = torch.where(fit, scale, span / 15.0)
    return scale, torch.where(fit, (sx - scale * sq) / g, lo)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The 4-bit values [N, K] of packed [N, K / 2]."""
    return torch.stack([packed & 0xF, packed >> 4], dim=2).reshape(packed.shape[0], -1)


class Int4Linear(nn.Module):
    """A linear layer with 4-bit weights, a scale and an offset (float16; others are rounded to
    it) per group of `group_size` inputs: weight (o, j) = q * scale + offset. `input_order`
    (act-order checkpoints): the layer's columns are stored in this order of its inputs, so that
    each group is contiguous; x is gathered into it first."""

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None, input_order: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = packed.shape[0], 2 * packed.shape[1]
        self.group_size = group_size
        self.register_buffer("packed", packed.contiguous())
        self.register_buffer("scales", scales.half().contiguous())
        self.register_buffer("offsets", offsets.half().contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        self.register_buffer("input_order", input_order)
        self.cpu = packed.device.type == "cpu"
        if self.cpu:
            self.views = (self.packed.numpy(), self.scales.numpy(), self.offsets.numpy(), group_size,
                          None if self.bias is None else self.bias.numpy())

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int) -> Int4Linear:
        return cls(*quantize_int4(linear.weight, group_size), group_size, linear.bias)

    @property
    def weight_bytes(self) -> int:
        return self.packed.numel() + 2 * (self.scales.numel() + self.offsets.numel())

    def dequantized(self) -> torch.Tensor:
        """The weight [out, in], its columns in input order."""
        q = unpack_int4(self.packed).float().reshape(self.out_features, -1, self.group_size)
        w = (q * self.scales.float()[..., None] + self.offsets.float()[..., None]).reshape(self.out_features,
                                                                                         self.in_features)
        if self.input_order is None:
            return w
        return torch.empty_like(w).index_copy_(1, self.input_order, w)

    def kernel_weights(self) -> tuple | None:
        """The layer as `_core.decoder_layer` takes a 4-bit projection (None: its inputs are
        gathered first, which the layer kernel does not do)."""
        return self.views if self.input_order is None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_order is not None:
            x = x.index_select(-1, self.input_order)
        if self.cpu and x.dtype == torch.float32:
            out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
            packed, scales, offsets, group, bias = self.views
            _core.linear_q4(x.contiguous().numpy(), packed, scales, offsets, group, bias, out.numpy(),
                            threads=torch.get_num_threads())
            return out
        if x.is_cuda:
            return w4a16_matmul(x.contiguous(), self.packed, self.scales, self.offsets, self.group_size, self.bias)
        return F.linear(x, self.dequantized().to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))


class Int8Linear(nn.Module):
    """A linear layer with int8 weights, one scale per output channel: y = (x q^T) * s + bias."""

    quantize = staticmethod(quantize_int8)

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scales", scales.float().contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        self.cpu = qweight.device.type == "cpu" and qweight.dtype == torch.int8  # the Rust kernel's weights
        if self.cpu:  # numpy views for the kernel (no copies)
            self.q_view, self.scales_view = self.qweight.numpy(), self.scales.numpy()
            self.bias_view = None if self.bias is None else self.bias.numpy()

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        return cls(*cls.quantize(linear.weight), linear.bias)

    @property
    def weight_bytes(self) -> int:
        return self.qweight.numel() + 4 * self.scales.numel()

    def kernel_weights(self) -> tuple | None:
        """The layer as `_core.decoder_layer` takes a quantized projection (None: no CPU kernel)."""
        return (self.q_view, self.scales_view, self.bias_view) if self.cpu else None

    def dequantized(self) -> torch.Tensor:
        return self.qweight.float() * self.scales[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu and x.dtype == torch.float32:
            out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
            _core.linear_q8(x.contiguous().numpy(), self.q_view, self.scales_view, self.bias_view, out.numpy(),
                            threads=torch.get_num_threads())
            return out
        if x.is_cuda:
            return w8a16_matmul(x.contiguous(), self.qweight, self.scales, self.bias)
        return F.linear(x, self.dequantized().to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))


class W8A8Linear(Int8Linear):
    """Int8Linear's weights with int8 activations: y = ((xq q^T) * sx) * s + bias, where (xq, sx)
    = quantize_int8(x), each row of x with a scale of its own, the sums exact in int32. Up to
    FEW_ROWS fp32 rows on the CPU run `_core.linear_w8a8` (VNNI; also inside the layer and
    whole-model kernels), more `torch._int_mm` (oneDNN): the same bits."""

    def kernel_weights(self) -> tuple | None:
        return (self.q_view, self.scales_view, self.bias_view, "w8a8") if self.cpu else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu and x.dtype == torch.float32 and x.shape[0] <= FEW_ROWS:
            out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
            _core.linear_w8a8(x.contiguous().numpy(), self.q_view, self.scales_view, self.bias_view, out.numpy(),
                              threads=torch.get_num_threads())
            return out
        xq, x_scales = quantize_int8(x)
        out = torch._int_mm(xq, self.qweight.t()).float() * x_scales[:, None] * self.scales
        if self.bias is not None:
            out += self.bias
        return out.to(x.dtype)


class Fp8Linear(Int8Linear):
    """Int8Linear with float8 (e4m3) weights: served on CUDA GPUs of compute capability 8.9+ (the
    worker checks) by the same W8A16 kernel; elsewhere it computes with the dequantized weight
    (the reference). It has no CPU kernel, so it is never part of `_core.decoder_layer`."""

    quantize = staticmethod(quantize_fp8)


QUANTIZED = (Int8Linear, Int4Linear, KQuantLinear)  # Fp8Linear and W8A8Linear are Int8Linears
LAYERS = {"int8": Int8Linear, "fp8": Fp8Linear, "w8a8": W8A8Linear}  # of one scale per output channel


def fast_int8_matmul() -> bool:
    """Whether torch multiplies int8 matrices on oneDNN here (a VNNI CPU, oneDNN enabled); elsewhere
    `torch._int_mm` is a plain loop, ~60x slower than f32 at 32 rows."""
    return (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
            and bool(torch.cpu.get_capabilities().get("avx512_vnni", False)))


def check_device(method: str | None, device: torch.device) -> None:
    """fp8 weights are served only where the GPU computes with them natively, w8a8 only on a CPU
    whose oneDNN multiplies int8."""
    if method == "w8a8" and (device.type != "cpu" or not fast_int8_matmul()):
        raise ValueError(f"quantization: w8a8 (int8 activations) runs on CPUs with VNNI (AVX512-VNNI or AMX), "
                         f"where oneDNN multiplies int8 matrices; this engine runs on {device}"
                         f"{'' if device.type != 'cpu' else ' without it'} (int8 quantizes the weights only)")
    if method == "fp8" and (device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9)):
        raise ValueError(f"quantization: fp8 weights need a CUDA GPU of compute capability 8.9 or later "
                         f"(Ada, Hopper); this engine runs on {device}")


def quantize_linears(model: nn.Module, method: str, group_size: int = 64) -> int:
    """Replaces every nn.Linear inside `model` (the LM head included) by its quantized layer;
    returns how many. Embeddings stay as they are (a step reads one row of them per token). int4
    keeps the LM head (`model.lm_head`) at int8, as llama.cpp's 4-bit files keep theirs at 6-8
    bits: on SmolLM2-135M (groups of 64) the int8 head takes perplexity from +60% of fp32's to +25%
    (bench/int4_quality.py)."""
    check_method(method, group_size)
    head = getattr(model, "lm_head", None)
    head = getattr(head, "inner", head)  # a tensor-parallel rank's head wraps its rows (VocabParallelHead)
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear)]
    for parent, name, child in targets:
        if method == "int4" and child is not head:
            layer = Int4Linear.from_linear(child, group_size)
        else:
            layer = LAYERS["int8" if method == "int4" else method].from_linear(child)
        setattr(parent, name, layer)
    return len(targets)


def concatenated(parts: tuple[nn.Module, ...]) -> nn.Module | None:
    """One quantized layer whose outputs are those of `parts` (quantized layers of one kind over
    the same inputs) in order, or None where they cannot be joined (kinds, groups or input
    orders differ). K-quant layers are a GGUF file's blocks read in place: joined, they keep
    their rows where they are (KQuantLinear.joined)."""
    first = parts[0]
    if all(isinstance(p, KQuantLinear) for p in parts):
        return KQuantLinear.joined(parts)
    if not all(type(p) is type(first) for p in parts) or any((p.bias is None) != (first.bias is None) for p in parts):
        return None
    bias = None if first.bias is None else torch.cat([p.bias for p in parts])
    if isinstance(first, Int8Linear):  # fp8 and w8a8 too
        return type(first)(torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]), bias)
    if any(p.group_size != first.group_size for p in parts):
        return None
    orders = [p.input_order for p in parts]
    if any((o is None) != (orders[0] is None) or (o is not None and not torch.equal(o, orders[0])) for o in orders):
        return None
    return Int4Linear(torch.cat([p.packed for p in parts]), torch.cat([p.scales for p in parts]),
                      torch.cat([p.offsets for p in parts]), first.group_size, bias, orders[0])


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights: quantized layers at their packed size (values, scales and
    zero points), every other weight and bias (parameters, and the buffers cpu_linear keeps them in)
    at its own; a tensor shared by two modules (a tied head) once."""
    seen, total = set(), 0
    for m in model.modules():
        if isinstance(m, (KQuantLinear, BlockEmbedding)):  # a GGUF file's blocks: a head may share a table's
            for blocks in m.parts if isinstance(m, KQuantLinear) else (m.blocks,):
                if blocks.data_ptr() not in seen:
                    seen.add(blocks.data_ptr())
                    total += blocks.numel()
            continue
        if isinstance(m, QUANTIZED):
            total += m.weight_bytes
            continue
        tensors = list(m.parameters(recurse=False))
        tensors += [b for name, b in m.named_buffers(recurse=False) if name in ("weight", "bias") and b is not None]
        for t in tensors:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total
