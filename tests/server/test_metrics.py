"""Prometheus text exposition without a client library: counters, gauges, histograms."""

from __future__ import annotations

from pyserve.http.metrics import Counter, Gauge, Histogram, Registry


def test_a_registry_renders_each_kind_in_the_exposition_format():
    reg = Registry()
    requests = reg.add(Counter("pyserve:requests_total", "Requests."))
    reg.add(Gauge("pyserve:running", "Running.", lambda: 3))
    latency = reg.add(Histogram("pyserve:latency_seconds", "Latency.", buckets=(0.1, 1.0)))
    requests.inc(outcome="ok")
    requests.inc(2, outcome='a"b')
    for value in (0.05, 0.1, 0.5, 7.0):
        latency.observe(value)
    lines = reg.render().splitlines()
    assert lines == [
        "# HELP pyserve:requests_total Requests.", "# TYPE pyserve:requests_total counter",
        'pyserve:requests_total{outcome="ok"} 1', 'pyserve:requests_total{outcome="a\\"b"} 2',
        "# HELP pyserve:running Running.", "# TYPE pyserve:running gauge", "pyserve:running 3",
        "# HELP pyserve:latency_seconds Latency.", "# TYPE pyserve:latency_seconds histogram",
        'pyserve:latency_seconds_bucket{le="0.1"} 2', 'pyserve:latency_seconds_bucket{le="1.0"} 3',
        'pyserve:latency_seconds_bucket{le="+Inf"} 4', "pyserve:latency_seconds_sum 7.65",
        "pyserve:latency_seconds_count 4",
    ]


def test_an_unused_counter_reads_zero_and_an_engine_counter_keeps_its_kind():
    assert Counter("c", "C.").render()[-1] == "c 0"
    assert Gauge.counter("g_total", "G.", lambda: 2.5).render()[1:] == ["# TYPE g_total counter", "g_total 2.5"]
