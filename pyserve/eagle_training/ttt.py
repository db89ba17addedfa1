"""The head unrolled over a whole sequence as it drafts while serving ("training-time test").

Step 0 is the head on real features: pair i is (the target's features at i, token i + 1), and
predicts the target's next token after i + 1. Step j (j >= 1) is the head's j-th draft step: pair
i reads the head's own step j - 1 output at i - 1 in place of features (real features end at
i - j), with the true token i + 1 (the case that matters: the guesses before it were right). Its
attention sees what the paged cache holds while drafting: the real pairs' keys up to i - j, then
the keys its own steps 1..j wrote at positions i - j + 1 .. i (step s's key of row i - (j - s)).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pyserve.speculative.eagle_head import EagleHead


def _shifted(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x moved down by `rows` rows (row i holds x[i - rows]; the first rows are zeros)."""
    if rows == 0:
        return x
    return torch.cat([x.new_zeros((rows, *x.shape[1:])), x[:-rows]])


def unrolled(head: EagleHead, embeds: torch.Tensor, features: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The head's output [m, H] at every pair for draft steps 0..steps-1; `embeds` [m, H] the
    target's embedding of each pair's token, `features` [m, 3 * H_target]. Row i of step j is
    meaningful for i >= j."""
    layer = head.midlayer
    attn = layer.self_attn
    m = len(embeds)
    rope = head.rotary.tables(torch.arange(m, device=embeds.device))
    rep = attn.num_heads // attn.num_kv_heads
    row = torch.arange(m, device=embeds.device)
    hidden = head.fc(features)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    outputs = []
    for j in range(steps):
        q, k, v = attn.qkv(layer.attention_input(embeds, hidden), rope)
        keys.append(k.repeat_interleave(rep, dim=1))
        values.append(v.repeat_interleave(rep, dim=1))
        scores = torch.einsum("ihd,khd->hik", q, keys[0]) * attn.scale  # [heads, m, m]
        scores = scores.masked_fill(row[None, :] > row[:, None] - j, float("-inf"))
        diagonal_keys = [_shifted(keys[s], j - s) for s in range(1, j + 1)]
        diagonal = [(q * ks).sum(-1).T[..., None] * attn.scale for ks in diagonal_keys]  # [heads, m, 1] each
        probs = torch.cat([scores, *diagonal], dim=-1).softmax(dim=-1)
        out = torch.einsum("hik,khd->ihd", probs[..., :m], values[0])
        for s in range(1, j + 1):
            out = out + probs[..., m + s - 1].T[..., None] * _shifted(values[s], j - s)
        result = layer.finish(hidden, out.reshape(m, -1))
        outputs.append(result)
        hidden = _shifted(result, 1)
    return outputs


def sequence_loss(head: EagleHead, embeds: torch.Tensor, features: torch.Tensor, labels: torch.Tensor,
                  steps: int, decay: float = 0.8) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """(the loss: cross-entropy against the target's next token, step j weighted decay**j; per
    step (rows whose label the head can say, of them predicted right)). `labels` are draft ids,
    -100 where the target's token is outside the head's vocabulary."""
    total = features.new_zeros(())
    counts = []
    for j, out in enumerate(unrolled(head, embeds, features, steps)):
        logits = head.draft_logits(out[j:])
        target = labels[j:]
        known = target >= 0
        if known.any():
            total = total + decay**j * F.cross_entropy(logits[known], target[known])
        counts.append((int(known.sum()), int((logits.argmax(-1)[known] == target[known]).sum())))
    return total, counts


@torch.no_grad()
def accepted_lengths(head: EagleHead, embeds: torch.Tensor, features: torch.Tensor, labels: torch.Tensor,
                     steps: int) -> torch.Tensor:
    """For every start i (the real features end at pair i): how many of the head's chained
    guesses from there a greedy verification would keep (0..steps)."""
    m = len(labels)
    right = torch.zeros((steps, m), dtype=torch.bool)
    for j, out in enumerate(unrolled(head, embeds, features, steps)):
        right[j, j:] = head.draft_logits(out[j:]).argmax(-1) == labels[j:]
    starts = m - steps + 1
    if starts <= 0:
        return torch.zeros(0, dtype=torch.int64)
    chain = torch.stack([right[j, j : j + starts] for j in range(steps)])  # [steps, starts]: guess j from start i
    return chain.to(torch.int64).cumprod(dim=0).sum(dim=0)
