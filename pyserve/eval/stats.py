"""The eval's statistics: a confidence interval of a mean score (Wilson's for pass/fail scores,
whose bootstrap collapses to a point when every item passed or every item failed; a percentile
bootstrap otherwise), and the Pareto frontier of configurations (no other one is at least as
good on every axis and better on one)."""

from __future__ import annotations

from collections.abc import Sequence

import math

import numpy as np

BOOTSTRAP_RESAMPLES = 2000
Z_95 = 1.959963984540054  # the standard normal's 97.5th percentile


def mean_ci(values: Sequence[float]) -> tuple[float, float, float]:
    """(mean, low, high), 95%: Wilson's score interval when every value is 0 or 1 (pass@1),
    else `bootstrap_ci`."""
    if len(values) and all(v in (0.0, 1.0) for v in values):
        return wilson_ci(int(sum(values)), len(values))
    return bootstrap_ci(values)


def wilson_ci(successes: int, n: int, z: float = Z_95) -> tuple[float, float, float]:
    """(share, low, high): Wilson's score interval of a binomial share."""
    p = successes / n
    center = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return p, min(p, max(0.0, center - half)), max(p, min(1.0, center + half))  # rounding kept off p's wrong side


def bootstrap_ci(values: Sequence[float], confidence: float = 0.95, resamples: int = BOOTSTRAP_RESAMPLES,
                 seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high): the percentile bootstrap interval of the mean, `resamples` resamples
    drawn with a fixed seed (the same values give the same interval)."""
    data = np.asarray(values, dtype=np.float64)
    if data.size == 0:
        raise ValueError("no values to bootstrap")
    rng = np.random.default_rng(seed)
    means = data[rng.integers(0, data.size, size=(resamples, data.size))].mean(axis=1)
    tail = (1.0 - confidence) / 2
    low, high = np.quantile(means, [tail, 1.0 - tail])
    return float(data.mean()), float(low), float(high)


def pareto_frontier(points: Sequence[dict[str, float]], maximize: Sequence[str] = (),
                    minimize: Sequence[str] = ()) -> list[int]:
    """Indices of the points no other point dominates on the given axes, in input order."""
    def dominates(a: dict[str, float], b: dict[str, float]) -> bool:
        no_worse = all(a[k] >= b[k] for k in maximize) and all(a[k] <= b[k] for k in minimize)
        better = any(a[k] > b[k] for k in maximize) or any(a[k] < b[k] for k in minimize)
        return no_worse and better

    return [i for i, p in enumerate(points) if not any(dominates(q, p) for j, q in enumerate(points) if j != i)]


def quality_per_dollar_second(quality: float, dollars_per_item: float, seconds_per_item: float) -> float:
    """Quality bought per dollar and per second of waiting: quality / (cost of an item x its
    end-to-end latency); infinite when either is zero."""
    denominator = dollars_per_item * seconds_per_item
    return float("inf") if denominator <= 0 else quality / denominator


def dollars_per_million_tokens(device_seconds: float, output_tokens: int, price_per_hour: float) -> float:
    """Cost of 1M output tokens: the device-seconds measured for `output_tokens`, priced per hour."""
    if output_tokens <= 0:
        return float("inf")
    return device_seconds / 3600.0 * price_per_hour / output_tokens * 1e6
