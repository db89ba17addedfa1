"""Rotary position embeddings (default, linear and Llama-3 frequency scaling)."""

from __future__ import annotations

import math

import torch

from pyserve.model.config import RopeConfig


def inv_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Per-pair inverse frequencies, in float32 like transformers (so positions match bit for bit)."""
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        return inv / rope.factor
    if rope.rope_type == "llama3":
        low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv


class RotaryEmbedding(torch.nn.Module):
    """Applies RoPE to q and k laid out as [tokens, heads, head_dim] (the HF "rotate half" form)."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int, dtype: torch.dtype):
        super().__init__()
        self.rope, self.head_dim, self.max_positions, self.dtype = rope, head_dim, max_positions, dtype
        self.register_buffer("cos", torch.empty(max_positions, head_dim, dtype=dtype), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, head_dim, dtype=dtype), persistent=False)
        self.reset()

    def reset(self) -> None:
        """(Re)computes the cos/sin tables on the buffers' device (after a move from `meta`)."""
        if self.cos.is_meta:
            return
        with torch.no_grad():
            inv = inv_frequencies(self.rope, self.head_dim).to(self.cos.device)
            t = torch.arange(self.max_positions, dtype=torch.float32, device=self.cos.device)
            emb = torch.cat((torch.outer(t, inv),) * 2, dim=-1)
            self.cos.copy_(emb.cos().to(self.dtype))
            self.sin.copy_(emb.sin().to(self.dtype))

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of the step's positions, [tokens, 1, head_dim]: looked up once per step,
        shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x [tokens, heads, head_dim] rotated (q, k, or both side by side); `tables` from
    RotaryEmbedding.tables."""
    cos, sin = tables
    return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
