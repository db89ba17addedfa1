"""`pyserve serve` as a real process on loopback, for tests and benchmarks (pyserve.server.loopback
starts and stops it), and its Prometheus /metrics parsed."""

from __future__ import annotations

from pyserve.server.loopback import start_server, stop_server

__all__ = ["parse_metrics", "scrape_metrics", "start_server", "stop_server"]


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as {series: value}; a series is its name with its labels, as written
    (`pyserve:request_outcomes_total{outcome="ok"}`)."""
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def scrape_metrics(base: str, api_key: str | None = None) -> dict[str, float]:
    """The server's /metrics, parsed."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return parse_metrics(httpx.get(base + "/metrics", headers=headers, timeout=30).text)
