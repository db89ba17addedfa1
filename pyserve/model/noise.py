"""Counter-based noise for seeded requests: the Exp(1) draws of the exponential race that picks
the token at index `position` of a request's sequence are a hash of (seed, position, token id),
not a stream. So a seeded request gets the same draws for the same token wherever its row sits,
whatever the batch, and however many tokens a step verifies or a draft model guessed: plain
sampling, speculative verification and the draft's guesses all read the same numbers.

The hash is murmur3's 32-bit finaliser over a mix of the three keys; its top 24 bits make a
uniform u in (0, 1), and the draw is -log(u). Plain torch integer ops, on any device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK = 0xFFFFFFFF


@dataclass(slots=True, frozen=True)
class NoiseKey:
    """The draws of one row: a request's seed and the sequence index of the token it samples."""

    seed: int
    position: int

    def at(self, offset: int) -> NoiseKey:
        return NoiseKey(self.seed, self.position + offset)


def keyed_exponential(keys: list[NoiseKey], vocab_size: int, device: torch.device | str) -> torch.Tensor:
    """f32 [len(keys), vocab_size] Exp(1) draws, row i a function of keys[i] alone."""
    seeds = torch.tensor([k.seed for k in keys], dtype=torch.int64, device=device)
    positions = torch.tensor([k.position for k in keys], dtype=torch.int64, device=device)
    seeds = (seeds & _MASK) ^ ((seeds >> 32) & _MASK)
    ids = torch.arange(vocab_size, dtype=torch.int64, device=device)
    x = (seeds[:, None] * 0x9E3779B1 + (positions[:, None] & _MASK) * 0x85EBCA77 + ids[None, :] * 0xC2B2AE3D) & _MASK
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & _MASK
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & _MASK
    x ^= x >> 16
    u = ((x >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    return -torch.log(u)
