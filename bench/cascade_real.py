"""Cascades and routes with a real pair: Qwen2.5-Coder-0.5B-Instruct first, the 1.5B when the
0.5B is unsure, on HumanEval (their Q4_K_M files, greedy, `pyserve eval`'s prompts and sandboxed
checker): how much of the 1.5B's pass@1 a cascade keeps, and with what share of its tokens.

    python bench/cascade_real.py [--limit N] [--scores EARLIER.json] [--out bench/results/cascade_real.json]

One pyserve server holds both models (`--model small=FILE`). Each problem runs on both as
`pyserve eval` runs it (`--scores`: the per-item scores of an earlier report instead, only the
confidence pass runs); the 0.5B's answer is asked for once more, not streamed, with its token
logprobs, which give the confidence signals:
- served: the served cascade's (server.decision.confidence: for these answers, which open a
  code fence, the mean logprob of the fenced block's tokens);
- first_line: the mean logprob of the answer's first line (the fence line itself here), the
  served rule before code blocks were told apart;
- answer: the mean logprob of the whole answer;
- min_code: the lowest token logprob in the fenced block.
For each, thresholds chosen leave-one-out by bench/decision.py's two rules (the fewest large
tokens at >= 95% of the 1.5B's pass@1; the best pass@1 with <= half its tokens), and the router
(`pyserve route-train`'s classifier over the packaged encoder) cross-validated.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
from pathlib import Path

import httpx
import numpy as np

import harness
from decision import cascade_cross_validated, model_scores
from pyserve.embeddings.packaged import PackagedEncoder
from pyserve.eval.configs import EvalConfig
from pyserve.eval.humaneval import humaneval_items
from pyserve.eval.runner import Client
from pyserve.model_choice.train import train_classifier
from pyserve.server.child_server import start_server, stop_server
from pyserve.server.completion_result import choice_tokens
from pyserve.server.decision import confidence
from pyserve.testing.real_models import fetch

SMALL, LARGE = "small", "large"
SHARES = (0.3, 0.5)
RULES = ("quality_floor", "token_budget")
FENCE = re.compile(r"```[^\n]*\n(.*?)(?:```|$)", re.S)


def signals(tokens: list[tuple[str, float | None]]) -> dict[str, float]:
    """The 0.5B answer's confidence signals from its (token text, logprob) pairs."""
    values = np.array([v for _, v in tokens if v is not None], dtype=float)
    text, starts = "", []
    for t, _ in tokens:
        starts.append(len(text))
        text += t
    block = FENCE.search(text)
    lo, hi = (block.start(1), block.end(1)) if block else (0, len(text))
    in_code = np.array([v for (_, v), s in zip(tokens, starts) if v is not None and lo <= s < hi], dtype=float)
    line_end = next((i for i, (t, _) in enumerate(tokens) if "\n" in t and text[: starts[i] + t.index("\n")].strip()),
                    len(tokens) - 1)
    first_line = [v for _, v in tokens[: line_end + 1] if v is not None]
    return {"served": confidence(tokens), "first_line": float(np.mean(first_line)) if first_line else float("-inf"),
            "answer": float(values.mean()) if len(values) else float("-inf"),
            "min_code": float(in_code.min()) if len(in_code) else float("-inf")}


async def small_confidence(base: str, items: list) -> dict:
    client = Client(base, EvalConfig(name="confidence"), SMALL)
    conf = {}
    async with httpx.AsyncClient(base_url=base, timeout=600) as http:
        for item in items:
            body = client._sampling(item) | {"stream": False, "logprobs": True, "messages": item.messages}
            body.pop("stream_options")
            r = await http.post("/v1/chat/completions", json=body)
            conf[item.id] = signals(choice_tokens(r.json()["choices"][0]))
    await client.close()
    return conf


def earlier_scores(path: Path) -> dict:
    per_item = json.loads(path.read_text())["per_item"]
    return {SMALL: {i: {"id": i, "score": v["small"]} for i, v in per_item.items()},
            LARGE: {i: {"id": i, "score": v["large"], "output_tokens": v["large_tokens"]} for i, v in per_item.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--limit", type=int, default=None, help="the first N problems only")
    p.add_argument("--scores", default=None, help="an earlier report whose per-item scores to reuse")
    p.add_argument("--out", default="bench/results/cascade_real.json")
    args = p.parse_args()
    harness.print_header(harness.header(__file__))
    items = humaneval_items()[: args.limit]
    small_file, large_file = fetch("qwen2.5-coder-0.5b-instruct"), fetch("qwen2.5-coder-1.5b-instruct")
    scores = earlier_scores(Path(args.scores)) if args.scores else None
    with tempfile.TemporaryDirectory() as tmp:
        if scores is None:
            proc, base = start_server(large_file, "--served-model-name", LARGE, "--model", f"{SMALL}={small_file}",
                                      workdir=Path(tmp))
        else:
            proc, base = start_server(small_file, "--served-model-name", SMALL, workdir=Path(tmp))
        try:
            scores = scores or asyncio.run(model_scores(base, items, (SMALL, LARGE)))
            confidences = asyncio.run(small_confidence(base, items))
        finally:
            stop_server(proc)
    small, large = scores[SMALL], scores[LARGE]
    ids = [i.id for i in items if small[i.id]["score"] is not None and large[i.id]["score"] is not None]
    cascades = {}
    for signal in ("served", "first_line", "answer", "min_code"):
        conf = {i: confidences[i][signal] for i in ids}
        cascades[signal] = {rule: cascade_cross_validated(ids, small, large, conf, rule) for rule in RULES}
    prompts = {i.id: i.messages[-1]["content"] for i in items}
    encoder, routers = PackagedEncoder(), {}
    for share in SHARES:
        _, figures = train_classifier(encoder, prompts, {i: small[i] for i in ids}, {i: large[i] for i in ids},
                                      SMALL, LARGE, share)
        routers[str(share)] = figures
    report = harness.header(__file__) | {
        "items": len(ids),
        "pass_at_1": {"small": float(np.mean([small[i]["score"] for i in ids])),
                      "large": float(np.mean([large[i]["score"] for i in ids]))},
        "large_tokens": int(sum(large[i]["output_tokens"] for i in ids)),
        "cascade_cross_validated": cascades, "router_cross_validated": routers,
        "per_item": {i: {"small": small[i]["score"], "large": large[i]["score"],
                         "large_tokens": large[i]["output_tokens"], **confidences[i]} for i in ids}}
    harness.write_report(Path(args.out), report)
    print(f"{len(ids)} problems: pass@1 0.5B {report['pass_at_1']['small']:.1%}, 1.5B {report['pass_at_1']['large']:.1%}")
    for signal, by_rule in cascades.items():
        print(f"cascade on {signal}: " + "; ".join(
            f"{rule}: {f['quality_vs_large']:.1%} of the 1.5B's pass@1 with {f['large_tokens_share']:.1%} of its tokens"
            for rule, f in by_rule.items()))
    for share, f in routers.items():
        print(f"router at share {share}: {f}")


if __name__ == "__main__":
    main()
