"""Counter-based noise for seeded requests: the Exp(1) draws of the exponential race that picks
the token at index `position` of a request's sequence are a hash of (seed, position, token id),
not a stream. So a seeded request gets the same draws for the same token wherever its row sits,
whatever the batch, and however many tokens a step verifies or a draft model guessed: plain
sampling, speculative verification and the draft's guesses all read the same numbers.

The hash is kernels.keyed_noise's (the rejection kernel computes the same numbers in place);
the draw is -log(u).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pyserve.kernels.keyed_noise import keyed_exponential_rows


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
    return keyed_exponential_rows(seeds, positions, vocab_size)
