"""Batch sampler: greedy, seeds, filters, distributions, penalties, bans, logprobs, fast paths."""

from __future__ import annotations

import pytest
import torch

from pyserve.step.sampling_params import SamplingParams as SP
from pyserve.model.noise import NoiseKey
from pyserve.model.sampler import Sampler, SamplingRows, apply_penalties


def rows_for(params, gens=None, prompts=None, outputs=None, banned=None) -> SamplingRows:
    n = len(params)
    return SamplingRows.build(
        params, gens or [None] * n, prompts or [[]] * n, outputs or [[]] * n, banned, "cpu"
    )


def gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen(seed))


def test_greedy_rows_pick_argmax_alone_and_mixed_with_sampled_rows():
    logits = randn(6, 100, seed=1) * 3
    out = Sampler(100, "cpu", seed=0).sample(logits, rows_for([SP(temperature=0.0)] * 6))
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.logprobs is None and out.sampled_ranks is None

    params = [SP(temperature=0.0) if i % 2 == 0 else SP(temperature=1.5, top_k=7, min_p=0.01) for i in range(6)]
    mixed = Sampler(100, "cpu", seed=0).sample(logits, rows_for(params)).token_ids
    assert torch.equal(mixed[::2], logits.argmax(-1)[::2])


def test_seeded_row_is_reproducible_alone_elsewhere_and_in_mixed_batches():
    v, steps = 200, 6
    target = SP(temperature=0.9, top_k=50, top_p=0.95, seed=7)

    def run(make_batch, sampler_seed, target_seed=7):
        sampler, tokens = Sampler(v, "cpu", seed=sampler_seed), []
        for step in range(steps):
            params, gens, pos = make_batch(step)
            logits = randn(len(params), v, seed=1000 * sampler_seed + step)
            logits[pos] = randn(v, seed=step) * 2  # the target's logits depend on the step only
            gens[pos] = NoiseKey(target_seed, 16 + step)  # the target's token at sequence index 16 + step
            tokens.append(int(sampler.sample(logits, rows_for(params, gens)).token_ids[pos]))
        return tokens

    alone = run(lambda s: ([target], [None], 0), sampler_seed=1)
    others = [SP(temperature=1.0), SP(temperature=0.7, min_p=0.05, seed=99), SP(temperature=0.0)]
    at_2 = run(lambda s: (others[:2] + [target] + others[2:], [None, NoiseKey(99, s), None, None], 2), sampler_seed=2)
    shifting = run(
        lambda s: ([SP(presence_penalty=1.0, logprobs=2)] * s + [target], [None] * s + [None], s), sampler_seed=3
    )
    assert alone == at_2 == shifting
    assert run(lambda s: ([target], [None], 0), sampler_seed=1, target_seed=8) != alone


def test_top_k_1_equals_greedy():
    logits = randn(8, 50, seed=2)
    for params in (SP(temperature=1.3, top_k=1), SP(temperature=1.3, top_k=1, top_p=0.9)):
        out = Sampler(50, "cpu", seed=0).sample(logits, rows_for([params] * 8))
        assert torch.equal(out.token_ids, logits.argmax(-1))


PROBS = [0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02]  # by rank; token ids are permuted below
FILTER_CASES = [  # (params, ranks allowed)
    (SP(top_k=3), {0, 1, 2}),
    (SP(min_p=0.3), {0, 1, 2}),  # p >= 0.12
    (SP(min_p=0.5), {0, 1}),  # p >= 0.2
    (SP(top_k=5, min_p=0.2), {0, 1, 2, 3}),
    (SP(top_k=-1, top_p=1.0, min_p=0.0), set(range(7))),
    (SP(top_k=100), set(range(7))),  # k >= V is off
    (SP(top_p=0.6), {0, 1}),  # ascending cumsum 0.02 .. 0.35 <= 0.4 dropped
    (SP(top_p=0.75), {0, 1, 2}),
    (SP(top_k=3, top_p=0.6), {0, 1}),
    (SP(top_p=1e-9), {0}),  # 1 - p rounds to 1 in f32: the row still keeps its max
]


@pytest.mark.parametrize("with_top_p", [False, True], ids=["topk-only", "sort"])
def test_top_k_top_p_min_p_emit_only_allowed_tokens_with_renormalized_frequencies(with_top_p):
    cases = [c for c in FILTER_CASES if with_top_p or c[0].top_p == 1.0]
    per_case = 4000
    perm = torch.tensor([4, 0, 6, 2, 5, 1, 3])  # token id of each rank
    logits = torch.empty(7)
    logits[perm] = torch.tensor(PROBS).log()
    params = [p for p, _ in cases for _ in range(per_case)]
    tokens = Sampler(7, "cpu", seed=5).sample(logits.expand(len(params), 7), rows_for(params)).token_ids
    for c, (_, allowed) in enumerate(cases):
        got = tokens[c * per_case : (c + 1) * per_case]
        allowed_ids = {int(perm[r]) for r in allowed}
        assert set(got.tolist()) == allowed_ids, c
        kept = torch.tensor([PROBS[r] if r in allowed else 0.0 for r in range(7)])
        expected = (kept / kept.sum())[torch.argsort(perm)]  # by token id
        freq = torch.bincount(got, minlength=7).float() / per_case
        assert (freq - expected).abs().max() < 0.035, c


def test_top_p_keeps_the_smallest_set_reaching_p():
    # probs [0.5, 0.5, 0, 0] exactly: one token already has mass 0.5, so top_p=0.5 keeps just one
    logits = torch.tensor([0.0, 0.0, float("-inf"), float("-inf")]).expand(500, 4)
    tokens = Sampler(4, "cpu", seed=0).sample(logits, rows_for([SP(top_p=0.5)] * 500)).token_ids
    assert len(set(tokens.tolist())) == 1 and int(tokens[0]) in (0, 1)


def test_temperature_sampling_matches_softmax_for_shared_and_seeded_rows():
    v, t = 10, 0.7
    logits = randn(v, seed=3) * 1.5
    expected = torch.softmax(logits / t, -1)
    n = 20000
    tokens = Sampler(v, "cpu", seed=11).sample(logits.expand(n, v), rows_for([SP(temperature=t)] * n)).token_ids
    assert (torch.bincount(tokens, minlength=v) / n - expected).abs().max() < 0.012

    n = 4000  # every row with its own key: the keyed draws, a distinct (seed, position) each
    rows = rows_for([SP(temperature=t, seed=i) for i in range(n)], [NoiseKey(i // 2, i % 2) for i in range(n)])
    tokens = Sampler(v, "cpu", seed=0).sample(logits.expand(n, v), rows).token_ids
    assert (torch.bincount(tokens, minlength=v) / n - expected).abs().max() < 0.03


def test_penalties_change_logits_exactly():
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.5, -0.5, 0.0]] * 4)
    params = [
        SP(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
        SP(),
        SP(presence_penalty=-1.0),
        SP(repetition_penalty=0.5),
    ]
    prompts = [[2, 5], [0, 1], [1], [4, 4]]
    outputs = [[0, 0, 3], [0, 2], [1, 1, 4], [0]]
    got = apply_penalties(logits.clone(), rows_for(params, prompts=prompts, outputs=outputs))
    expected = torch.tensor(
        [
            [2.0 / 2 - 2 * 0.5 - 0.25, 1.0, -2.0, 0.5 / 2 - 0.5 - 0.25, -0.5, 0.0],
            [2.0, 1.0, -1.0, 0.5, -0.5, 0.0],  # defaults: untouched
            [2.0, 2.0, -1.0, 0.5, 0.5, 0.0],  # presence counts each output token once, prompt not at all
            [4.0, 1.0, -1.0, 0.5, -0.25, 0.0],  # HF: positive divided, negative multiplied
        ]
    )
    assert torch.equal(got, expected)


@pytest.mark.parametrize(
    "params, prompt, output, logits, pick",
    [
        (SP(presence_penalty=0.5), [], [0], [1.0, 0.8], 1),
        (SP(presence_penalty=0.1), [], [0], [1.0, 0.8], 0),
        (SP(presence_penalty=2.0), [0], [], [1.0, 0.8], 0),  # presence ignores the prompt
        (SP(frequency_penalty=0.1), [], [0, 0, 0], [1.0, 0.8], 1),
        (SP(frequency_penalty=0.1), [], [0], [1.0, 0.8], 0),
        (SP(repetition_penalty=2.0), [0], [], [1.0, 0.8], 1),  # 1.0 / 2 < 0.8
        (SP(repetition_penalty=2.0), [], [0], [-1.0, -1.5], 1),  # -1.0 * 2 < -1.5
        (SP(repetition_penalty=1.2), [0], [], [1.0, 0.8], 0),  # 1.0 / 1.2 > 0.8
    ],
)
def test_penalties_drive_greedy_picks(params, prompt, output, logits, pick):
    params.temperature = 0.0
    rows = rows_for([params], prompts=[prompt], outputs=[output])
    assert int(Sampler(2, "cpu", seed=0).sample(torch.tensor([logits]), rows).token_ids[0]) == pick


def test_banned_tokens_are_never_sampled_and_only_in_their_row():
    v, n = 20, 3000
    logits = randn(v, seed=4)
    logits[3], logits[7], logits[11] = 10.0, 9.0, 8.0
    params = [SP(temperature=0.0)] + [SP(temperature=2.0)] * n + [SP()]
    banned = [[3, 7]] * (n + 1) + [[]]
    tokens = Sampler(v, "cpu", seed=0).sample(logits.expand(n + 2, v), rows_for(params, banned=banned)).token_ids
    assert int(tokens[0]) == 11
    assert not ({3, 7} & set(tokens[1 : n + 1].tolist()))
    assert int(tokens[-1]) == 3  # unbanned row: 3 has prob > 0.7


def test_logprobs_top_ids_and_ranks_are_of_the_raw_logits():
    v = 40
    logits = randn(5, v, seed=6) * 2
    params = [
        SP(logprobs=3, temperature=0.7, presence_penalty=1.5, repetition_penalty=1.3),
        SP(),
        SP(logprobs=5, temperature=0.0),
        SP(logprobs=0, top_k=4),
        SP(logprobs=2, top_p=0.5),
    ]
    rows = rows_for(params, outputs=[[1, 2], [], [], [], []], banned=[[], [], [int(logits[2].argmax())], [], []])
    out = Sampler(v, "cpu", seed=0).sample(logits, rows)
    raw = torch.log_softmax(logits, -1)
    top = raw.topk(5, -1)
    assert out.logprobs.shape == (5, 5) and out.logprobs.dtype == torch.float32
    assert torch.allclose(out.logprobs, top.values) and torch.equal(out.logprob_token_ids, top.indices)
    assert torch.allclose(out.sampled_logprobs, raw.gather(1, out.token_ids[:, None]).squeeze(1))
    order = raw.argsort(-1, descending=True)
    ranks = (order == out.token_ids[:, None]).int().argmax(-1) + 1
    assert torch.equal(out.sampled_ranks, ranks)
    assert int(out.sampled_ranks[2]) == 2  # greedy with its argmax banned

    only_sampled = Sampler(v, "cpu", seed=0).sample(logits, rows_for([SP(logprobs=0)] * 5))
    assert only_sampled.logprobs.shape == (5, 0) and only_sampled.sampled_logprobs.shape == (5,)


def test_fast_paths_match_the_general_path():
    v = 64
    logits = randn(4, v, seed=7)
    # all greedy (no draws, no penalty tensors) vs the same rows beside a penalized sampled row
    fast = Sampler(v, "cpu", seed=0).sample(logits, rows_for([SP(temperature=0.0)] * 4)).token_ids
    params = [SP(temperature=0.0)] * 4 + [SP(frequency_penalty=1.0, repetition_penalty=1.5, top_p=0.5)]
    slow = Sampler(v, "cpu", seed=0).sample(torch.cat([logits, logits[:1]]),
                                            rows_for(params, outputs=[[]] * 4 + [[1, 1]]))
    assert torch.equal(slow.token_ids[:4], fast)

    # a seeded row: no penalties / top-k via topk  vs  penalty tensors present / top-k via the sort
    row = SP(temperature=0.8, top_k=5, seed=3)
    for other in (SP(presence_penalty=1.0), SP(top_p=0.5), SP(min_p=0.1, repetition_penalty=2.0)):
        s_alone, s_pair = Sampler(v, "cpu", seed=0), Sampler(v, "cpu", seed=9)
        for step in range(4):
            x = randn(2, v, seed=step)
            key = NoiseKey(3, step)
            a = s_alone.sample(x[:1], rows_for([row], [key])).token_ids[0]
            b = s_pair.sample(x, rows_for([row, other], [key, None], outputs=[[], [0, 1]])).token_ids[0]
            assert int(a) == int(b)


def test_sample_leaves_the_callers_logits_untouched():
    logits = randn(3, 30, seed=8)
    before = logits.clone()
    params = [SP(temperature=0.5, top_k=3, top_p=0.8, min_p=0.1, repetition_penalty=1.5, presence_penalty=1.0)] * 3
    rows = rows_for(params, prompts=[[1, 2]] * 3, outputs=[[3]] * 3, banned=[[0]] * 3)
    Sampler(30, "cpu", seed=0).sample(logits, rows)
    assert torch.equal(logits, before)


def test_build_skips_state_no_row_needs():
    rows = rows_for([SP(), SP(temperature=0.0, top_k=3, seed=1)], [None, NoiseKey(1, 0)], banned=[[], []])
    assert rows.presence_penalty is None and rows.output_history is None and rows.repetition_history is None
    assert rows.banned is None and rows.max_num_logprobs is None
    assert rows.max_top_k == 0 and not rows.any_top_p and not rows.any_min_p  # greedy rows' filters ignored
    assert rows.seeded_rows == [] and rows.shared_rows is None  # a greedy seeded row draws nothing
    assert rows.any_greedy and not rows.all_greedy

    rows = rows_for([SP(repetition_penalty=1.1), SP(top_k=4, top_p=0.9)], prompts=[[5, 6], [7]], outputs=[[8], [9]])
    assert rows.output_history is None  # repetition only: no output counts
    assert rows.repetition_history.tolist() == [[0, 0, 0], [5, 6, 8]]
    assert rows.max_top_k == 4 and rows.any_top_p and rows.filter_rows.tolist() == [1]


def test_rejects_logits_of_the_wrong_width():
    with pytest.raises(ValueError, match=r"\[N, 10\]"):
        Sampler(10, "cpu", seed=0).sample(torch.zeros(2, 11), rows_for([SP()] * 2))
