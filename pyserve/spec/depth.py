"""Adaptive speculation depth: how many draft tokens each decoding request verifies this step.

Guessing k tokens pays when the step is cheap to widen (small batches: decode is memory-bound)
and the guesses are good; at a large batch the widened step costs nearly (1 + k) times more and
speculation must switch itself off. So the controller measures instead of assuming:

- acceptance: alpha, the chance a draft token is accepted given that the ones before it were,
  estimated from the accepted counts of recent steps (a truncated geometric: alpha = accepted /
  (accepted + rejections));
- the target step's cost as a line, seconds = a + b * tokens, fitted by exponentially weighted
  least squares over recent steps of varied size;
- the draft's cost per proposal forward, seconds = c + d * batch, fitted the same way (zero for
  n-gram lookup).

It picks k in 0..max_k maximising expected tokens per second for a batch of B decoding requests:
B * (1 - alpha^(k+1)) / (1 - alpha)  /  (a + b * (other + B * (1 + k)) + k * (c + d * B)).
No torch here: the EngineCore calls it between steps.
"""

from __future__ import annotations

DECAY = 0.97  # weight of the past per observation: about the last 30 steps count
MIN_OBSERVATIONS = 8


class LinearFit:
    """y = a + b * x by exponentially weighted least squares; b and a are clamped at >= 0."""

    def __init__(self) -> None:
        self.w = self.sx = self.sy = self.sxx = self.sxy = 0.0
        self.count = 0

    def add(self, x: float, y: float) -> None:
        d = DECAY
        self.w = d * self.w + 1.0
        self.sx = d * self.sx + x
        self.sy = d * self.sy + y
        self.sxx = d * self.sxx + x * x
        self.sxy = d * self.sxy + x * y
        self.count += 1

    def coefficients(self) -> tuple[float, float] | None:
        """(a, b), or None until enough observations with different x exist."""
        if self.count < MIN_OBSERVATIONS:
            return None
        mx, my = self.sx / self.w, self.sy / self.w
        var = self.sxx / self.w - mx * mx
        if var <= 1e-9 * max(1.0, mx * mx):
            return None
        b = max(0.0, (self.sxy / self.w - mx * my) / var)
        return max(0.0, my - b * mx), b


class DepthController:
    def __init__(self, max_k: int, adaptive: bool = True, has_draft_cost: bool = False):
        self.max_k = max_k
        self.adaptive = adaptive
        self.has_draft_cost = has_draft_cost
        self.step_cost = LinearFit()
        self.draft_cost = LinearFit()
        self.accepted = 0.0  # exponentially weighted counts
        self.trials = 0.0

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        self.step_cost.add(float(num_tokens), seconds)

    def observe_draft_forward(self, batch_size: int, seconds: float) -> None:
        self.draft_cost.add(float(batch_size), seconds)

    def observe_verification(self, num_drafts: int, num_accepted: int) -> None:
        """One request's verification: `num_accepted` of its `num_drafts` drafts were kept."""
        rejected = 1 if num_accepted < num_drafts else 0
        self.accepted = DECAY * self.accepted + num_accepted
        self.trials = DECAY * self.trials + num_accepted + rejected

    @property
    def acceptance(self) -> float:
        """alpha; optimistic (0.8) before any verification."""
        return self.accepted / self.trials if self.trials > 0 else 0.8

    def choose(self, batch_size: int, other_tokens: int = 0) -> int:
        """k for each of `batch_size` decoding requests, next to `other_tokens` prefill tokens."""
        if not self.adaptive or batch_size == 0:
            return self.max_k if batch_size else 0
        step = self.step_cost.coefficients()
        if step is None:
            return self.max_k  # measure first: varied step sizes come with varied k
        a, b = step
        c, d = (self.draft_cost.coefficients() or (0.0, 0.0)) if self.has_draft_cost else (0.0, 0.0)
        alpha = min(self.acceptance, 0.999)
        best_k, best_rate = 0, 0.0
        for k in range(self.max_k + 1):
            tokens = (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
            seconds = a + b * (other_tokens + batch_size * (1 + k)) + k * (c + d * batch_size)
            rate = tokens / seconds if seconds > 0 else float("inf")
            if rate > best_rate * 1.02 or k == 0:  # a longer guess must be clearly better
                best_k, best_rate = k, rate
        return best_k
