"""A server's Prometheus /metrics, read and parsed, for tests and benchmarks (the server itself is
started on loopback by pyserve.server.child_server, or in process by pyserve.testing.in_process)."""

from __future__ import annotations


def parse_metrics(text: str, model: str | None = None) -> dict[str, float]:
    """Prometheus text as {series: value}; a series is its name with its labels, as written
    (`pyserve:request_outcomes_total{outcome="ok"}`). With `model`: the server-wide series and
    that model's, its `model` label dropped (`pyserve:num_requests_running`); other models' left out."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, value = line.rsplit(" ", 1)
        if model is not None and 'model="' in series:
            name, labels = series[:-1].split("{", 1)
            kept = [p for p in labels.split(",") if not p.startswith('model="')]
            if f'model="{model}"' not in labels.split(","):
                continue
            series = name + ("{" + ",".join(kept) + "}" if kept else "")
        out[series] = float(value)
    return out


def scrape_metrics(base: str, api_key: str | None = None, model: str | None = None) -> dict[str, float]:
    """The server's /metrics, parsed (see parse_metrics)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return parse_metrics(httpx.get(base + "/metrics", headers=headers, timeout=30).text, model)
