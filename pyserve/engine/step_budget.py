"""The token budget of each step, chosen so that running streams keep an inter-token target.

A step's cost is a curve in the tokens it schedules, fitted to the worker's measured seconds per
step. Observations are kept per power-of-two bucket of token counts, each an exponentially
weighted mean of (tokens, seconds), so steps of every size keep their say: in one exponentially
weighted line (like the speculative DepthController's, whose steps vary little) a stream's long
run of one-token steps would soon drown the few prompt steps that measure the slope. The curve is
piecewise linear through the bucket means (made non-decreasing) and goes on past the largest
with the slope of its last segment. On a CPU a step's cost is far from one line (a fixed cost
per step, cheaper tokens in mid-sized steps, dearer ones in long prompts), so the budget is read
off the curve where it crosses the target, between the two sizes measured nearest to it; steps
taken there refine exactly that stretch.

The budget of the next step is the token count whose predicted forward takes the target, within
[0, max_tokens]. The scheduler gives the decodes their tokens first and prompts the rest (at
least a block), and ignores the budget while nothing decodes, so a lone prompt is never slowed.
Before two buckets have data there is no budget (None: the fixed max_num_batched_tokens). No
torch here: the EngineCore calls it around each step.
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

    def next_budget(self) -> int | None:
        """Tokens for the next step (decodes and prompts together), or None (no fit yet)."""
        points = sorted((tokens / w, seconds / w) for w, tokens, seconds in self.buckets.values())
        if len(points) < 2:
            return None
        curve, top = [], 0.0
        for x, y in points:
            top = max(top, y)
            curve.append((x, top))
        if curve[0][1] >= self.target:
            return 0
        segments = list(zip(curve, curve[1:]))
        (x0, y0), (x1, y1) = next(((p, q) for p, q in segments if q[1] > self.target), segments[-1])
        if y1 <= y0:  # past the largest size measured, a cost that does not grow
            return self.max_tokens
        return round(min(self.max_tokens, x0 + (self.target - y0) * (x1 - x0) / (y1 - y0)))
