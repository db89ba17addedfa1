"""The adaptive depth: the DepthController's choice follows the measured step and draft costs
and the acceptance rate; a fixed depth stays fixed."""

from __future__ import annotations

from pyserve.speculative.depth import EXPLORE_STEPS, PROBE_EVERY, RECHECK_FIRST, RECHECK_SHARE, DepthController


def test_depth_follows_the_measured_costs():
    def trained(seconds_per_draft: float, batch: int, accepted: int) -> DepthController:
        ctl = DepthController(4)
        for _ in range(30):
            k = ctl.choose(batch, batch)
            ctl.observe_step(batch, batch * k, 0.010 + seconds_per_draft * batch * k)
            if k:
                ctl.observe_proposal(batch, k, batch * k, 0.0)
                for _ in range(batch):
                    ctl.observe_verification(k, min(k, accepted))
        return ctl

    # Widening the step is nearly free (memory- or overhead-bound decode): full depth.
    assert trained(1e-6, 1, 3).choose(1, 1) == 4
    # Every draft token costs as much as the fixed part of the step: speculation off.
    assert trained(0.010 / 64, 64, 3).choose(64, 64) == 0
    # A draft token costs 30% of a step and guesses always fail: off too.
    assert trained(0.003, 1, 0).choose(1, 1) == 0
    assert DepthController(3, adaptive=False).choose(64, 64) == 3


def simulate(ctl: DepthController, steps: int, accept, plain=0.001, verify=0.0007, per_draft=0.00013,
             proposal=0.0005, per_guess=0.0001) -> list[int]:
    """Batch-1 steps of a draft model with fixed costs: a step verifying drafts costs `verify`
    more than a plain one, a proposal `proposal` plus `per_guess` a guess; `accept(step, k)`
    gives how many of k drafts are kept. Returns the depth chosen at each step."""
    depths = []
    for step in range(steps):
        k = ctl.choose(1, 1)
        depths.append(k)
        if k:
            ctl.charge(1, proposal + per_guess * k)  # as the Speculator times a proposal
            ctl.observe_proposal(1, k, k, proposal + per_guess * k)
            ctl.observe_verification(k, accept(step, k))
        ctl.observe_step(1, k, plain + (verify + per_draft * k if k else 0.0))
    return depths


def test_fixed_costs_of_speculating_do_not_walk_the_depth_down_to_zero():
    # Nine in ten guesses are kept (in runs): deep guesses pay although a proposal and a
    # verification each cost half a plain step and more before the first guess.
    depths = simulate(DepthController(8, has_draft_cost=True), 300, lambda step, k: min(k, 7 if step % 3 else 3))
    assert min(depths[100:]) >= 5


def test_a_stretch_of_rejected_guesses_does_not_switch_a_draft_model_off_for_good():
    ctl = DepthController(8, has_draft_cost=True)
    hard = simulate(ctl, 200, lambda step, k: 0)
    assert hard[-50:].count(0) >= 45  # off, but for its probes
    easy = simulate(ctl, 100, lambda step, k: k)
    # The first probe's guesses are all kept: probes follow one another until speculating pays again.
    assert easy[:20].count(0) <= PROBE_EVERY + 1
    assert min(easy[40:]) >= 7


def test_full_depth_is_tried_where_half_depths_costs_overprice_it():
    # A depth of 4, every guess kept, runs 1.6x: charged the fixed costs of the half-depth steps
    # to each guess, it would look dear; tried, it pays.
    assert simulate(DepthController(4, has_draft_cost=True), 100, lambda step, k: k)[-80:].count(4) == 80


def test_no_probes_where_even_good_guesses_would_not_pay():
    # A draft token costs as much as the step itself (a large batch): off, never probed, explored
    # again after RECHECK_FIRST probe intervals, then only once the steps without drafts since have
    # run 1 / RECHECK_SHARE times what that recheck cost.
    # long enough for the plain steps to pay for one recheck (~0.024 s of extra time), not two
    depths = simulate(DepthController(8, has_draft_cost=True), 200 + round(0.04 / RECHECK_SHARE / 0.001),
                      lambda step, k: k, verify=0.001, per_draft=0.001)
    runs: list[list[int]] = []  # the stretches of steps that verified drafts
    for i, k in enumerate(depths):
        if k:
            if not runs or runs[-1][-1] != i - 1:
                runs.append([])
            runs[-1].append(i)
    assert len(runs) == 3 and all(len(run) == EXPLORE_STEPS for run in runs)  # the exploration, two rechecks
    assert runs[1][0] > RECHECK_FIRST * PROBE_EVERY
    first, second = runs[1:]
    k = depths[first[0]]
    # each step of a recheck: its time over a plain one (verify + per_draft * k), its proposal's
    cost = EXPLORE_STEPS * (0.001 + 0.001 * k + 0.0005 + 0.0001 * k)
    plain_seconds = (second[0] - first[-1] - 1) * 0.001
    assert plain_seconds * RECHECK_SHARE >= cost > (plain_seconds - PROBE_EVERY * 0.001) * RECHECK_SHARE


def test_costs_measured_cold_do_not_switch_speculation_off_for_good():
    # The draft model's first four proposals take 20x their time (a cold process): exploration
    # finds speculating dear; explored again later, it pays, and speculation resumes.
    ctl, calls = DepthController(4, has_draft_cost=True), [0]
    observe = ctl.observe_proposal

    def cold_first(batch, k, proposed, seconds):
        calls[0] += 1
        observe(batch, k, proposed, seconds * (20 if calls[0] <= 4 else 1))

    ctl.observe_proposal = cold_first
    depths = simulate(ctl, 400, lambda step, k: k)
    assert depths[30:100].count(0) == 70  # off at first, on the cold measurements
    assert depths[-200:].count(4) == 200


def test_guesses_kept_now_and_then_do_not_keep_it_probing():
    # Three guesses in five kept, in runs: not worth speculating here, and probes stay rare.
    ctl = DepthController(8, has_draft_cost=True)
    depths = simulate(ctl, 400, lambda step, k: min(k, 3 if step % 5 < 3 else 0), verify=0.0015, per_draft=0.0002)
    assert depths[-200:].count(0) >= 180


def run_batch(ctl: DepthController, batch: int, steps: int) -> list[int]:
    """Steps of `batch` requests where every guess is kept, but verifying a draft token costs as
    much as a plain step's share of a request (compute-bound); returns the depths chosen."""
    depths = []
    for _ in range(steps):
        k = ctl.choose(batch, batch)
        depths.append(k)
        if k:
            ctl.observe_proposal(batch, k, batch * k, 0.0005)
            for _ in range(batch):
                ctl.observe_verification(k, k)
        ctl.observe_step(batch, batch * k, 0.001 * batch * (1 + k))
    return depths


def test_a_batch_larger_than_one_where_good_guesses_would_not_pay_is_not_explored():
    ctl = DepthController(8, has_draft_cost=True)
    assert any(run_batch(ctl, 4, 40))  # explored: guesses tried, then off
    assert run_batch(ctl, 4, 40).count(0) == 40
    assert run_batch(ctl, 16, 40).count(0) == 40 and run_batch(ctl, 64, 40).count(0) == 40  # never explored
    assert any(run_batch(DepthController(8, has_draft_cost=True), 64, 40))  # alone, a large batch explores


def test_speculation_that_pays_is_not_charged_to_the_next_recheck():
    # Priced out (a draft costs a step), then cheap drafts: a recheck finds that guesses pay and
    # speculation runs for a long while; then drafts are dear again. The next recheck waits for
    # what the last one's exploration cost, not for the time spent speculating while it paid.
    ctl, per_draft = DepthController(8, has_draft_cost=True), [0.001]
    depths: list[int] = []

    def steps(n: int) -> None:
        for _ in range(n):
            k = ctl.choose(1, 1)
            depths.append(k)
            if k:
                ctl.charge(1, 0.0001)
                ctl.observe_proposal(1, k, k, 0.0001)
                ctl.observe_verification(k, k)
            ctl.observe_step(1, k, 0.001 + (0.0002 + per_draft[0] * k if k else 0.0))

    steps(200)  # explored, priced out, the first recheck (which waits for no cost)
    per_draft[0] = 0.00001
    steps(3000)  # a later recheck finds guesses pay: speculation on
    assert min(depths[-500:]) >= 4
    per_draft[0] = 0.001
    off = len(depths)
    steps(4000)
    rechecks = [i for i in range(off + 1, len(depths)) if depths[i] and not depths[i - 1]]
    # off again at once; the next look follows well within what the speculating stretch
    # (~2,000 steps of drafts) would have bought at RECHECK_SHARE
    assert depths[off + 200:].count(0) > 3500 and rechecks
    assert rechecks[0] - off < 2500
