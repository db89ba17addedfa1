"""The exact rejection sampler of speculative decoding: the Triton kernel against its torch
reference, greedy rows, and the distribution it samples (the target's, whatever the draft's)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pyserve.kernels.rejection_sample import rejection_sample, rejection_sample_ref  # noqa: E402


def random_case(num_drafts: list[int], vocab: int, seed: int, with_q: bool, greedy_rows=()):
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
    u = torch.rand(rows, generator=g)
    noise = torch.empty(rows, vocab).exponential_(generator=g).clamp_min_(1e-30)
    cu = torch.tensor(np.concatenate([[0], np.cumsum([k + 1 for k in num_drafts])]), dtype=torch.int32)
    return p, q, drafts, u, noise, cu


@pytest.mark.parametrize("with_q", [False, True])
def test_rejection_kernel_matches_reference(with_q):
    case = random_case([3, 0, 5, 1, 2], vocab=37, seed=1, with_q=with_q, greedy_rows=(0, 1, 2, 3))
    want_tokens, want_num = rejection_sample_ref(*case)
    got_tokens, got_num = rejection_sample(*case)
    assert got_num.tolist() == want_num.tolist()
    assert got_tokens.tolist() == want_tokens.tolist()
    cu = case[-1].tolist()
    for b, n in enumerate(want_num.tolist()):  # accepted drafts are the drafts, then -1 padding
        row = want_tokens[cu[b] : cu[b + 1]].tolist()
        assert row[: n - 1] == case[2][cu[b] : cu[b] + n - 1].tolist()
        assert all(t == -1 for t in row[n:]) and row[n - 1] >= 0


def test_greedy_rows_keep_drafts_while_they_are_the_argmax():
    vocab = 11
    p = torch.zeros(4, vocab)
    p[torch.arange(4), torch.tensor([3, 5, 7, 9])] = 1.0  # target argmax 3, 5, 7, then bonus 9
    drafts = torch.tensor([3, 5, 2, -1])  # the third draft is wrong
    u = torch.full((4,), 0.999)
    noise = torch.ones(4, vocab)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    for fn in (rejection_sample_ref, rejection_sample):
        tokens, num = fn(p, None, drafts, u, noise, cu)
        assert num.tolist() == [3] and tokens.tolist() == [3, 5, 7, -1]


@pytest.mark.parametrize("with_q", [False, True])
def test_rejection_sampling_preserves_the_target_distribution(with_q):
    """One draft token per request drawn from q (or fixed, for n-gram lookup): the first output
    token must be distributed as p. 40000 samples; total variation must stay under 0.015
    (its sampling noise is about 0.005 here)."""
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
    u = torch.rand(2 * n, generator=g)
    noise = torch.empty(2 * n, vocab).exponential_(generator=g)
    cu = torch.arange(0, 2 * n + 1, 2, dtype=torch.int32)
    tokens, num = rejection_sample_ref(p, q, drafts, u, noise, cu)
    first = tokens[0::2]
    freq = torch.bincount(first, minlength=vocab).float() / n
    assert 0.5 * (freq - p_row).abs().sum() < 0.015
    accept_rate = float((num == 2).float().mean())
    expected = float(torch.minimum(p_row, q_row).sum()) if with_q else float(p_row[2])
    assert accept_rate == pytest.approx(expected, abs=0.01)


@pytest.mark.parametrize("with_q", [False, True])
def test_a_draft_outside_the_vocabulary_is_rejected(with_q):
    """Drafts -3, V and V + 7 are rejected where they stand (a target that would accept any
    in-vocabulary draft: p uniform, u = 0); the token at the rejection comes from the residual
    (from p when q is one-hot: an unknown id adds nothing to it)."""
    vocab = 13
    p = torch.full((6, vocab), 1.0 / vocab)
    q = torch.full((6, vocab), 1.0 / vocab) * 0.5 if with_q else None
    if q is not None:
        q[:, 4] += 0.5  # mass off token 4: the residual p - q is positive elsewhere
    drafts = torch.tensor([5, -3, 7, vocab, 2, vocab + 7])
    u = torch.zeros(6)
    noise = torch.ones(6, vocab)
    noise[:, 9] = 0.5  # the race's winner wherever token 9 has weight
    cu = torch.tensor([0, 3, 6], dtype=torch.int32)  # request 0: drafts 5, -3; request 1: vocab, 2
    for fn in (rejection_sample_ref, rejection_sample):
        tokens, num = fn(p, q, drafts, u, noise, cu)
        assert num.tolist() == [2, 1]
        assert tokens.tolist() == [5, 9, -1, 9, -1, -1]
