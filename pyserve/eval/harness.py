"""`pyserve eval`: every configuration of a plan run over the eval set, then one report.

Each configuration is started on loopback (`pyserve serve`, its log in the output folder) or
reached at its URL, warmed up with `warmup` requests, and run over the set at its concurrency;
with `repeats` > 1 the configurations take turns, round after round, and the figures are
medians over rounds (scores are averaged). A configuration that fails (its server does not
start, a request errors) is reported as failed with its error; the others still run.

Per configuration: quality (the mean score of the scored items, with its bootstrap 95%
interval), perplexity over `perplexity` items, output tokens, cost per 1M output tokens
(device-seconds at the price per hour), TTFT and inter-token latency p50/p99, end-to-end p50,
output throughput, quality per dollar-second (quality / (dollars per item x seconds per item)),
and whether it is on the Pareto frontier of quality against cost and end-to-end latency.
"""

from __future__ import annotations

import asyncio
import csv
import json
import math
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pyserve.eval.configs import EvalConfig, EvalPlan
from pyserve.eval.runner import Client, ItemResult, percentile, run_items
from pyserve.eval.stats import dollars_per_million_tokens, mean_ci, pareto_frontier, quality_per_dollar_second

COLUMNS = ("name", "status", "quality", "ci_low", "ci_high", "perplexity", "dollars_per_mtok", "ttft_p50_ms",
           "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "e2e_p50_s", "output_tok_s", "quality_per_dollar_second",
           "frontier")


@dataclass
class ConfigReport:
    name: str
    status: str = "ok"  # or "failed"
    error: str | None = None
    items: int = 0
    quality: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    perplexity: float | None = None
    output_tokens: int = 0
    device_seconds: float = 0.0
    dollars_per_mtok: float | None = None
    dollars_per_item: float | None = None
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    itl_p50_ms: float | None = None
    itl_p99_ms: float | None = None
    e2e_p50_s: float | None = None
    output_tok_s: float | None = None
    quality_per_dollar_second: float | None = None
    frontier: bool = False
    # Per item (the first round): id, score (null for perplexity items), the scorer's detail,
    # output tokens.
    results: list[dict] = field(default_factory=list)


def _ms(v: float | None) -> float | None:
    return None if v is None else v * 1e3


def summarize(name: str, rounds: list[tuple[list[ItemResult], float]], price_per_hour: float) -> ConfigReport:
    """One configuration's report from its rounds: (results in item order, wall seconds)."""
    rep = ConfigReport(name, items=len(rounds[0][0]))
    rep.results = [{"id": r.id, "score": r.score.value, "detail": r.score.detail,
                    "output_tokens": r.timing.output_tokens} for r in rounds[0][0]]
    per_item = list(zip(*[r for r, _ in rounds]))  # each item's results over rounds
    values = [statistics.fmean(s.score.value for s in results) for results in per_item
              if results[0].score.value is not None]
    if values:
        rep.quality, rep.ci_low, rep.ci_high = mean_ci(values)
    first_round = rounds[0][0]  # logprobs do not change between rounds
    nll = [(r.score.nll, r.score.tokens) for r in first_round if r.score.nll is not None]
    if nll:
        rep.perplexity = math.exp(sum(n for n, _ in nll) / sum(t for _, t in nll))
    seconds = statistics.median(w for _, w in rounds)
    tokens = statistics.median(sum(r.timing.output_tokens for r in results) for results, _ in rounds)
    rep.output_tokens, rep.device_seconds = int(tokens), seconds
    rep.dollars_per_mtok = dollars_per_million_tokens(seconds, int(tokens), price_per_hour) if tokens else None
    rep.dollars_per_item = seconds / 3600.0 * price_per_hour / rep.items
    ttft = [r.timing.ttft for results, _ in rounds for r in results if r.timing.ttft is not None]
    gaps = [g for results, _ in rounds for r in results for g in r.timing.gaps]
    e2e = [r.timing.e2e for results, _ in rounds for r in results]
    rep.ttft_p50_ms, rep.ttft_p99_ms = _ms(percentile(ttft, 50)), _ms(percentile(ttft, 99))
    rep.itl_p50_ms, rep.itl_p99_ms = _ms(percentile(gaps, 50)), _ms(percentile(gaps, 99))
    rep.e2e_p50_s = percentile(e2e, 50)
    rep.output_tok_s = tokens / seconds if seconds > 0 else None
    if rep.quality is not None and rep.e2e_p50_s is not None:
        rep.quality_per_dollar_second = quality_per_dollar_second(rep.quality, rep.dollars_per_item, rep.e2e_p50_s)
    return rep


def mark_frontier(reports: list[ConfigReport]) -> None:
    ok = [r for r in reports if r.status == "ok" and r.quality is not None]
    points = [{"quality": r.quality, "cost": r.dollars_per_item, "latency": r.e2e_p50_s} for r in ok]
    for i in pareto_frontier(points, maximize=["quality"], minimize=["cost", "latency"]):
        ok[i].frontier = True


class LocalServer:
    """A configuration's `pyserve serve` on loopback, its log under `workdir`."""

    def __init__(self, cfg: EvalConfig, workdir: Path):
        self.cfg, self.workdir = cfg, workdir

    def __enter__(self) -> str:
        from pyserve.server.child_server import start_server

        model = None if self.cfg.model is None else Path(self.cfg.model)
        if not self.cfg.decides:
            named = ["--served-model-name", "eval"]
        else:  # the route is named eval; the models keep their own names
            named = [] if self.cfg.served_model is None else ["--served-model-name", self.cfg.served_model]
        self.proc, base = start_server(model, *named, *self.cfg.serve_flags(), workdir=self.workdir)
        return base

    def __exit__(self, *exc) -> None:
        from pyserve.server.child_server import stop_server

        stop_server(self.proc)


async def _run_config(cfg: EvalConfig, plan: EvalPlan, items: list, base: str, progress) -> tuple[list, float]:
    model = (cfg.served_model or "eval") if cfg.url is not None else (cfg.lora_name or "eval")
    client = Client(base, cfg, model)
    try:
        warm = [i for i in items if i.generates][: plan.warmup] or items[: plan.warmup]
        for item in warm:
            await client.run_item(item)
        start = time.perf_counter()
        results = await run_items(client, items, cfg.concurrency or plan.concurrency, progress)
        return results, time.perf_counter() - start
    finally:
        await client.close()


def clipped(message: str, limit: int = 2000) -> str:
    """`message` within `limit` characters: its start and its end (where a server's log says
    why it stopped) around a mark of what was left out."""
    if len(message) <= limit:
        return message
    head = limit // 4
    return f"{message[:head]} [... {len(message) - limit} characters ...] {message[-(limit - head):]}"


def run_plan(plan: EvalPlan, items: list, out_dir: Path, repeats: int = 1, progress=None) -> list[ConfigReport]:
    """Every configuration over `items`, `repeats` rounds taking turns; the reports in plan order."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rounds: dict[str, list] = {c.name: [] for c in plan.configs}
    errors: dict[str, str] = {}
    for _ in range(repeats):
        for cfg in plan.configs:
            if cfg.name in errors:
                continue
            try:
                if cfg.url is not None:
                    result = asyncio.run(_run_config(cfg, plan, items, cfg.url, progress))
                else:
                    with LocalServer(cfg, out_dir) as base:
                        result = asyncio.run(_run_config(cfg, plan, items, base, progress))
                rounds[cfg.name].append(result)
            except Exception as e:  # noqa: BLE001 - reported as the configuration's failure
                errors[cfg.name] = clipped(f"{type(e).__name__}: {e}")
    reports = []
    for cfg in plan.configs:
        if cfg.name in errors:
            reports.append(ConfigReport(cfg.name, status="failed", error=errors[cfg.name], items=len(items)))
        else:
            price = plan.price_per_hour if cfg.price_per_hour is None else cfg.price_per_hour
            reports.append(summarize(cfg.name, rounds[cfg.name], price))
    mark_frontier(reports)
    return reports


def machine() -> dict:
    from importlib.metadata import version

    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "python": sys.version.split()[0], "torch": version("torch"), "pyserve": version("pyserve"),
            "cpus": __import__("os").cpu_count(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def _cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else ""
    if isinstance(v, float):
        return "inf" if math.isinf(v) else f"{v:.4g}"
    return str(v)


def table(reports: list[ConfigReport]) -> str:
    rows = [list(COLUMNS)] + [[_cell(getattr(r, c)) for c in COLUMNS] for r in reports]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
    failed = [f"{r.name}: {r.error}" for r in reports if r.status == "failed"]
    return "\n".join(lines + ([""] + ["failed " + f for f in failed] if failed else []))


def write_report(reports: list[ConfigReport], out_dir: Path, meta: dict) -> dict[str, Path]:
    """eval.json, eval.csv and (with matplotlib) eval.png under `out_dir`; returns their paths."""
    paths = {"json": out_dir / "eval.json", "csv": out_dir / "eval.csv"}
    paths["json"].write_text(json.dumps({**meta, "configs": [asdict(r) for r in reports]}, indent=1))
    with paths["csv"].open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([*COLUMNS, "error"])
        for r in reports:
            writer.writerow([*(getattr(r, c) for c in COLUMNS), r.error or ""])
    plotted = plot(reports, out_dir / "eval.png")
    if plotted is not None:
        paths["png"] = plotted
    return paths


LABEL_FONT_PT = 8
LABEL_CHAR_PT = 4.8  # the average width of a character of the label font
LABEL_LINE_PT = 10  # a label's height, with a little space


def label_offsets(anchors: list[tuple[float, float]], widths: list[float], height: float) -> list[float]:
    """Vertical offsets (pixels, up) for labels whose lower-left corners sit at `anchors` (pixels),
    each `widths[i]` wide and `height` high, so no two overlap: each in turn (left to right)
    takes the first of 0, +h, -h, +2h, -2h, ... that clears the labels placed before it."""
    placed: list[tuple[float, float, float]] = []  # (left, right, bottom)
    offsets = [0.0] * len(anchors)
    for i in sorted(range(len(anchors)), key=lambda i: anchors[i]):
        x, y = anchors[i]
        for k in range(2 * len(anchors) + 1):
            dy = height * ((k + 1) // 2) * (1 if k % 2 else -1)
            bottom = y + dy
            if all(x >= right or x + widths[i] <= left or abs(bottom - b) >= height for left, right, b in placed):
                break
        offsets[i] = dy
        placed.append((x, x + widths[i], bottom))
    return offsets


def plot(reports: list[ConfigReport], path: Path) -> Path | None:
    """Quality against dollars per item, marker area by end-to-end latency, the frontier drawn."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ok = [r for r in reports if r.status == "ok" and r.quality is not None]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if ok:
        latency = [r.e2e_p50_s or 0.0 for r in ok]
        top = max(latency) or 1.0
        ax.scatter([r.dollars_per_item for r in ok], [r.quality for r in ok],
                   s=[40 + 400 * v / top for v in latency], alpha=0.6)
        ax.autoscale_view()
        anchors = ax.transData.transform([(r.dollars_per_item, r.quality) for r in ok]).tolist()
        points_per_px = 72 / fig.dpi
        offsets = label_offsets(anchors, [LABEL_CHAR_PT * len(r.name) / points_per_px for r in ok],
                                LABEL_LINE_PT / points_per_px)
        for r, dy in zip(ok, offsets):
            ax.annotate(r.name, (r.dollars_per_item, r.quality), fontsize=LABEL_FONT_PT,
                        xytext=(4, 4 + dy * points_per_px), textcoords="offset points")
        front = sorted((r for r in ok if r.frontier), key=lambda r: r.dollars_per_item)
        ax.plot([r.dollars_per_item for r in front], [r.quality for r in front], "--", color="gray",
                label="Pareto frontier")
        ax.legend(loc="lower right")
    ax.set_xlabel("dollars per item")
    ax.set_ylabel("quality (mean score)")
    ax.set_title("quality against cost (marker size: end-to-end latency p50)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
