"""Prometheus metrics in the text exposition format, without a client library.

Counters and histograms are updated by the server as requests complete; gauges read the engine's
state when scraped. Names are part of the interface (`pyserve:...`).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0)


def _fmt(value: float) -> str:
    return repr(float(value)) if value != int(value) else str(int(value))


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
    return "{" + inner + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class Counter:
    def __init__(self, name: str, help_text: str):
        self.name, self.help = name, help_text
        self.values: dict[tuple[tuple[str, str], ...], float] = {}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        self.values[key] = self.values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        """The series with exactly these labels (0 if never incremented)."""
        return self.values.get(tuple(sorted(labels.items())), 0.0)

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        if not self.values:
            lines.append(f"{self.name} 0")
        for key, value in self.values.items():
            lines.append(f"{self.name}{_labels(dict(key))} {_fmt(value)}")
        return lines


class Gauge:
    """Values read from callbacks at scrape time (a gauge, or a counter the engine keeps): one
    series per label set, fixed for the server's life (e.g. one per served model)."""

    def __init__(self, name: str, help_text: str, read: Callable[[], float] | None = None, kind: str = "gauge",
                 labels: dict[str, str] | None = None):
        self.name, self.help, self.kind = name, help_text, kind
        self.series: list[tuple[dict[str, str], Callable[[], float]]] = []
        if read is not None:
            self.series.append((labels or {}, read))

    @classmethod
    def counter(cls, name: str, help_text: str, read: Callable[[], float] | None = None,
                labels: dict[str, str] | None = None) -> Gauge:
        return cls(name, help_text, read, kind="counter", labels=labels)

    def add_series(self, labels: dict[str, str], read: Callable[[], float]) -> Gauge:
        self.series.append((labels, read))
        return self

    def render(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}",
                *(f"{self.name}{_labels(labels)} {_fmt(read())}" for labels, read in self.series)]


class Histogram:
    """One histogram per label set (`observe(..., model="m")`); `snapshot` sums them all."""

    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...] = LATENCY_BUCKETS):
        self.name, self.help, self.buckets = name, help_text, buckets
        self.series: dict[tuple[tuple[str, str], ...], list] = {}  # labels -> [bucket counts, count, sum]

    def observe(self, value: float, times: int = 1, **labels: str) -> None:
        series = self.series.get(key := tuple(sorted(labels.items())))
        if series is None:
            series = self.series[key] = [[0] * (len(self.buckets) + 1), 0, 0.0]
        series[0][bisect.bisect_left(self.buckets, value)] += times
        series[1] += times
        series[2] += value * times

    def snapshot(self) -> dict:
        """Upper bounds, the count in each bucket (not cumulative; the last is above every bound),
        the total count and sum, over every label set."""
        counts = [sum(c) for c in zip(*(s[0] for s in self.series.values()))] or [0] * (len(self.buckets) + 1)
        return {"le": list(self.buckets), "counts": counts, "count": sum(s[1] for s in self.series.values()),
                "sum": sum(s[2] for s in self.series.values())}

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        for key, (counts, count, total) in sorted(self.series.items()):
            labels = dict(key)
            cumulative = 0
            for bound, n in zip(self.buckets, counts):
                cumulative += n
                lines.append(f"{self.name}_bucket{_labels(labels | {'le': str(bound)})} {cumulative}")
            lines.append(f"{self.name}_bucket{_labels(labels | {'le': '+Inf'})} {count}")
            lines.append(f"{self.name}_sum{_labels(labels)} {_fmt(total)}")
            lines.append(f"{self.name}_count{_labels(labels)} {count}")
        return lines


class Registry:
    def __init__(self) -> None:
        self.metrics: list[Counter | Gauge | Histogram] = []

    def add(self, metric):
        self.metrics.append(metric)
        return metric

    def render(self) -> str:
        return "\n".join(line for m in self.metrics for line in m.render()) + "\n"
