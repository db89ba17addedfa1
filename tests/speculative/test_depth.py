"""The adaptive depth: the DepthController's choice follows the measured step and draft costs
and the acceptance rate; a fixed depth stays fixed."""

from __future__ import annotations

from pyserve.speculative.depth import DepthController


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
