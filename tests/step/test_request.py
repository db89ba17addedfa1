"""The messages the engine's actors exchange: a step's output, column-wise, and its logprob rows."""

from __future__ import annotations

import numpy as np

from pyserve.step.request import Logprobs, StepOutput


def test_step_output_deltas_carry_their_logprob_rows():
    logprobs = Logprobs(np.arange(6, dtype=np.float32).reshape(3, 2), np.arange(6).reshape(3, 2),
                        np.array([-1.0, -2.0, -3.0], dtype=np.float32), np.array([1, 2, 3]))
    step = StepOutput([4, 5], [10, 20, 21], [0, 1, 3], {5: "length"}, {4: 2}, logprobs)
    first, second = step.delta(0), step.delta(1)
    assert (first.token_ids, first.num_cached_tokens, first.finish_reason) == ([10], 2, None)
    assert (second.token_ids, second.finish_reason) == ([20, 21], "length")
    assert second.logprobs.sampled.tolist() == [-2.0, -3.0]
    assert second.logprobs.top_token_ids.tolist() == [[2, 3], [4, 5]]
    placed = logprobs[1:].scattered(np.array([0, 2]), 3)
    assert placed.sampled.tolist() == [-2.0, 0.0, -3.0]
