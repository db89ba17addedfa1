"""Keyed noise: each row a function of its (seed, position) alone, Exp(1)-distributed."""

from __future__ import annotations

import torch

from pyserve.model.noise import NoiseKey, keyed_exponential


def test_a_row_depends_on_its_key_alone():
    keys = [NoiseKey(7, 3), NoiseKey(7, 4), NoiseKey(8, 3), NoiseKey(2**62 + 7, 3)]
    together = keyed_exponential(keys, 50, "cpu")
    for i, key in enumerate(keys):
        assert torch.equal(keyed_exponential([key], 50, "cpu")[0], together[i])
    assert len({tuple(row.tolist()) for row in together}) == 4  # position, seed and high seed bits all count
    assert torch.equal(keyed_exponential([NoiseKey(7, 3).at(1)], 50, "cpu")[0], together[1])


def test_the_draws_are_exponential():
    x = keyed_exponential([NoiseKey(s, p) for s in range(20) for p in range(10)], 1000, "cpu").flatten()
    assert bool((x > 0).all())
    assert abs(float(x.mean()) - 1.0) < 0.01 and abs(float(x.var()) - 1.0) < 0.03
    u = torch.exp(-x)  # uniform on (0, 1) if x ~ Exp(1)
    hist = torch.histc(u, bins=10, min=0.0, max=1.0) / len(u)
    assert float((hist - 0.1).abs().max()) < 0.005
