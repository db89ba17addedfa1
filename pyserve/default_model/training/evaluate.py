"""Held-out measurements for the model card: loss, perplexity, draft acceptance, adapter effect."""

from __future__ import annotations

import math

import numpy as np
import torch

EVAL_SEQ_LEN = 512
EVAL_WINDOWS = 64


def windows(stream: np.ndarray, seq_len: int = EVAL_SEQ_LEN, limit: int = EVAL_WINDOWS) -> torch.Tensor:
    """The first `limit` non-overlapping windows of the stream (fewer if it is short)."""
    n = min(limit, len(stream) // seq_len)
    return torch.from_numpy(stream[: n * seq_len].reshape(n, seq_len).astype(np.int64))


@torch.no_grad()
def mean_loss(model, batches: torch.Tensor, batch_size: int = 8) -> float:
    """Mean next-token cross-entropy (nats) over every predicted position."""
    total, count = 0.0, 0
    for chunk in batches.split(batch_size):
        logits = model(input_ids=chunk).logits[:, :-1].float()
        target = chunk[:, 1:]
        total += float(torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="sum"))
        count += target.numel()
    return total / count


@torch.no_grad()
def draft_acceptance(target, draft, batches: torch.Tensor, batch_size: int = 8) -> dict:
    """Per position of held-out text: how often the draft's greedy token is the target's (the
    acceptance rate of greedy speculation), and the mean of sum_x min(p(x), q(x)) (the chance
    that exact rejection sampling accepts a draft token at temperature 1)."""
    agree, overlap, count = 0, 0.0, 0
    for chunk in batches.split(batch_size):
        p = target(input_ids=chunk).logits.float().softmax(-1)
        q = draft(input_ids=chunk).logits.float().softmax(-1)
        agree += int((p.argmax(-1) == q.argmax(-1)).sum())
        overlap += float(torch.minimum(p, q).sum(-1).sum())
        count += chunk.numel()
    return {"greedy": round(agree / count, 4), "temperature_1": round(overlap / count, 4)}


def loss_report(loss: float) -> dict:
    return {"loss": round(loss, 4), "perplexity": round(math.exp(loss), 2)}


@torch.no_grad()
def greedy_text(model, tok, prompt: str, stop_ids: list[int], max_new_tokens: int = 96) -> str:
    """Greedy continuation of a rendered prompt, decoded without the stop token."""
    ids = torch.tensor([tok.encode(prompt, add_special_tokens=False).ids])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=stop_ids, pad_token_id=stop_ids[0])
    new = [t for t in out[0, ids.shape[1]:].tolist() if t not in stop_ids]
    return tok.decode(new)
