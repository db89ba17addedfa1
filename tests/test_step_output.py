"""The step's output, column-wise, as the scheduler's update returns it and the OutputProcessor reads it."""

from __future__ import annotations

import gc

import numpy as np

from pyserve import LLM, SamplingParams, _core
from pyserve.engine.request import Logprobs, StepOutput


def test_update_returns_the_kept_tokens_when_a_stop_lands_inside_accepted_drafts():
    s = _core.Scheduler(num_blocks=64, block_size=4, num_lookahead_tokens=3)
    s.add_request(7, [1, 2, 3], max_tokens=10)
    s.add_request(8, [4, 5, 6], max_tokens=10, stop_token_ids=[21])
    s.schedule()
    first = s.update([10, 20], [1, 1])
    assert first.num_cached_tokens == {7: 0, 8: 0}
    s.set_spec_tokens(8, [21, 22, 23])
    out = s.schedule()
    assert out.num_spec_tokens.tolist() == [0, 3] and out.num_output_tokens.tolist() == [1, 1]
    # 7 samples one token; 8 accepts all three drafts and a bonus, but its stop is the first.
    update = s.update([11, 21, 22, 23, 24], [1, 4])
    assert update.req_ids == [7, 8]
    assert update.token_ids == [11, 21] and update.starts == [0, 1, 2]
    assert update.sampled_index.tolist() == [0, 1]
    assert dict(zip(update.finished_req_ids.tolist(), update.finish_reasons)) == {8: "stop"}
    assert update.num_cached_tokens == {}  # both had their first tokens the step before


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


def test_ids_only_outputs_and_text_outputs_agree(llama_dir):
    """The OutputProcessor's fast path (token ids only) and its full path give the same tokens."""
    with LLM(str(llama_dir), device="cpu", num_kv_blocks=64) as llm:
        prompts = [[5, 6, 7, 8], [9, 10, 11]]
        fast = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=9, detokenize=False), use_tqdm=False)
        full = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=9), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in full]
        assert all(len(o.outputs[0].token_ids) == 9 and o.outputs[0].finish_reason == "length" for o in fast)
        assert gc.get_freeze_count() > 0  # the engine's long-lived objects are out of the collector's sight
    assert gc.get_freeze_count() == 0  # and back once it stopped
