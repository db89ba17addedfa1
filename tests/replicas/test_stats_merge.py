from pyserve.replicas.stats_merge import merge_stats


def stats(requests: dict, ttft_counts: list[int], escalations: int, route_requests: dict, cache=None) -> dict:
    return {
        "models": {"m": {"num_requests_running": 1, "generation_tokens": 10}},
        "requests": requests,
        "latency": {"ttft": {"le": [0.1, 1.0], "counts": ttft_counts, "count": sum(ttft_counts), "sum": 0.5}},
        "routes": {"cheap": {"kind": "cascade", "small": "s", "large": "m", "requests": route_requests,
                             "escalations": escalations, "large_share": None}},
        "semantic_cache": cache,
        "embedding_inputs": 2,
    }


def test_counts_are_summed_and_engines_listed_per_replica():
    merged = merge_stats({
        "http://a": stats({"m": {"": 3, "sql": 1}}, [1, 2, 0], 1, {"s": 3, "m": 1}, cache={"entries": 5}),
        "http://b": stats({"m": {"": 4}, "n": {"": 2}}, [0, 1, 1], 2, {"s": 1, "m": 3}),
    })
    assert sorted(merged["models"]) == ["m@http://a", "m@http://b"]
    assert merged["requests"] == {"m": {"": 7, "sql": 1}, "n": {"": 2}}
    assert merged["latency"]["ttft"] == {"le": [0.1, 1.0], "counts": [1, 3, 1], "count": 5, "sum": 1.0}
    route = merged["routes"]["cheap"]
    assert route["requests"] == {"s": 4, "m": 4} and route["escalations"] == 3 and route["large_share"] == 0.5
    assert merged["semantic_cache"] == {"http://a": {"entries": 5}}
    assert merged["embedding_inputs"] == 4 and merged["replicas"] == ["http://a", "http://b"]


def test_a_histogram_with_other_bounds_is_left_out_and_nothing_answered_is_empty():
    other = stats({}, [5, 5, 5], 0, {"s": 0, "m": 0})
    other["latency"]["ttft"]["le"] = [0.5, 2.0]
    merged = merge_stats({"http://a": stats({}, [1, 0, 0], 0, {"s": 0, "m": 0}), "http://b": other})
    assert merged["latency"]["ttft"]["counts"] == [1, 0, 0]
    assert merge_stats({}) == {"models": {}, "requests": {}, "latency": {}, "routes": {}, "semantic_cache": None,
                               "embedding_inputs": 0.0, "replicas": []}
