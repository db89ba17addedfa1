"""Weight-only quantized linear layers, quantized at load: int8 (symmetric, one scale per output
channel) and int4 (asymmetric, a scale and a zero point per group of `group_size` inputs).

Decode reads every weight once per step, so a quarter of the bytes is up to four times the
speed where weights dominate. On a CPU every step runs `_core.linear_q8` (cpu_linear's few-rows
kernel with the int8 weights widened to f32 in registers; more than 16 rows take a pass over
the weights per 16 rows), and a decoder layer whose projections are all quantized or all f32
runs whole in `_core.decoder_layer`. torch's own int8 CPU matmul (`_weight_int8pack_mm`) was
measured beside it on this machine's AMD EPYC, 2 threads, a [5632, 1024] weight: 5.4 ms at one
row against 0.31 ms, 129 ms at 32 rows against 4.6 ms (the f32 weight on oneDNN: 2.1 and 5.5 ms),
so it is not used. Elsewhere (CUDA, half precision) the layer computes with its dequantized
weight, the reference the kernels are tested against.

int8: q = round(w / s) clamped to [-127, 127] with s = max |w| / 127 per output row; the layer
computes (x q^T) * s + bias, i.e. x (q * s)^T + bias. int4: per row and group, s = (max - min) /
15, zero z = round(-min / s) in [0, 15], q = round(w / s) + z clamped to [0, 15], w ~ (q - z) * s;
the kernel computes with q * s + offset, offset = -z * s (`_core.linear_q4`). `dequantized()` is
what a layer multiplies by, in both cases.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pyserve import _core

METHODS = ("int8", "int4")
GROUP_SIZES = (32, 64, 128)


def check_method(method: str | None, group_size: int = 64) -> None:
    if method is not None and method not in METHODS:
        raise ValueError(f"quantization must be one of {', '.join(METHODS)} (or none), got {method!r}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"quantization_group_size must be one of {', '.join(map(str, GROUP_SIZES))}, got {group_size}")


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [N, K], scales f32 [N]) of a [N, K] weight: symmetric, per output channel."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127.0
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scales.contiguous()


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed uint8 [N, K / 2], scales f32 [N, K / g], zeros uint8 [N, K / g]) of a [N, K]
    weight: asymmetric 4-bit in groups of g inputs; weight 2j in the low nibble of byte j."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"quantization_group_size: {group_size} does not divide a layer's {k} inputs")
    w = weight.detach().float().reshape(n, k // group_size, group_size)
    lo, hi = w.amin(dim=2).clamp(max=0.0), w.amax(dim=2).clamp(min=0.0)  # 0 stays exact
    scales = ((hi - lo) / 15.0).clamp_min(torch.finfo(torch.float32).tiny)
    zeros = torch.round(-lo / scales).clamp_(0, 15)
    q = (torch.round(w / scales[..., None]) + zeros[..., None]).clamp_(0, 15).to(torch.uint8).reshape(n, k)
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()
    return packed, scales.contiguous(), zeros.to(torch.uint8).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The 4-bit values [N, K] of packed [N, K / 2]."""
    return torch.stack([packed & 0xF, packed >> 4], dim=2).reshape(packed.shape[0], -1)


class Int4Linear(nn.Module):
    """`linear` with its weight in 4 bits, a scale and zero point per group (its bias kept)."""

    def __init__(self, linear: nn.Linear, group_size: int):
        super().__init__()
        self.in_features, self.out_features, self.group_size = linear.in_features, linear.out_features, group_size
        packed, scales, zeros = quantize_int4(linear.weight, group_size)
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)
        self.register_buffer("zeros", zeros)
        self.register_buffer("offsets", (-zeros.float() * scales).contiguous())  # the kernel's form of the zeros
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().contiguous())
        self.cpu = packed.device.type == "cpu"
        if self.cpu:
            self.views = (packed.numpy(), scales.numpy(), self.offsets.numpy(), group_size,
                          None if self.bias is None else self.bias.numpy())

    @property
    def weight_bytes(self) -> int:
        return self.packed.numel() + 4 * self.scales.numel() + self.zeros.numel()

    def dequantized(self) -> torch.Tensor:
        q = unpack_int4(self.packed).float().reshape(self.out_features, -1, self.group_size)
        w = (q - self.zeros.float()[..., None]) * self.scales[..., None]
        return w.reshape(self.out_features, self.in_features)

    def kernel_weights(self) -> tuple:
        """The layer as `_core.decoder_layer` takes a 4-bit projection."""
        return self.views

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu and x.dtype == torch.float32:
            out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
            packed, scales, offsets, group, bias = self.views
            _core.linear_q4(x.contiguous().numpy(), packed, scales, offsets, group, bias, out.numpy(),
                            threads=torch.get_num_threads())
            return out
        return F.linear(x, self.dequantized().to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))


class Int8Linear(nn.Module):
    """`linear` with its weight quantized (its bias kept as it is)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scales = quantize_int8(linear.weight)
        self.register_buffer("qweight", q)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().contiguous())
        self.cpu = q.device.type == "cpu"
        if self.cpu:  # numpy views for the kernel (no copies)
            self.q_view, self.scales_view = q.numpy(), scales.numpy()
            self.bias_view = None if self.bias is None else self.bias.numpy()

    @property
    def weight_bytes(self) -> int:
        return self.qweight.numel() + 4 * self.scales.numel()

    def kernel_weights(self) -> tuple:
        """The layer as `_core.decoder_layer` takes a quantized projection."""
        return self.q_view, self.scales_view, self.bias_view

    def dequantized(self) -> torch.Tensor:
        return self.qweight.float() * self.scales[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu and x.dtype == torch.float32:
            out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
            _core.linear_q8(x.contiguous().numpy(), self.q_view, self.scales_view, self.bias_view, out.numpy(),
                            threads=torch.get_num_threads())
            return out
        return F.linear(x, self.dequantized().to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))


QUANTIZED = (Int8Linear, Int4Linear)


def quantize_linears(model: nn.Module, method: str, group_size: int = 64) -> int:
    """Replaces every nn.Linear inside `model` (the LM head included) by its quantized layer;
    returns how many. Embeddings stay as they are (a step reads one row of them per token)."""
    check_method(method, group_size)
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear)]
    for parent, name, child in targets:
        setattr(parent, name, Int8Linear(child) if method == "int8" else Int4Linear(child, group_size))
    return len(targets)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights: quantized layers at their packed size (values, scales and
    zero points), every other weight and bias (parameters, and the buffers cpu_linear keeps them in)
    at its own; a tensor shared by two modules (a tied head) once."""
    seen, total = set(), 0
    for m in model.modules():
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
