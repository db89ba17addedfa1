"""The README's plots, drawn from a results folder's JSON (matplotlib, PNG):

  throughput_vs_concurrency.png  concurrency.json: output tokens/s, and TTFT / TPOT medians,
                                 against the number of clients
  ttft_prefix_cache.png          prefix_cache.json: the distribution (CDF) of TTFT with a cached
                                 2000-token system prompt and with the cache off
  spec_speedup_vs_batch.png      spec_decode.json: speculative / plain throughput against batch
                                 size, n-gram and draft model
  decode_vs_batch.png            batch1_decode.json (run with --sweep): decode tokens/s of the
                                 25M model against batch size

A plot whose JSON is missing is skipped (and said so). Usage: python bench/plots.py [RESULTS] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
SPEC_ROWS = ("code", "batch4", "batch16", "batch64")  # the same code workload at growing batch sizes


def throughput_vs_concurrency(report: dict, path: Path) -> None:
    levels = report["levels"]
    clients = [r["concurrency"] for r in levels]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6, 6), sharex=True)
    top.plot(clients, [r["output_tokens_per_s"] for r in levels], "o-")
    top.set_ylabel("output tokens/s")
    top.set_title(f"pyserve serve, {report['input_len']} in / {report['output_len']} out tokens")
    bottom.plot(clients, [r["ttft_ms_median"] for r in levels], "o-", label="TTFT median")
    bottom.plot(clients, [r["tpot_ms_median"] for r in levels], "s-", label="TPOT median")
    bottom.set_ylabel("ms")
    bottom.set_xlabel("concurrent clients")
    bottom.set_xscale("log", base=2)
    bottom.set_xticks(clients, [str(c) for c in clients])
    bottom.legend()
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    _save(fig, path)


def ttft_prefix_cache(report: dict, path: Path) -> None:
    shared = report["shared"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("ttft_ms_cache_on", "prefix cache on"), ("ttft_ms_cache_off", "prefix cache off")):
        values = sorted(shared[key])
        ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (ms, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT with a {shared['system_prompt_tokens']}-token shared system prompt "
                 f"(p50 ratio {shared['ratio']:.3f})")
    ax.grid(alpha=0.3)
    ax.legend()
    _save(fig, path)


def spec_speedup_vs_batch(report: dict, path: Path) -> None:
    rows = [report["results"][name] for name in SPEC_ROWS if name in report["results"]]
    batch = [r["batch"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    for method, marker in (("ngram", "o-"), ("draft", "s-")):
        if all(f"{method}_ratio" in r for r in rows):
            ax.plot(batch, [r[f"{method}_ratio"] for r in rows], marker, label=method)
    ax.axhline(1.0, color="gray", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_xticks(batch, [str(b) for b in batch])
    ax.set_xlabel("requests in the batch")
    ax.set_ylabel("speculative / plain tokens/s")
    ax.set_title("speculative decoding speedup, code continuation, greedy")
    ax.grid(alpha=0.3)
    ax.legend()
    _save(fig, path)


def decode_vs_batch(report: dict, path: Path) -> None:
    sweep = report["models"]["25m"]["sweep"]
    batch = [int(b) for b in sweep]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(batch, list(sweep.values()), "o-")
    ax.set_xscale("log", base=2)
    ax.set_xticks(batch, [str(b) for b in batch])
    ax.set_xlabel("requests decoding at once")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"greedy decode, 25M Llama, fp32 CPU, {report['tokens']} tokens each")
    ax.grid(alpha=0.3)
    _save(fig, path)


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}")


PLOTS = [
    ("concurrency.json", throughput_vs_concurrency, "throughput_vs_concurrency.png"),
    ("prefix_cache.json", ttft_prefix_cache, "ttft_prefix_cache.png"),
    ("spec_decode.json", spec_speedup_vs_batch, "spec_speedup_vs_batch.png"),
    ("batch1_decode.json", decode_vs_batch, "decode_vs_batch.png"),
]


def main(argv: list[str] | None = None) -> list[Path]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", type=Path, nargs="?", default=HERE / "results")
    ap.add_argument("--out", type=Path, default=None, help="where the PNGs go (default: RESULTS/plots)")
    args = ap.parse_args(argv)
    out = args.out or args.results / "plots"
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for source, draw, name in PLOTS:
        src = args.results / source
        if not src.exists():
            print(f"skipped {name}: no {src}")
            continue
        draw(json.loads(src.read_text()), out / name)
        written.append(out / name)
    return written


if __name__ == "__main__":
    main()
