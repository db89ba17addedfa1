"""Applies a step's grammar masks (structured.matchers.TokenMasks) to its logits, in place:
disallowed tokens get -inf, so every sampling path (greedy, sampled, verification) draws only
tokens the grammar allows. Logprobs are then those of the masked distribution, as in vLLM."""

from __future__ import annotations

import torch

_NEG_INF = float("-inf")


def apply_token_masks(logits: torch.Tensor, masks) -> None:
    """`logits` [N, V]; `masks`: rows (int64 [M]) and bits (int32 [M, ceil(V / 32)])."""
    dev = logits.device
    rows = torch.from_numpy(masks.rows).to(dev, non_blocking=True)
    bits = torch.from_numpy(masks.bits).to(dev, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=dev)
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).reshape(len(bits), -1)[:, : logits.shape[1]]
    logits[rows] = logits[rows].masked_fill_(allowed == 0, _NEG_INF)
