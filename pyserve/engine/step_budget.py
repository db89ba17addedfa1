"""The token budget of each step, chosen so that running streams keep an inter-token target.

A step's cost is modelled as a line in the tokens it schedules, seconds = a + b * tokens, fitted
to the worker's measured seconds per step. Steps of very different sizes must all keep their say
in the slope: in a plain exponentially weighted fit (like the speculative DepthController's, whose
steps vary little), a stream's long run of one-token steps would soon drown the few prompt steps
that measure the slope. So observations are kept per power-of-two bucket of token counts, each an
exponentially weighted mean of (tokens, seconds), and the line is the least-squares fit through
the bucket means, one point per bucket.

The budget of the next step is the token count whose predicted forward takes the target,
(target - a) / b, within [0, max_tokens]. The scheduler gives the decodes their tokens first and
prompts the rest (at least a block), and ignores the budget while nothing decodes, so a lone
prompt is never slowed. Before two buckets have data there is no budget (None: the fixed
max_num_batched_tokens). No torch here: the EngineCore calls it around each step.
"""

from __future__ import annotations

import math

DECAY = 0.8  # weight of a bucket's past at each new observation in it: about the last 5 count


class StepBudget:
    def __init__(self, target_seconds: float, max_tokens: int):
        if not (math.isfinite(target_seconds) and target_seconds > 0):
            raise ValueError(f"max_inter_token_latency must be a positive number of seconds, got {target_seconds}")
        self.target = target_seconds
        self.max_tokens = max_tokens
        self.buckets: dict[int, list[float]] = {}  # bit length of the token count -> [weight, tokens, seconds]

    def observe(self, num_tokens: int, seconds: float) -> None:
        """A step that scheduled `num_tokens` tokens and whose forward took `seconds`."""
        if num_tokens <= 0:
            return
        bucket = self.buckets.setdefault(num_tokens.bit_length(), [0.0, 0.0, 0.0])
        bucket[0] = DECAY * bucket[0] + 1.0
        bucket[1] = DECAY * bucket[1] + num_tokens
        bucket[2] = DECAY * bucket[2] + seconds

    def cost(self) -> tuple[float, float] | None:
        """(a, b) of seconds = a + b * tokens, a >= 0; None before two buckets have data or while
        the fitted slope is not positive."""
        points = [(tokens / w, seconds / w) for w, tokens, seconds in self.buckets.values()]
        if len(points) < 2:
            return None
        mx = sum(x for x, _ in points) / len(points)
        my = sum(y for _, y in points) / len(points)
        covariance = sum((x - mx) * (y - my) for x, y in points)
        if covariance <= 0:
            return None
        b = covariance / sum((x - mx) ** 2 for x, _ in points)
        return max(0.0, my - b * mx), b

    def next_budget(self) -> int | None:
        """Tokens for the next step (decodes and prompts together), or None (no fit yet)."""
        fit = self.cost()
        if fit is None:
            return None
        a, b = fit
        return round(min(self.max_tokens, max(0.0, (self.target - a) / b)))
