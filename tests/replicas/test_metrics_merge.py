from pyserve.replicas.metrics_merge import merge_metrics

A = """# HELP pyserve:x Requests.
# TYPE pyserve:x counter
pyserve:x{model="m"} 3
# HELP pyserve:lat Latency.
# TYPE pyserve:lat histogram
pyserve:lat_bucket{le="0.1"} 1
pyserve:lat_sum 0.05
pyserve:lat_count 1
"""
B = """# HELP pyserve:x Requests.
# TYPE pyserve:x counter
pyserve:x{model="m"} 4
# HELP pyserve:lat Latency.
# TYPE pyserve:lat histogram
pyserve:lat_sum 0
pyserve:lat_count 0
"""


def test_each_family_once_with_every_replicas_samples_labelled():
    merged = merge_metrics({"http://a": A, "http://b:1": B}).splitlines()
    assert merged == [
        "# HELP pyserve:x Requests.", "# TYPE pyserve:x counter",
        'pyserve:x{replica="http://a",model="m"} 3', 'pyserve:x{replica="http://b:1",model="m"} 4',
        "# HELP pyserve:lat Latency.", "# TYPE pyserve:lat histogram",
        'pyserve:lat_bucket{replica="http://a",le="0.1"} 1', 'pyserve:lat_sum{replica="http://a"} 0.05',
        'pyserve:lat_count{replica="http://a"} 1', 'pyserve:lat_sum{replica="http://b:1"} 0',
        'pyserve:lat_count{replica="http://b:1"} 0',
    ]


def test_nothing_gathered_is_empty():
    assert merge_metrics({}) == ""
