"""Applies a step's grammar masks (structured.matchers.TokenMasks) to its logits, in place:
each disallowed token's logit gets BANNED added, so every sampling path (greedy, sampled,
verification) draws only tokens the grammar allows. Logprobs are then those of the masked
distribution, as in vLLM.

BANNED is near float32's lowest rather than -inf: adding a finite 0 / BANNED row is 4x cheaper
on a CPU than writing -inf (torch's -inf fills and wheres run ~0.5 ms for 32 rows of a 4k
vocabulary here), and exp() of it is 0 all the same. The bits arrive on the host: a CPU step
unpacks them there (numpy); a GPU step copies the packed words (32x fewer bytes) and unpacks
them on the device.
"""

from __future__ import annotations

import numpy as np
import torch

BANNED = -3e38


def apply_token_masks(logits: torch.Tensor, masks) -> None:
    """`logits` [N, V] (half precision ones get -inf, BANNED rounded); `masks`: rows (int64 [M])
    and bits (int32 [M, ceil(V / 32)])."""
    dev, vocab = logits.device, logits.shape[1]
    if dev.type == "cpu":
        allowed = torch.from_numpy(np.unpackbits(masks.bits.view(np.uint8), axis=1, count=vocab, bitorder="little"))
    else:
        packed = torch.from_numpy(masks.bits).to(dev, non_blocking=True)
        shifts = torch.arange(32, dtype=torch.int32, device=dev)
        allowed = ((packed.unsqueeze(-1) >> shifts) & 1).reshape(len(packed), -1)[:, :vocab]
    bias = allowed.to(torch.float32).sub_(1).mul_(-BANNED)
    if len(masks.rows) == len(logits):
        logits.add_(bias)  # every row is constrained, in order (the rows of one step are distinct and sorted)
    else:
        logits.index_add_(0, torch.from_numpy(masks.rows).to(dev, non_blocking=True), bias)
