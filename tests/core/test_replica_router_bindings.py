"""pyserve._core.ReplicaRouter: the Rust policy (tested with cargo test) as Python sees it."""

import pytest

from pyserve._core import ReplicaRouter


def test_follow_ups_go_where_their_prefix_went_and_loads_count():
    r = ReplicaRouter(2)
    first = r.route("system prompt. question one")
    assert first[1] == "least_cached" and r.load(first[0]) == 1
    again = r.route("system prompt. question one, and more")
    assert again == (first[0], "cache_match", 27)
    r.finished(first[0])
    r.finished(first[0])
    assert r.load(first[0]) == 0 and r.tree_bytes(first[0]) == 37


def test_excluded_and_down_replicas_are_never_chosen():
    r = ReplicaRouter(2, policy="round_robin")
    assert r.route("a", [0])[0] == 1
    r.set_healthy(1, False)
    assert r.route("a", [0]) is None
    assert not r.is_healthy(1)


def test_bad_arguments_name_what_is_wrong():
    with pytest.raises(ValueError, match="policy"):
        ReplicaRouter(2, policy="random")
    with pytest.raises(ValueError, match="cache_threshold"):
        ReplicaRouter(2, cache_threshold=2.0)
    with pytest.raises(IndexError, match="replica 5 out of range"):
        ReplicaRouter(2).finished(5)
