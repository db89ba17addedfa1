"""The counter-based hash behind seeded sampling, once in torch and once in Triton, bit for bit
the same: a uniform in (0, 1) for each (seed, position, index) triple.

murmur3's 32-bit finaliser over a mix of the three keys (each folded to 32 bits); its top 24 bits
make u = (bits + 0.5) / 2**24. Arithmetic is int64 with the low 32 bits kept after every step, so
both sides wrap the same way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MASK = 0xFFFFFFFF
C_SEED, C_POS, C_INDEX = 0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D
F1, F2 = 0x85EBCA6B, 0xC2B2AE35


def keyed_uniform(seeds: torch.Tensor, positions: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """f32 uniforms for int64 tensors that broadcast together."""
    seeds = (seeds & MASK) ^ ((seeds >> 32) & MASK)
    x = (seeds * C_SEED + (positions & MASK) * C_POS + (index & MASK) * C_INDEX) & MASK
    x ^= x >> 16
    x = (x * F1) & MASK
    x ^= x >> 13
    x = (x * F2) & MASK
    x ^= x >> 16
    return ((x >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def keyed_exponential_rows(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """f32 [R, vocab_size] Exp(1) draws: row r is -log of the numbers of (seeds[r], positions[r])
    at indices 0 .. vocab_size - 1 (what the kernels race with)."""
    ids = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)
    return -torch.log(keyed_uniform(seeds[:, None], positions[:, None], ids[None, :]))


@triton.jit
def keyed_uniform_tl(seed, position, index):
    """The same in a kernel: `seed` and `position` int64 scalars, `index` an int64 block."""
    s = (seed & 0xFFFFFFFF) ^ ((seed >> 32) & 0xFFFFFFFF)
    x = (s * 0x9E3779B1 + (position & 0xFFFFFFFF) * 0x85EBCA77 + (index & 0xFFFFFFFF) * 0xC2B2AE3D) & 0xFFFFFFFF
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & 0xFFFFFFFF
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & 0xFFFFFFFF
    x = x ^ (x >> 16)
    return ((x >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
