"""StepBudget: the budget it reads, for a target, off the step cost fitted to observations."""

from __future__ import annotations

import pytest

from pyserve.engine.step_budget import StepBudget


def _line(a: float, b: float):
    return lambda tokens: a + b * tokens


def _fed(budget: StepBudget, cost, sizes) -> StepBudget:
    for n in sizes:
        budget.observe(n, cost(n))
    return budget


def test_the_budget_is_the_token_count_predicted_to_take_the_target():
    cost = _line(0.01, 0.001)
    sizes = [1, 16, 900]
    assert _fed(StepBudget(0.1, 2048), cost, sizes).next_budget() == 90
    assert _fed(StepBudget(0.05, 2048), cost, sizes).next_budget() == 40


def test_the_budget_is_clamped_to_zero_and_max_tokens():
    cost = _line(0.01, 0.001)
    assert _fed(StepBudget(5.0, 2048), cost, [1, 900]).next_budget() == 2048
    assert _fed(StepBudget(0.005, 2048), cost, [1, 900]).next_budget() == 0  # the intercept alone is over


def test_no_budget_before_two_sizes_were_seen():
    budget = StepBudget(0.1, 2048)
    assert budget.next_budget() is None
    _fed(budget, _line(0.01, 0.001), [1, 1, 1])
    assert budget.next_budget() is None  # one bucket: no slope yet


def test_a_cost_that_does_not_grow_gives_the_whole_step():
    assert _fed(StepBudget(0.1, 2048), lambda n: 0.02, [1, 900]).next_budget() == 2048


def test_the_budget_follows_the_cost_near_the_target_not_a_line_through_every_size():
    # A fixed cost, then tokens that get dearer: 0.1 s is reached at 51 tokens.
    def cost(n):
        return 0.02 + 0.0015 * n + 1e-6 * n * n

    budget = _fed(StepBudget(0.1, 2048), cost, [1, 8, 32, 64, 900])
    assert budget.next_budget() == pytest.approx(51, abs=1)


def test_the_budget_beyond_the_largest_size_measured_follows_the_last_slope():
    assert _fed(StepBudget(0.1, 2048), _line(0.01, 0.001), [1, 16]).next_budget() == 90


def test_a_long_run_of_decode_steps_keeps_the_slope_of_one_prompt_step():
    budget = _fed(StepBudget(0.1, 2048), _line(0.01, 0.001), [900] + [1] * 5000)
    assert budget.next_budget() == 90


def test_the_fit_follows_a_cost_that_changes():
    budget = _fed(StepBudget(0.1, 2048), _line(0.01, 0.001), [1, 64, 900] * 3)
    assert budget.next_budget() == 90
    _fed(budget, _line(0.01, 0.002), [1, 64, 900] * 20)  # the machine got twice as slow per token
    assert budget.next_budget() == pytest.approx(45, abs=1)


@pytest.mark.parametrize("target", [0.0, -1.0, float("inf"), float("nan")])
def test_a_bad_target_is_refused_naming_the_field(target):
    with pytest.raises(ValueError, match="max_inter_token_latency"):
        StepBudget(target, 2048)
