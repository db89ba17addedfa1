"""A similarity threshold calibrated to an error bound: the lowest threshold at which the upper
end of a one-sided Clopper-Pearson interval (confidence 95%) on the share of non-equivalent pairs
that would hit stays under the bound. The bound is computed exactly from the binomial
distribution by bisection (a few lines; scipy would be a dependency for one quantile)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def binomial_upper_bound(errors: int, trials: int, confidence: float = 0.95) -> float:
    """The p at which P(X <= errors | trials, p) = 1 - confidence (1.0 when errors == trials)."""
    if trials == 0 or errors >= trials:
        return 1.0
    tail = 1.0 - confidence

    def cdf(p: float) -> float:
        return sum(math.comb(trials, k) * p ** k * (1 - p) ** (trials - k) for k in range(errors + 1))

    lo, hi = errors / trials, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if cdf(mid) > tail:
            lo = mid
        else:
            hi = mid
    return hi


def calibrate(negatives: Sequence[float], error_bound: float, confidence: float = 0.95) -> float | None:
    """The lowest threshold (one of the negatives' similarities, nudged up, or below them all)
    whose wrong-hit share among `negatives` has its upper bound under `error_bound`; None when
    there are too few negatives for any threshold to prove the bound."""
    ordered = sorted(negatives, reverse=True)
    n = len(ordered)
    best = None
    for errors in range(n + 1):  # threshold just above the errors-th highest negative
        if binomial_upper_bound(errors, n, confidence) > error_bound:
            break
        best = math.nextafter(ordered[errors], math.inf) if errors < n else -1.0
    return best
