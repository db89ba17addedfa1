"""The semantic cache's parts without a server: anchors, the calibrated threshold's binomial
bound, and the store's scopes, TTL (not renewed by hits), LRU and byte bounds."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pyserve.semantic_cache.anchors import anchors, content_words
from pyserve.semantic_cache.store import SemanticStore
from pyserve.semantic_cache.threshold import binomial_upper_bound, calibrate


def test_anchors_are_numbers_negations_and_names_in_order():
    assert anchors("What is 12 times 4?") == ("12", "4")
    assert anchors("Why can't I see Alan Turing's notes? Never mind.") == ("not", "alan", "turing's", "not")
    assert anchors("Convert 15 degrees Celsius to Fahrenheit.") != anchors("Convert 15 degrees Fahrenheit to Celsius.")
    assert anchors("How do I sort a list?") == anchors("Show me how to sort a list.") == ()
    assert content_words("Show me how to sort the lists in Python, please") == ["sort", "list", "python"]


def test_the_upper_bound_is_the_exact_clopper_pearson_one():
    for n in (10, 100, 400):  # no errors: 1 - 0.05 ** (1 / n)
        assert binomial_upper_bound(0, n) == pytest.approx(1 - 0.05 ** (1 / n), rel=1e-9)
    p = binomial_upper_bound(3, 50)  # P(X <= 3 | 50, p) = 0.05 there
    assert sum(math.comb(50, k) * p ** k * (1 - p) ** (50 - k) for k in range(4)) == pytest.approx(0.05, rel=1e-6)


def test_calibration_picks_the_lowest_threshold_the_bound_allows():
    negatives = [i / 1000 for i in range(500)]  # 0.000 .. 0.499
    t = calibrate(negatives, 0.01)
    hits = sum(v >= t for v in negatives)
    assert binomial_upper_bound(hits, 500) <= 0.01 < binomial_upper_bound(hits + 1, 500)
    assert calibrate(negatives[:100], 0.01) is None  # 100 pairs cannot show 1%


def _unit(seed: int, dim: int = 8) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal(dim).astype(np.float32)
    return v / np.linalg.norm(v)


def test_the_store_scopes_expires_and_bounds_its_entries():
    now = [0.0]
    store = SemanticStore(8, ttl=10.0, max_entries=3, max_bytes=1 << 20, clock=lambda: now[0])
    a = store.insert("s1", _unit(1), (), b"A", "t", "m", 0.9)
    assert store.lookup("s1", _unit(1), ()).entry is a
    assert store.lookup("s2", _unit(1), ()).entry is None  # another scope: another index
    assert store.lookup("s1", _unit(1), ("4",)).entry is None  # other anchors
    assert store.lookup("s1", _unit(2), ()).entry is None  # below the threshold
    now[0] = 9.0
    assert store.lookup("s1", _unit(1), ()).entry is a  # a hit does not renew it
    now[0] = 10.0
    assert store.lookup("s1", _unit(1), ()).entry is None and len(store) == 0 and store.expirations == 1
    entries = [store.insert("s1", _unit(i), (), b"x", "t", "m", 0.9) for i in range(3)]
    store.lookup("s1", _unit(0), ())  # the first is now the most recently used
    store.insert("s1", _unit(9), (), b"x", "t", "m", 0.9)
    assert store.lookup("s1", _unit(1), ()).entry is None and store.lookup("s1", _unit(0), ()).entry is entries[0]
    assert store.evictions == 1
    small = SemanticStore(8, ttl=10.0, max_entries=100, max_bytes=2 * (32 + 256 + 100), clock=lambda: now[0])
    for i in range(3):
        small.insert("s", _unit(i), (), b"y" * 100, "t", "m", 0.9)
    assert len(small) == 2 and small.bytes <= small.max_bytes
    assert store.invalidate(lambda e: True) == 3 and len(store) == 0
