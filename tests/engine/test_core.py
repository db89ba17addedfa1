"""The EngineCore's column-wise step output: which tokens reach the OutputProcessor."""

from __future__ import annotations

import numpy as np

from pyserve.engine.core import _step_output
from pyserve.model.worker import StepResult


def test_tokens_after_a_stop_inside_accepted_drafts_are_dropped():
    # Three requests sampled 1, 3 and 2 tokens; the scheduler kept 1, 2 (a stop on the second)
    # and 2 of them.
    result = StepResult(np.array([10, 20, 21, 22, 30, 31]), np.array([1, 3, 2]))
    step = _step_output(np.array([7, 8, 9]), result, np.array([1, 2, 2]), {8: "stop"})
    assert step.internal_ids == [7, 8, 9]
    assert step.token_ids == [10, 20, 21, 30, 31]
    assert step.starts == [0, 1, 3, 5]
    delta = step.delta(1)
    assert (delta.internal_id, delta.token_ids, delta.finish_reason) == (8, [20, 21], "stop")


def test_logprob_rows_follow_the_kept_tokens():
    result = StepResult(np.array([10, 20, 21]), np.array([1, 2]),
                        logprobs=np.arange(6, dtype=np.float32).reshape(3, 2),
                        logprob_token_ids=np.arange(6).reshape(3, 2),
                        sampled_logprobs=np.array([-1.0, -2.0, -3.0], dtype=np.float32),
                        sampled_ranks=np.array([1, 2, 3]))
    step = _step_output(np.array([4, 5]), result, np.array([1, 1]), {5: "length"})
    assert step.token_ids == [10, 20]
    assert step.sampled_logprobs.tolist() == [-1.0, -2.0]
    assert step.delta(1).logprob_token_ids.tolist() == [[2, 3]]
