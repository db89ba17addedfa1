"""The exact rejection sampler of speculative decoding: the Triton kernel against its torch
reference, greedy rows, and the distribution it samples (the target's, whatever the draft's).

Cases are drawn on the CPU (seeded generators) and moved to DEVICE: the GPU where there is one
(Triton compiles for it), else the CPU under the interpreter. The distribution test runs only the
torch reference (the CPU serving path), on the CPU."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pyserve.kernels.rejection_sample import keyed_noise, rejection_sample, rejection_sample_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def keys(rows: int, seed: int, device=DEVICE) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    seeds, positions = torch.randint(0, 2**62, (rows,), generator=g), torch.randint(0, 10**6, (rows,), generator=g)
    return seeds.to(device), positions.to(device)


def i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def random_case(num_drafts: list[int], vocab: int, seed: int, with_q: bool, greedy_rows=(), coupled=()):
    g = torch.Generator().manual_seed(seed)
    rows = sum(k + 1 for k in num_drafts)
    p = torch.rand(rows, vocab, generator=g).pow(3)
    p /= p.sum(1, keepdim=True)
    for r in greedy_rows:
        p[r] = torch.nn.functional.one_hot(p[r].argmax(), vocab).float()
    q = None
    if with_q:
        q = torch.rand(rows, vocab, generator=g)
        q /= q.sum(1, keepdim=True)
    drafts = torch.randint(0, vocab, (rows,), generator=g)
    # Make some drafts the target's favourite so that runs of acceptances occur.
    fav = p.argmax(1)
    drafts = torch.where(torch.rand(rows, generator=g) < 0.5, fav, drafts)
    seeds, positions = keys(rows, seed)
    flags = i32([int(b in coupled) for b in range(len(num_drafts))])
    cu = i32(np.concatenate([[0], np.cumsum([k + 1 for k in num_drafts])]))
    return p.to(DEVICE), None if q is None else q.to(DEVICE), drafts.to(DEVICE), seeds, positions, flags, cu


@pytest.mark.parametrize("with_q", [False, True])
def test_rejection_kernel_matches_reference(with_q):
    case = random_case([3, 0, 5, 1, 2, 4], vocab=37, seed=1, with_q=with_q, greedy_rows=(0, 1, 2, 3), coupled=(2, 5))
    want_tokens, want_num = rejection_sample_ref(*case)
    got_tokens, got_num = rejection_sample(*case)
    assert got_num.tolist() == want_num.tolist()
    assert got_tokens.tolist() == want_tokens.tolist()
    cu = case[-1].tolist()
    for b, n in enumerate(want_num.tolist()):  # accepted drafts are the drafts, then -1 padding
        row = want_tokens[cu[b] : cu[b + 1]].tolist()
        assert row[: n - 1] == case[2][cu[b] : cu[b] + n - 1].tolist()
        assert all(t == -1 for t in row[n:]) and row[n - 1] >= 0


def test_the_kernels_numbers_are_the_keyed_noise():
    """The kernel computes its uniforms and noise in place from the keys: a coupled request whose
    drafts are its race's picks (computed here from keyed_noise) keeps every one of them."""
    vocab, rows = 23, 5
    g = torch.Generator().manual_seed(3)
    p = torch.rand(rows, vocab, generator=g)
    p = (p / p.sum(1, keepdim=True)).to(DEVICE)
    seeds, positions = keys(rows, 4)
    _, noise = keyed_noise(seeds, positions, vocab)
    picks = (p / noise).argmax(1)
    cu = i32([0, rows])
    for fn in (rejection_sample_ref, rejection_sample):
        tokens, num = fn(p, None, picks, seeds, positions, i32([1]), cu)
        assert num.tolist() == [rows] and tokens.tolist() == picks.tolist()


def test_greedy_rows_keep_drafts_while_they_are_the_argmax():
    vocab = 11
    p = torch.zeros(4, vocab, device=DEVICE)
    # target argmax 3, 5, 7, then bonus 9
    p[torch.arange(4, device=DEVICE), torch.tensor([3, 5, 7, 9], device=DEVICE)] = 1.0
    drafts = torch.tensor([3, 5, 2, -1], device=DEVICE)  # the third draft is wrong
    cu = i32([0, 4])
    for coupled in (0, 1):
        for fn in (rejection_sample_ref, rejection_sample):
            tokens, num = fn(p, None, drafts, *keys(4, 9), i32([coupled]), cu)
            assert num.tolist() == [3] and tokens.tolist() == [3, 5, 7, -1]


@pytest.mark.parametrize("with_q,coupled", [(False, 0), (True, 0), (True, 1)])
def test_rejection_sampling_preserves_the_target_distribution(with_q, coupled):
    """One draft token per request drawn from q (or fixed, for n-gram lookup): the first output
    token must be distributed as p, by rejection sampling and by the coupled rule. 40000 samples;
    total variation must stay under 0.015 (its sampling noise is about 0.005 here)."""
    vocab, n = 6, 40000
    g = torch.Generator().manual_seed(7)
    p_row = torch.tensor([0.05, 0.4, 0.1, 0.25, 0.15, 0.05])
    q_row = torch.tensor([0.3, 0.1, 0.3, 0.1, 0.1, 0.1])
    p = p_row.repeat(2 * n, 1)
    if with_q:
        draft = torch.multinomial(q_row, n, replacement=True, generator=g)
        q = q_row.repeat(2 * n, 1)
    else:
        draft, q = torch.full((n,), 2), None  # always guess token 2
    drafts = torch.stack([draft, torch.full((n,), -1)], 1).reshape(-1)
    cu = torch.arange(0, 2 * n + 1, 2, dtype=torch.int32)
    tokens, num = rejection_sample_ref(p, q, drafts, *keys(2 * n, 8, "cpu"),
                                       torch.full((n,), coupled, dtype=torch.int32), cu)
    first = tokens[0::2]
    freq = torch.bincount(first, minlength=vocab).float() / n
    assert 0.5 * (freq - p_row).abs().sum() < 0.015
    accept_rate = float((num == 2).float().mean())
    if coupled:  # a draft independent of the noise is kept when the race picks it: sum of p * q
        expected = float((p_row * q_row).sum())
    else:
        expected = float(torch.minimum(p_row, q_row).sum()) if with_q else float(p_row[2])
    assert accept_rate == pytest.approx(expected, abs=0.01)


@pytest.mark.parametrize("with_q,coupled", [(False, 0), (True, 0), (True, 1)])
def test_a_draft_outside_the_vocabulary_is_rejected(with_q, coupled):
    """Drafts -3 and V are rejected where they stand, though the draft after each is the target's
    certain choice; the token at the rejection is the target's (an unknown id adds nothing to q)."""
    vocab = 13
    p = torch.zeros(6, vocab, device=DEVICE)
    p[torch.arange(6, device=DEVICE), torch.tensor([5, 3, 0, 8, 2, 0], device=DEVICE)] = 1.0
    q = torch.full((6, vocab), 1.0 / vocab, device=DEVICE) if with_q else None
    drafts = torch.tensor([5, -3, 7, vocab, 2, vocab + 7], device=DEVICE)
    cu = i32([0, 3, 6])  # request 0: drafts 5, -3; request 1: vocab, 2
    for fn in (rejection_sample_ref, rejection_sample):
        tokens, num = fn(p, q, drafts, *keys(6, 2), i32([coupled, coupled]), cu)
        assert num.tolist() == [2, 1]
        assert tokens.tolist() == [5, 3, -1, 8, -1, -1]


@pytest.mark.parametrize("with_draft_model", [False, True])
def test_the_verifiers_warm_up_launches_the_variant_steps_use(with_draft_model):
    from pyserve.kernels._launch import recording
    from pyserve.model.sampler import Sampler
    from pyserve.speculative.verify import Verifier

    vocab = 37
    verifier = Verifier(Sampler(vocab, DEVICE, seed=0), torch.device(DEVICE), object() if with_draft_model else None,
                        None)
    with recording() as warm:
        verifier.warm_up()
    case = random_case([3, 1, 4], vocab=vocab, seed=2, with_q=with_draft_model, coupled=(1,))
    with recording() as step:
        rejection_sample(*case)
    assert step["_rejection_sample_kernel"] == warm["_rejection_sample_kernel"]
