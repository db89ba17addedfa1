"""The bootstrap and Wilson intervals on fixed samples, the Pareto frontier on a constructed table, and the
cost and quality-per-dollar-second arithmetic."""

from __future__ import annotations

import math

import pytest

from pyserve.eval.stats import (bootstrap_ci, dollars_per_million_tokens, mean_ci, pareto_frontier,
                                quality_per_dollar_second, wilson_ci)


def test_bootstrap_interval_of_a_fixed_sample():
    values = [1.0] * 30 + [0.0] * 10
    mean, low, high = bootstrap_ci(values)
    assert mean == 0.75
    # the normal approximation's 95% interval is 0.75 +- 1.96 * sqrt(0.75 * 0.25 / 40) = [0.616, 0.884]
    assert 0.58 < low < 0.65 and 0.85 < high < 0.92
    assert bootstrap_ci(values) == (mean, low, high)  # seeded: the same every run
    assert bootstrap_ci([1.0, 1.0, 1.0]) == (1.0, 1.0, 1.0)
    narrow = bootstrap_ci(values * 10)
    assert narrow[2] - narrow[1] < (high - low) / 2.5
    with pytest.raises(ValueError):
        bootstrap_ci([])


def test_pass_fail_scores_get_wilsons_interval_which_stays_open_at_all_or_nothing():
    # Wilson's 95% interval of 8 of 8: [0.6756, 1.0]; of 0 of 4: [0.0, 0.4899]; of 30 of 40: [0.5981, 0.8581]
    assert mean_ci([1.0] * 8) == wilson_ci(8, 8)
    assert wilson_ci(8, 8)[0] == 1.0 and round(wilson_ci(8, 8)[1], 4) == 0.6756 and wilson_ci(8, 8)[2] == 1.0
    assert [round(v, 4) for v in wilson_ci(0, 4)] == [0.0, 0.0, 0.4899]
    assert [round(v, 4) for v in mean_ci([1.0] * 30 + [0.0] * 10)] == [0.75, 0.5981, 0.8581]
    assert mean_ci([0.5, 1.0, 0.25]) == bootstrap_ci([0.5, 1.0, 0.25])  # partial credit: the bootstrap


def test_pareto_frontier_on_a_constructed_table():
    table = [
        {"quality": 0.80, "cost": 1.0, "latency": 2.0},  # 0: frontier
        {"quality": 0.70, "cost": 1.5, "latency": 3.0},  # 1: dominated by 0
        {"quality": 0.90, "cost": 4.0, "latency": 2.5},  # 2: frontier (best quality)
        {"quality": 0.60, "cost": 0.2, "latency": 5.0},  # 3: frontier (cheapest)
        {"quality": 0.80, "cost": 1.0, "latency": 2.0},  # 4: equal to 0: neither dominates
        {"quality": 0.60, "cost": 0.3, "latency": 5.0},  # 5: dominated by 3
    ]
    assert pareto_frontier(table, maximize=["quality"], minimize=["cost"]) == [0, 2, 3, 4]
    assert pareto_frontier(table, maximize=["quality"], minimize=["cost", "latency"]) == [0, 2, 3, 4]
    assert pareto_frontier(table, maximize=["quality"]) == [2]


def test_cost_and_quality_per_dollar_second():
    # 3600 device-seconds at $2/h for 1M tokens: $2 per 1M
    assert math.isclose(dollars_per_million_tokens(3600.0, 1_000_000, 2.0), 2.0)
    assert dollars_per_million_tokens(10.0, 0, 2.0) == math.inf
    assert math.isclose(quality_per_dollar_second(0.8, 0.002, 0.5), 800.0)
    assert quality_per_dollar_second(0.8, 0.0, 0.5) == math.inf

