"""The semantic cache's parts without a server: guards, the calibrated threshold's binomial
bound, and the store's scopes, TTL (not renewed by hits), LRU and byte bounds."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pyserve.semantic_cache.guard import anchors, content_words, guard_of
from pyserve.semantic_cache.store import SemanticStore
from pyserve.semantic_cache.threshold import binomial_upper_bound, calibrate


def test_anchors_are_numbers_names_in_order_negations_and_scope_words():
    assert anchors("What is 12 times 4?") == (("12", "4"), (), 0, ())
    assert anchors("Why can't I see Alan Turing's notes? Never mind.") == ((), ("alan", "turing's"), 2, ())
    assert anchors("Count only the words, ignoring numbers and excluding dates.")[3] == ("except", "except", "only")
    assert anchors("Convert 15 degrees Celsius to Fahrenheit.") != anchors("Convert 15 degrees Fahrenheit to Celsius.")
    assert anchors("Summarize Hamlet in 5 sentences.") == anchors("Give me a 5-sentence summary of Hamlet.")
    assert content_words("Show me how to sort the lists in Python, please") == ["sort", "list", "python"]
    assert anchors("Rename src/main.py to app_main.py") == ((), ("src/main.py", "app_main.py"), 0, ())


@pytest.mark.parametrize("a, b, admitted", [
    ("How do I sort a list in Python?", "Show me how to sort a list using Python.", True),
    ("How many people live in Lisbon?", "What is the population of Lisbon?", True),  # the threshold decides
    ("What is 12 times 4?", "Multiply 12 by 4.", False),  # one word for a synonym: a miss, not a wrong hit
    ("What is 12 times 4?", "What is 12 times 5?", False),  # a number
    ("How do I sort a list?", "How do I not sort a list?", False),  # a negation
    ("Who wrote Hamlet?", "Who wrote Macbeth?", False),  # a name
    ("Count the days in a week.", "Count the hours in a week.", False),  # one word for another
    ("What is the maximum price?", "What is the minimum price?", False),
    ("Convert celsius to fahrenheit.", "Convert fahrenheit to celsius.", False),  # a relation reversed
    ("Copy the file a.txt to b.txt", "Copy the file b.txt to a.txt", False),  # identifiers are names, in order
    ("How do I use os.path.join?", "How do I use os.path.split?", False),
    ("In Python, how can I sort a list?", "How do I sort a list in Python?", True),  # the words reordered
    ("How do I count the lines in a file?", "How do I count the lines in a file, ignoring blank lines?", False),
    ("How do I remove the duplicates from a list?", "How do I keep only the duplicates in a list?", False),
    ("What is the population of Lisbon?", "What is the population of Lisbon, including the suburbs?", False),
    ("Does it ship only to Chile?", "Does it only ship to Chile?", True),  # the same scope word, moved
])
def test_a_guard_admits_rephrasings_and_refuses_one_changed_anchor_or_word(a, b, admitted):
    assert guard_of(a).admits(guard_of(b)) is admitted and guard_of(b).admits(guard_of(a)) is admitted


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
    q, other = guard_of("What is 12 times 4?"), guard_of("What is 12 times 5?")
    a = store.insert("s1", _unit(1), q, b"A", "t", "m", 0.9)
    assert store.lookup("s1", _unit(1), q).entry is a
    assert store.lookup("s2", _unit(1), q).entry is None  # another scope: another index
    assert store.lookup("s1", _unit(1), other).entry is None  # the guard refuses it
    assert store.lookup("s1", _unit(2), q).entry is None  # below the threshold
    now[0] = 9.0
    assert store.lookup("s1", _unit(1), q).entry is a  # a hit does not renew it
    now[0] = 10.0
    assert store.lookup("s1", _unit(1), q).entry is None and len(store) == 0 and store.expirations == 1
    entries = [store.insert("s1", _unit(i), q, b"x", "t", "m", 0.9) for i in range(3)]
    store.lookup("s1", _unit(0), q)  # the first is now the most recently used
    store.insert("s1", _unit(9), q, b"x", "t", "m", 0.9)
    assert store.lookup("s1", _unit(1), q).entry is None and store.lookup("s1", _unit(0), q).entry is entries[0]
    assert store.evictions == 1
    small = SemanticStore(8, ttl=10.0, max_entries=100, max_bytes=2 * (32 + 256 + 100), clock=lambda: now[0])
    for i in range(3):
        small.insert("s", _unit(i), q, b"y" * 100, "t", "m", 0.9)
    assert len(small) == 2 and small.bytes <= small.max_bytes
    assert store.invalidate(lambda e: True) == 3 and len(store) == 0
