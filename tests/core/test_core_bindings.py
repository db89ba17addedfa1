"""The Rust scheduler through its Python bindings: arrays, errors, a full request lifecycle, a step
token budget, speculative drafts and n-gram lookup."""

import numpy as np
import pytest

from pyserve import _core


def make(**kw):
    args = dict(num_blocks=64, block_size=4, max_num_batched_tokens=8, max_model_len=64)
    args.update(kw)
    return _core.Scheduler(**args)


def fake_next_token(context):
    """A deterministic 'model': the next token is a function of the whole context."""
    return (sum((i + 1) * t for i, t in enumerate(context)) * 7 + 3) % 50


def test_first_step_flat_arrays_have_values_and_dtypes():
    s = make()
    s.add_request(7, [1, 2, 3, 4, 5, 6], max_tokens=2)
    out = s.schedule()
    assert out.req_ids.tolist() == [7] and out.req_ids.dtype == np.uint64
    assert out.input_ids.tolist() == [1, 2, 3, 4, 5, 6] and out.input_ids.dtype == np.int32
    assert out.positions.tolist() == list(range(6)) and out.positions.dtype == np.int64
    assert out.slot_mapping.tolist() == [4, 5, 6, 7, 8, 9] and out.slot_mapping.dtype == np.int64
    assert out.block_tables.tolist() == [[1, 2]] and out.block_tables.dtype == np.int32
    assert out.query_start_loc.tolist() == [0, 6]
    assert out.seq_lens.tolist() == [6]
    assert out.logits_indices.tolist() == [5]
    assert out.block_copies.shape == (0, 2)
    assert (out.num_reqs, out.total_num_tokens, len(out)) == (1, 6, 1)


def test_arrays_wrap_rust_buffers_without_copying():
    s = make()
    s.add_request(1, list(range(5)), max_tokens=1)
    out = s.schedule()
    for name in ("input_ids", "positions", "slot_mapping", "req_ids", "query_start_loc"):
        arr = getattr(out, name)
        assert not arr.flags.owndata, name
        assert type(arr.base).__name__ == "PySliceContainer", name


def test_lifecycle_matches_reference_and_frees_everything():
    s = make(max_num_batched_tokens=16)
    prompts = {1: [3, 1, 4, 1, 5, 9, 2, 6, 5], 2: [2, 7, 1, 8], 3: [3, 1, 4, 1, 5, 9, 2, 6, 8, 8]}
    tokens = {i: list(p) for i, p in prompts.items()}
    for i, p in prompts.items():
        s.add_request(i, np.array(p, dtype=np.int64), max_tokens=5)
    finished = {}
    while s.has_unfinished_requests():
        out = s.schedule()
        sampled, counts = [], []
        for r, rid in enumerate(out.req_ids.tolist()):
            n = int(out.num_logits[r])
            counts.append(n)
            if n:
                sampled.append(fake_next_token(tokens[rid]))
        res = s.update(np.array(sampled, dtype=np.int64), np.array(counts, dtype=np.int64))
        offset = 0
        for r, rid in enumerate(out.req_ids.tolist()):
            tokens[rid] += sampled[offset : offset + int(res.num_appended[r])]
            offset += counts[r]
        for rid, reason in zip(res.finished_req_ids.tolist(), res.finish_reasons):
            finished[rid] = reason
        s.check_invariants()
    for i, p in prompts.items():
        expected = list(p)
        for _ in range(5):
            expected.append(fake_next_token(expected))
        assert tokens[i] == expected
    assert finished == {1: "length", 2: "length", 3: "length"}
    stats = s.stats()
    assert stats["kv_cache_usage_perc"] == 0.0
    assert stats["kv_free_blocks"] + stats["kv_cached_blocks"] == 63


def test_shared_prefix_is_served_from_cache():
    s = make(max_num_batched_tokens=64)
    prompt = list(range(10, 30))
    s.add_request(1, prompt, max_tokens=1)
    s.schedule()
    s.update([1], [1])
    s.add_request(2, prompt[:17] + [99], max_tokens=1)
    out = s.schedule()
    assert out.num_scheduled_tokens.tolist() == [1]  # 17 of 18 tokens were cached
    assert s.request_state(2)["num_cached_tokens"] == 17  # 4 whole blocks and the first token of the fifth
    assert s.stats()["prefix_cache_hits"] == 17
    assert out.block_copies.shape == (1, 2)  # that fifth block, copied before the request writes into it


def test_speculative_drafts_are_verified_and_rolled_back():
    s = make(num_lookahead_tokens=2, max_num_batched_tokens=16)
    s.add_request(1, [1, 2, 3], max_tokens=10)
    s.schedule()
    s.update([4], [1])
    s.set_spec_tokens(1, [5, 6])
    out = s.schedule()
    assert out.input_ids.tolist() == [4, 5, 6]
    assert out.num_spec_tokens.tolist() == [2] and out.num_logits.tolist() == [3]
    assert out.logits_indices.tolist() == [0, 1, 2]
    s.update([5, 9], [2])  # draft 5 accepted, 6 rejected, bonus 9
    state = s.request_state(1)
    assert state["token_ids"] == [1, 2, 3, 4, 5, 9]
    assert state["num_computed_tokens"] == 5


def test_a_token_budget_holds_prompt_chunks_while_a_request_decodes():
    s = make(max_num_batched_tokens=64)
    s.add_request(1, [1, 2, 3, 4], max_tokens=8)
    assert s.schedule(token_budget=2).num_scheduled_tokens.tolist() == [4]  # nothing decodes: the whole step
    s.update([9], [1])
    s.add_request(2, list(range(5, 35)), max_tokens=2)
    assert s.schedule(token_budget=10).num_scheduled_tokens.tolist() == [1, 9]
    s.update([9], [1, 0])  # the prompt's chunk samples nothing
    assert s.schedule().num_scheduled_tokens.tolist() == [1, 21]  # no budget: max_num_batched_tokens


def test_ngram_lookup_in_the_scheduler():
    s = _core.Scheduler(num_blocks=64, block_size=4)
    s.add_request(1, [5, 6, 7, 8, 9, 5, 6], max_tokens=8)
    assert s.propose_ngram(1, 2, 1, 3) == [7, 8]
    assert s.propose_ngram(1, 2, 3, 3) == []  # "9 5 6" never occurred before
    with pytest.raises(KeyError):
        s.propose_ngram(99, 2)


def test_preemption_is_reported_and_recovers():
    s = make(num_blocks=5, block_size=2, max_num_batched_tokens=16, enable_prefix_caching=False)
    for i in (1, 2):
        s.add_request(i, [i] * 4, max_tokens=4)
    s.schedule()
    s.update([0, 0], [1, 1])
    out = s.schedule()  # each needs a third block; only the older one gets it
    assert out.preempted_req_ids.tolist() == [2]
    assert out.req_ids.tolist() == [1]
    assert s.request_state(2)["status"] == "preempted"


def test_abort_and_finished_ids_reach_the_next_step():
    s = make()
    s.add_request(1, [1, 2, 3], max_tokens=3)
    s.add_request(2, [1, 2, 3], max_tokens=3)
    s.schedule()
    s.update([0, 0], [1, 1])
    s.abort(2)
    assert s.schedule().finished_req_ids.tolist() == [2]
    with pytest.raises(_core.UnknownRequestError, match="unknown request id 2"):
        s.abort(2)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(num_blocks=0), "num_blocks"),
        (dict(block_size=3), "block_size"),
        (dict(block_size=16, max_num_batched_tokens=8), "max_num_batched_tokens"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(num_lookahead_tokens=8), "num_lookahead_tokens"),
    ],
)
def test_bad_config_raises_config_error_naming_field(kwargs, field):
    with pytest.raises(_core.ConfigError, match=f"`{field}`"):
        make(**kwargs)
    assert issubclass(_core.ConfigError, ValueError)


@pytest.mark.parametrize(
    ("prompt", "kwargs", "field"),
    [
        ([], {}, "prompt_token_ids"),
        ([1] * 64, {}, "prompt_token_ids"),
        ([1, 2], dict(max_tokens=63), "max_tokens"),
        ([1, 2], dict(max_tokens=0), "max_tokens"),
        ([1, -2], {}, "prompt_token_ids"),
        ("abc", {}, "prompt_token_ids"),
        ([1, 2], dict(stop_token_ids=[2**40]), "stop_token_ids"),
        ([1, 2], dict(max_tokens=2, min_tokens=3), "min_tokens"),
    ],
)
def test_bad_request_raises_naming_field(prompt, kwargs, field):
    s = make()
    with pytest.raises(_core.InvalidRequestError, match=f"`{field}`") as raised:
        s.add_request(1, prompt, **kwargs)
    assert raised.value.field == field
    assert not s.has_unfinished_requests()


def test_request_larger_than_pool_is_refused():
    s = make(num_blocks=4, block_size=4, max_model_len=1000)  # 12 token slots
    with pytest.raises(_core.InvalidRequestError, match="need 4 KV blocks; the pool has 3"):
        s.add_request(1, [1] * 10, max_tokens=5)


def test_update_out_of_order_raises_step_error_and_keeps_step():
    s = make()
    with pytest.raises(_core.StepError, match="no step in flight"):
        s.update([], [])
    s.add_request(1, [1, 2], max_tokens=2)
    s.schedule()
    with pytest.raises(_core.StepError, match="num_sampled"):
        s.update([1, 2], [2])
    with pytest.raises(_core.StepError, match="sampled_token_ids"):
        s.update([-1], [1])
    assert s.update(np.array([3], dtype=np.int32), [1]).num_appended.tolist() == [1]


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
