"""A token's alternatives as the responses list them."""

from __future__ import annotations

# Alternatives whose logprob is below this are tokens a grammar masked out (their logits got
# model.token_masks.BANNED): they are left out of top_logprobs, never offered as choices.
MASKED = -1e30


def best(entry: dict, k: int) -> list[tuple[int, object]]:
    """The `k` likeliest (token id, Logprob) pairs of `entry`, masked tokens left out."""
    return [(t, e) for t, e in sorted(entry.items(), key=lambda kv: -kv[1].logprob) if e.logprob > MASKED][:k]
