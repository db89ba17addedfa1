"""Decode rows split into groups of similar context length (for the reference attention path):
uniform lengths stay one group; short and long contexts are split apart, ascending within each."""

from __future__ import annotations

import numpy as np

from pyserve.model.length_groups import length_groups

HKV, D = 2, 8


def test_uniform_lengths_stay_one_group():
    assert length_groups(np.full(64, 300), 2 * HKV * D) is None
    assert length_groups(np.array([5]), 2 * HKV * D) is None


def test_short_and_long_contexts_are_split_apart():
    lens = np.array([1000, 3, 990, 5, 1010, 4, 995, 2])
    groups = length_groups(lens, 2 * 8 * 64)
    assert groups is not None and len(groups) == 2
    assert sorted(np.concatenate(groups).tolist()) == list(range(8))
    assert sorted(groups[0].tolist()) == [1, 3, 5, 7] and sorted(groups[1].tolist()) == [0, 2, 4, 6]
    assert all((np.diff(lens[g]) >= 0).all() for g in groups)  # ascending within a group
