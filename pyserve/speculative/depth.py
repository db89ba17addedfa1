"""Adaptive speculation depth: how many draft tokens each decoding request verifies this step.

Guessing k tokens pays when widening the step is cheap (small batches: decode is memory-bound,
or overhead-bound on a CPU) and the guesses are good; at a large batch every verified token costs
nearly as much as a generated one and speculation must switch itself off. So the controller
measures instead of assuming, separately for each batch-size bucket (powers of two):

- the step's cost as a line in the number of draft tokens it verifies, seconds = a + b * drafts,
  fitted by exponentially weighted least squares over recent decode-only steps;
- the draft's cost per proposal forward (zero for n-gram lookup), a weighted mean;
- globally: alpha, the chance a draft token is accepted given the ones before it were (a
  truncated geometric: accepted / (accepted + rejections), with a prior), and the fraction of
  requested drafts a proposer actually returns (n-gram lookup finds no match for some requests).

A new bucket is explored first (some steps at full depth, some at depth 0), then k in 0..max_k
maximises expected tokens per second for B requests of which C may speculate,
(B + C * fill * (alpha + ... + alpha^k)) / (a + b * C * k * fill + k * draft_forward). Depth 0 is interrupted now and then by depth 1 to re-measure alpha (n-gram lookup only).
No torch here: the EngineCore calls it between steps.
"""

from __future__ import annotations

DECAY = 0.97  # weight of the past per observation: about the last 30 count
EXPLORE_STEPS = 4  # per new bucket: steps at full depth, then as many at depth 0
PRIOR_ACCEPTANCE, PRIOR_WEIGHT = 0.7, 2.0  # pseudo-counts: two early rejections must not end it
PROBE_EVERY = 16  # steps at depth 0 before one step at depth 1
SPECULATE_MARGIN = 1.10  # predicted speed-up needed to leave depth 0


class LinearFit:
    """y = a + b * x by exponentially weighted least squares; a and b are clamped at >= 0."""

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
        """(a, b), or None while every observation had (nearly) the same x."""
        if self.count < 2:
            return None
        mx, my = self.sx / self.w, self.sy / self.w
        var = self.sxx / self.w - mx * mx
        if var <= 1e-9 * max(1.0, mx * mx):
            return None
        b = max(0.0, (self.sxy / self.w - mx * my) / var)
        return max(0.0, my - b * mx), b


class Bucket:
    """What the controller knows about steps of one batch-size range."""

    def __init__(self) -> None:
        self.step = LinearFit()  # x = draft tokens verified in the step
        self.draft_seconds = 0.0  # weighted mean seconds per proposal forward
        self.draft_weight = 0.0
        self.choices = 0

    def exploring(self, max_k: int) -> int | None:
        """The depth to try while the bucket is new, else None."""
        if self.choices < EXPLORE_STEPS:
            return max_k
        if self.choices < 2 * EXPLORE_STEPS or self.step.coefficients() is None:
            return 0
        return None


def bucket_of(batch_size: int) -> int:
    return batch_size.bit_length()


class DepthController:
    def __init__(self, max_k: int, adaptive: bool = True, has_draft_cost: bool = False):
        self.max_k = max_k
        self.adaptive = adaptive
        self.has_draft_cost = has_draft_cost
        self.buckets: dict[int, Bucket] = {}
        self.accepted = 0.0  # exponentially weighted counts
        self.trials = 0.0
        self.proposed = 0.0
        self.requested = 0.0
        self.steps_off = 0  # consecutive choices of depth 0

    def _bucket(self, batch_size: int) -> Bucket:
        return self.buckets.setdefault(bucket_of(batch_size), Bucket())

    def observe_step(self, batch_size: int, num_draft_tokens: int, seconds: float) -> None:
        """A decode-only step of `batch_size` requests that verified `num_draft_tokens` drafts."""
        self._bucket(batch_size).step.add(float(num_draft_tokens), seconds)

    def observe_proposal(self, batch_size: int, k: int, num_proposed: int, seconds: float) -> None:
        """A proposer asked for k drafts for each of `batch_size` requests returned
        `num_proposed` in all, in `seconds`."""
        self.proposed = DECAY * self.proposed + num_proposed
        self.requested = DECAY * self.requested + batch_size * k
        if self.has_draft_cost and k:
            b = self._bucket(batch_size)
            b.draft_seconds = DECAY * b.draft_seconds + seconds / k
            b.draft_weight = DECAY * b.draft_weight + 1.0

    def observe_verification(self, num_drafts: int, num_accepted: int) -> None:
        """One request's verification: `num_accepted` of its `num_drafts` drafts were kept."""
        rejected = 1 if num_accepted < num_drafts else 0
        self.accepted = DECAY * self.accepted + num_accepted
        self.trials = DECAY * self.trials + num_accepted + rejected

    @property
    def acceptance(self) -> float:
        """alpha, with a prior worth PRIOR_WEIGHT verifications of PRIOR_ACCEPTANCE."""
        return (self.accepted + PRIOR_ACCEPTANCE * PRIOR_WEIGHT) / (self.trials + PRIOR_WEIGHT)

    @property
    def fill(self) -> float:
        """The fraction of requested drafts proposers return (1 before any proposal)."""
        return self.proposed / self.requested if self.requested > 0 else 1.0

    def choose(self, batch_size: int, num_candidates: int) -> int:
        """k for each of `num_candidates` requests (those that may speculate) in a next step of
        `batch_size` requests."""
        if not self.adaptive or num_candidates == 0:
            return self.max_k if num_candidates else 0
        bucket = self._bucket(batch_size)
        bucket.choices += 1
        k = bucket.exploring(self.max_k)
        if k is None:
            k = self._best_depth(batch_size, num_candidates, bucket)
        self.steps_off = self.steps_off + 1 if k == 0 else 0
        # NOTE: no probes for draft models: their acceptance depends on the model pair more than
        # on the text, and a probe first catches the draft up on every token since it last ran.
        if self.steps_off > PROBE_EVERY and not self.has_draft_cost:
            self.steps_off = 0
            return 1
        return k

    def _best_depth(self, batch_size: int, num_candidates: int, bucket: Bucket) -> int:
        a, b = bucket.step.coefficients()
        draft = bucket.draft_seconds / bucket.draft_weight if bucket.draft_weight else 0.0
        alpha = min(self.acceptance, 0.999)
        fill = self.fill
        best_k, best_rate = 0, 0.0
        for k in range(self.max_k + 1):
            extra = (1.0 - alpha ** (k + 1)) / (1.0 - alpha) - 1.0  # accepted drafts per request
            tokens = batch_size + num_candidates * fill * extra
            seconds = a + b * num_candidates * k * fill + k * draft
            rate = tokens / seconds if seconds > 0 else float("inf")
            # Speculating at all must promise a clear gain (the fit is noisy: a busy server must
            # not pay for a guess), and each longer guess a further one.
            if k == 0 or rate > best_rate * (SPECULATE_MARGIN if best_k == 0 else 1.03):
                best_k, best_rate = k, rate
        return best_k
