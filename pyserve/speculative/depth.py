"""Adaptive speculation depth: how many draft tokens each decoding request verifies this step.

Guessing k tokens pays when widening the step is cheap (small batches: decode is memory-bound,
or overhead-bound on a CPU) and the guesses are good; at a large batch every verified token costs
nearly as much as a generated one and speculation must switch itself off. So the controller
measures instead of assuming, separately for each batch-size bucket (powers of two):

- the cost of a step that verifies no draft, a weighted mean a0 over recent such steps;
- the cost of a step that verifies drafts as a line in their number, seconds = a + b * drafts,
  fitted by exponentially weighted least squares over recent decode-only steps with drafts. Its
  intercept a is not a0: verification has a fixed cost of its own. When those steps all had
  about the same number (a long run at one depth) the line keeps the last slope fitted, through
  their mean; before any slope, the line through a0 and their mean;
- a proposal's cost as a line in its depth, seconds = c + d * k (zero for n-gram lookup): a
  draft model's proposal has a fixed part (the interpreter around it, feeding the draft the
  tokens accepted since its last proposal) and a part per guess; charging the fixed part to
  each guess would make small depths look dearer than they are, and lower the depth step by
  step to 0;
- globally: alpha, the chance a draft token is accepted given the ones before it were (a
  truncated geometric: accepted / (accepted + rejections), with a prior), and the fraction of
  requested drafts a proposer actually returns (n-gram lookup finds no match for some requests).

A new bucket is explored first, cheapest first: some steps at depth 0, some at half depth, then
some at full depth only where guesses always kept would pay by what
the first two measured (a large batch, whose first steps at full depth would cost more than its
whole short run gains, stops exploring there). A new bucket larger than one where such guesses
were found not to pay is not explored at all: it stays at depth 0 (a larger batch's step is
never widened more cheaply, relatively, than a smaller one's). Then k in 0..max_k maximises
expected tokens per second for B requests of which C may speculate: B / a0 at k = 0, else
(B + C * fill * (alpha + ... + alpha^k)) / (a + b * C * k * fill + c + d * k).
Depth 0 is interrupted every PROBE_EVERY steps by a probe that re-measures alpha (acceptance
moves with the text: a stretch of hard tokens must not switch speculation off for good), where
speculating would pay if guesses were good (PROBE_ACCEPTANCE; not at large batches): depth 1
for n-gram lookup, half the full depth for a draft model, whose probe has fixed costs (the draft
catches up on the tokens since it last ran; the verification) that buy more trials so. A probe
whose guesses were kept that often is followed by another at once.
A verdict is never final: the first step of each shape (draft count) a bucket sees is a warm-up,
not measured (a first run allocates, a draft model's first proposal at a depth is slow), and a
bucket found priced out explores again after RECHECK_FIRST probe intervals, then after twice as
many each time it is found so again (up to RECHECK_MOST): costs measured on a cold process must
not switch speculation off for good. Rechecks after the first also wait until the bucket's steps
without drafts since the last one took 1 / RECHECK_SHARE times what it cost (its steps' time over
a0, its proposals' with their catch-up): at a large batch a recheck costs many plain steps (an
EAGLE head catching up on every request's tokens, steps of several rows a request: ~0.2 s, some
25 plain steps, for 64 requests on the embedded model), and it must not cost the batch more than
that share of its time.
No torch here: the EngineCore calls it between steps.
"""

from __future__ import annotations

DECAY = 0.97  # weight of the past per observation: about the last 30 count
EXPLORE_STEPS = 4  # per new bucket: steps at depth 0, then as many at half depth and at full depth
PRIOR_ACCEPTANCE, PRIOR_WEIGHT = 0.7, 2.0  # pseudo-counts: two early rejections must not end it
PROBE_EVERY = 16  # steps at depth 0 before a probe
PROBE_ACCEPTANCE = 0.9  # a probe is made where guesses accepted this often would pay
SPECULATE_MARGIN = 1.10  # predicted speed-up needed to leave depth 0
RECHECK_FIRST, RECHECK_MOST = 8, 128  # probe intervals a priced-out bucket waits before exploring again
RECHECK_SHARE = 0.01  # the most of a priced-out bucket's time its rechecks may cost
EXPLORE_NODE_PRICE = 0.2  # a token tree's price per draft off its chain before a row's cost is measured


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

    def means(self) -> tuple[float, float]:
        """(mean x, mean y) of the recent observations (weighted); (0, 0) before any."""
        return (self.sx / self.w, self.sy / self.w) if self.w else (0.0, 0.0)


class Bucket:
    """What the controller knows about steps of one batch-size range."""

    def __init__(self) -> None:
        self.plain_seconds = self.plain_weight = 0.0  # steps without drafts: weighted sums
        self.spec = LinearFit()  # steps with drafts: x = draft tokens verified, y = seconds
        self.slope: float | None = None  # the last slope fitted to them
        self.draft = LinearFit()  # proposals: x = depth, y = seconds
        self.choices = 0
        # Even guesses kept PROBE_ACCEPTANCE of the time would not pay here: measured by this
        # bucket's exploration and probes, or inherited by a new bucket from a smaller one.
        self.priced_out = False
        self.warm: set[int] = set()  # draft counts of steps seen (a shape's first step is not measured)
        self.recheck_every, self.waited = RECHECK_FIRST, 0  # in probe intervals
        self.rechecks = 0
        # Since the last recheck began: what its exploring steps cost over plain ones (speculation
        # chosen because it pays is not counted), and the seconds of steps without drafts.
        self.spent = self.plain_since = 0.0

    def recheck_due(self) -> bool:
        """Counts a probe interval of a priced-out bucket; True (and the next wait doubled) when
        it should explore again."""
        self.waited += 1
        if self.waited < self.recheck_every or (self.rechecks and self.plain_since * RECHECK_SHARE < self.spent):
            return False
        self.waited, self.recheck_every = 0, min(2 * self.recheck_every, RECHECK_MOST)
        return True

    def explore_again(self) -> None:
        """Forgets the step and proposal costs measured with drafts; exploration resumes at half depth."""
        self.spec, self.draft, self.slope = LinearFit(), LinearFit(), None
        self.choices, self.priced_out = EXPLORE_STEPS, False
        self.rechecks += 1
        self.spent = self.plain_since = 0.0

    def exploring(self, max_k: int) -> int | None:
        """The depth to try while the bucket is new, else None: 0 until a step without drafts was
        timed, half depth until one with drafts was, then full depth (the controller checks that
        it could pay)."""
        if self.choices < EXPLORE_STEPS or not self.plain_weight:
            return 0
        if self.choices < 2 * EXPLORE_STEPS or not self.spec.count:
            return max(1, max_k // 2)
        if self.choices < 3 * EXPLORE_STEPS:
            return max_k
        return None

    @property
    def explored(self) -> bool:
        """Whether the bucket's last choice was made after its exploration."""
        return self.exploring(1) is None  # its end does not depend on the depth

    def observe_step(self, drafts: int, seconds: float) -> None:
        if not drafts:
            self.plain_since += seconds
        elif not self.explored:
            self.spent += max(0.0, seconds - self.plain())
        if drafts not in self.warm:
            self.warm.add(drafts)
            return
        if drafts:
            self.spec.add(float(drafts), seconds)
        else:
            self.plain_seconds = DECAY * self.plain_seconds + seconds
            self.plain_weight = DECAY * self.plain_weight + 1.0

    def plain(self) -> float:
        """a0: a step's seconds without drafts (0 before any)."""
        return self.plain_seconds / self.plain_weight if self.plain_weight else 0.0

    def spec_line(self) -> tuple[float, float]:
        """(a, b) of a step's seconds with drafts; a is at least a0 (the same step with more
        rows never costs less: a lower intercept is the noise of a fit over few points)."""
        fit = self.spec.coefficients()
        if fit is not None:
            self.slope = fit[1]
            return max(fit[0], self.plain()), fit[1]
        mx, my = self.spec.means()
        slope = self.slope if self.slope is not None else max(0.0, (my - self.plain()) / mx)
        return max(0.0, self.plain(), my - slope * mx), slope

    def proposal_seconds(self, k: int) -> float:
        """A proposal of depth k: its fitted line, or while every proposal measured had the same
        depth, their mean cost per guess times k."""
        if k == 0 or not self.draft.count:
            return 0.0
        fit = self.draft.coefficients()
        if fit is not None:
            return fit[0] + fit[1] * k
        mk, mseconds = self.draft.means()
        return mseconds / mk * k


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
        self.probe_depth = max(1, max_k // 2) if has_draft_cost else 1
        self.probe: list[int] | None = None  # drafts kept and verified since the last probe was chosen

    def _bucket(self, batch_size: int) -> Bucket:
        key = bucket_of(batch_size)
        bucket = self.buckets.get(key)
        if bucket is None:
            bucket = self.buckets[key] = Bucket()
        return bucket

    def observe_step(self, batch_size: int, num_draft_tokens: int, seconds: float) -> None:
        """A decode-only step of `batch_size` requests that verified `num_draft_tokens` drafts."""
        self._bucket(batch_size).observe_step(num_draft_tokens, seconds)

    def charge(self, batch_size: int, seconds: float) -> None:
        """A proposal for a step of `batch_size` requests took `seconds`, catching up included
        (what rechecks count while exploring; observe_proposal's seconds leave the catching up out)."""
        bucket = self._bucket(batch_size)
        if not bucket.explored:
            bucket.spent += seconds

    def observe_proposal(self, batch_size: int, k: int, num_proposed: int, seconds: float) -> None:
        """A proposer asked for k drafts for each of `batch_size` requests returned
        `num_proposed` in all, in `seconds`."""
        self.proposed = DECAY * self.proposed + num_proposed
        self.requested = DECAY * self.requested + batch_size * k
        if self.has_draft_cost and k:
            self._bucket(batch_size).draft.add(float(k), seconds)

    def observe_verification(self, num_drafts: int, num_accepted: int) -> None:
        """One request's verification: `num_accepted` of its `num_drafts` drafts were kept."""
        rejected = 1 if num_accepted < num_drafts else 0
        self.accepted = DECAY * self.accepted + num_accepted
        self.trials = DECAY * self.trials + num_accepted + rejected
        if self.probe is not None:
            self.probe[0] += num_accepted
            self.probe[1] += num_drafts

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
        if bucket.choices == 1 and self._priced_out_below(batch_size):
            bucket.priced_out = True  # inherited: this bucket is never explored
        if bucket.priced_out and not bucket.spec.count:
            self.steps_off, self.probe = self.steps_off + 1, None
            return 0
        k = bucket.exploring(self.max_k)
        # Full depth is tried unless even perfect guesses would not pay by the half-depth steps'
        # costs: those charge a verification's and a proposal's fixed costs to each guess, so
        # they overprice a deeper guess (guesses kept PROBE_ACCEPTANCE of the time, charged so,
        # priced a depth of 4 out where it ran 1.6x).
        if k == self.max_k and bucket.spec.count and not self._best_depth(batch_size, num_candidates, bucket, 1.0):
            bucket.priced_out = True
            k = None  # even perfect guesses would not pay here: exploring ends
        explored = k is None
        if explored:
            k = self._best_depth(batch_size, num_candidates, bucket, self.acceptance)
        self.steps_off = self.steps_off + 1 if k == 0 else 0
        kept, verified = self.probe if self.probe is not None else (0, 0)
        self.probe = None
        # A probe whose guesses were kept as often as PROBE_ACCEPTANCE is followed by another at
        # once: the estimate recovers from a hard stretch in a few steps, not a few probe
        # intervals (and guesses that good only now and then do not keep it probing).
        if k == 0 and (self.steps_off > PROBE_EVERY or (verified and kept >= PROBE_ACCEPTANCE * verified)):
            self.steps_off = 0
            # Only where guesses that good would pay at this batch size: a probe of a large
            # batch costs more than any acceptance could win back.
            if explored:
                bucket.priced_out = not self._best_depth(batch_size, num_candidates, bucket, PROBE_ACCEPTANCE)
                if not bucket.priced_out:
                    self.probe = [0, 0]
                    return self.probe_depth
                if bucket.recheck_due():
                    bucket.explore_again()
                    return max(1, self.max_k // 2)
        return k

    def node_price(self, batch_size: int, num_candidates: int, k: int) -> float:
        """The chance of being kept a draft of a token tree off its chain must have to pay for its
        row: a verified draft adds b seconds to the step (the fitted slope) and a draft kept with
        chance w adds w tokens, so it pays where w > b * (tokens per second of the step at depth
        k). EXPLORE_NODE_PRICE until the bucket has a slope."""
        bucket = self._bucket(batch_size)
        if not bucket.spec.count:
            return EXPLORE_NODE_PRICE
        a, b = bucket.spec_line()
        alpha = min(self.acceptance, 0.999)
        extra = (1.0 - alpha ** (k + 1)) / (1.0 - alpha) - 1.0
        tokens = batch_size + num_candidates * self.fill * extra
        seconds = a + b * num_candidates * k * self.fill + bucket.proposal_seconds(k)
        return min(1.0, b * tokens / seconds) if seconds > 0 else EXPLORE_NODE_PRICE

    def _priced_out_below(self, batch_size: int) -> bool:
        """Whether a smaller batch-size bucket found that even guesses kept PROBE_ACCEPTANCE of the
        time would not pay: verifying k guesses a request costs a larger batch at least as large a
        share of its step, so neither would they here."""
        key = bucket_of(batch_size)
        return any(b.priced_out for k, b in self.buckets.items() if k < key)

    def _best_depth(self, batch_size: int, num_candidates: int, bucket: Bucket, acceptance: float) -> int:
        a, b = bucket.spec_line()
        alpha = min(acceptance, 0.999)
        fill = self.fill
        best_k, best_rate = 0, batch_size / bucket.plain() if bucket.plain() > 0 else float("inf")
        for k in range(1, self.max_k + 1):
            extra = (1.0 - alpha ** (k + 1)) / (1.0 - alpha) - 1.0  # accepted drafts per request
            tokens = batch_size + num_candidates * fill * extra
            seconds = a + b * num_candidates * k * fill + bucket.proposal_seconds(k)
            rate = tokens / seconds if seconds > 0 else float("inf")
            # Speculating at all must promise a clear gain (the fit is noisy: a busy server must
            # not pay for a guess), and each longer guess a further one.
            if rate > best_rate * (SPECULATE_MARGIN if best_k == 0 else 1.03):
                best_k, best_rate = k, rate
        return best_k
