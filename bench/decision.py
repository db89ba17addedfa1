"""Routing and cascades on the embedded family's eval set: how much of the large model's quality
each keeps, and with what share of the large model's tokens.

    python bench/decision.py [--out bench/results/decision.json]

The embedded pair is served on loopback (`pyserve serve`, no model: pyserve-default and
pyserve-default-draft). Each generating item of pyserve/eval/data/embedded.jsonl runs on both
models as `pyserve eval` runs it (the same client and scorers); the draft's answer is also asked
for once more, not streamed, with its token logprobs, which give a cascade's confidence (the
mean logprob of the answer's first line, server.decision.confidence).

- router: `pyserve route-train`'s classifier, cross-validated (each item routed by a router that
  did not see it), for several shares of large-model calls;
- cascade: for several MIN_LOGPROB thresholds, an item escalates when the draft's confidence is
  below it; its figures (and large-model token shares) from the per-item scores of the
  generating items; and the threshold a user would pick, by either of two rules (the fewest
  large-model tokens at 95% of its quality; the best quality with half its tokens), chosen
  without the item it decides (leave-one-out), since the best of the thresholds on the same
  items flatters the cascade;
- then the whole eval set (the loglikelihood items too) through `pyserve eval` configurations:
  the draft, the target, and each cascade served (`--cascade`).

Quality is the mean item score; large tokens are the large model's output tokens for the items
it answers, as a share of its tokens on every item.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

import httpx
import numpy as np

from pyserve.default_model import DEFAULT_MODEL_NAME
from pyserve.embeddings.packaged import PackagedEncoder
from pyserve.eval.configs import CascadeConfig, EvalConfig, EvalPlan
from pyserve.eval.harness import run_plan
from pyserve.eval.items import load_eval_set
from pyserve.eval.runner import Client, run_items
from pyserve.model_choice.train import routed_figures, train_classifier
from pyserve.server.completion_result import choice_tokens
from pyserve.server.decision import confidence
from pyserve.server.child_server import start_server, stop_server
from pyserve.server.model_specs import DRAFT_MODEL_NAME

DATA = Path(__file__).resolve().parents[1] / "pyserve" / "eval" / "data" / "embedded.jsonl"
SHARES = (0.3, 0.4, 0.5)


async def model_scores(base: str, items: list, names: tuple[str, ...]) -> dict:
    """Each served model's score and output tokens per item, as `pyserve eval` runs the items."""
    out = {}
    for name in names:
        client = Client(base, EvalConfig(name=name), name)
        results = await run_items(client, items, 4)
        await client.close()
        out[name] = {r.id: {"id": r.id, "score": r.score.value, "output_tokens": r.timing.output_tokens}
                     for r in results}
    return out


async def per_item(base: str, items: list) -> dict:
    out = await model_scores(base, items, (DRAFT_MODEL_NAME, DEFAULT_MODEL_NAME))
    client = Client(base, EvalConfig(name="confidence"), DRAFT_MODEL_NAME)
    conf = {}
    async with httpx.AsyncClient(base_url=base, timeout=600) as http:
        for item in items:
            body = client._sampling(item) | {"stream": False, "logprobs": 0, "prompt": item.prompt}
            body.pop("stream_options")
            r = await http.post("/v1/completions", json=body)
            conf[item.id] = confidence(choice_tokens(r.json()["choices"][0]))
    await client.close()
    return {"scores": out, "confidence": conf}


def cascade_figures(ids, small, large, conf, threshold) -> dict:
    s = np.array([small[i]["score"] for i in ids])
    g = np.array([large[i]["score"] for i in ids])
    up = np.array([conf[i] < threshold for i in ids])
    return {"min_logprob": round(float(threshold), 4),
            **routed_figures(s, g, up, [large[i]["output_tokens"] for i in ids])}


def cascade_cross_validated(ids, small, large, conf, rule: str) -> dict:
    """Each item escalates by the threshold chosen on the other items, among the midpoints
    between their confidences, by `rule`: "quality_floor", the fewest large-model tokens at >= 95%
    of the large model's quality there; "token_budget", the best quality there with at most
    half the large model's tokens. The figures of those decisions over all the items."""
    s = np.array([small[i]["score"] for i in ids])
    g = np.array([large[i]["score"] for i in ids])
    c = np.array([conf[i] for i in ids])
    tokens = np.array([large[i]["output_tokens"] for i in ids], dtype=float)
    cuts = np.unique(c)
    candidates = np.concatenate([[cuts[0] - 1], (cuts[1:] + cuts[:-1]) / 2, [cuts[-1] + 1]])
    up = np.zeros(len(ids), dtype=bool)
    for k in range(len(ids)):
        rest = np.arange(len(ids)) != k
        best = None
        for t in candidates:
            esc = c[rest] < t
            quality = np.where(esc, g[rest], s[rest]).mean() / max(g[rest].mean(), 1e-12)
            share = tokens[rest][esc].sum() / tokens[rest].sum()
            if rule == "quality_floor" and quality >= 0.95 and (best is None or share < best[1]):
                best = (t, share)
            elif rule == "token_budget" and share <= 0.5 and (best is None or quality > best[1]):
                best = (t, quality)
        up[k] = c[k] < best[0]
    return routed_figures(s, g, up, tokens.tolist())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    every = load_eval_set(DATA)
    items = [i for i in every if i.generates and i.prompt is not None]
    with tempfile.TemporaryDirectory() as tmp:
        proc, base = start_server(None, workdir=Path(tmp))
        try:
            data = asyncio.run(per_item(base, items))
        finally:
            stop_server(proc)
    small, large = data["scores"][DRAFT_MODEL_NAME], data["scores"][DEFAULT_MODEL_NAME]
    ids = [i.id for i in items if small[i.id]["score"] is not None]
    prompts = {i.id: i.prompt for i in items}
    encoder = PackagedEncoder()
    routers = {}
    for share in SHARES:
        _, figures = train_classifier(encoder, prompts, {i: small[i] for i in ids}, {i: large[i] for i in ids},
                                      DRAFT_MODEL_NAME, DEFAULT_MODEL_NAME, share)
        routers[str(share)] = figures
    conf = data["confidence"]
    thresholds = sorted({float(np.quantile([conf[i] for i in ids], q)) for q in (0.2, 0.3, 0.4, 0.5, 0.6, 0.8)})
    cascades = [cascade_figures(ids, small, large, conf, t) for t in thresholds]
    ok = [c for c in cascades if (c["quality_vs_large"] or 0) >= 0.95]
    chosen = min(ok, key=lambda c: c["large_tokens_share"]) if ok else max(cascades, key=lambda c: c["quality_routed"])
    plan = EvalPlan(configs=[EvalConfig(name="draft", model="embedded:draft"),
                             EvalConfig(name="target", model="embedded:target"),
                             *(EvalConfig(name=f"cascade{c['min_logprob']}",
                                          cascade=CascadeConfig(min_logprob=c["min_logprob"])) for c in cascades)])
    with tempfile.TemporaryDirectory() as tmp:
        reports = run_plan(plan, every, Path(tmp), 1, lambda: None)
    served_all = {r.name: {"quality": r.quality, "ci95": [r.ci_low, r.ci_high], "status": r.status,
                           "output_tokens": r.output_tokens} for r in reports}
    served = next(r for r in reports if r.name == f"cascade{chosen['min_logprob']}")
    report = {"items": len(ids), "quality_small": routers[str(SHARES[0])]["quality_small"],
              "quality_large": routers[str(SHARES[0])]["quality_large"], "router_cross_validated": routers,
              "cascade_offline": cascades, "cascade_chosen": chosen,
              "cascade_cross_validated": {rule: cascade_cross_validated(ids, small, large, conf, rule)
                                          for rule in ("quality_floor", "token_budget")},
              "every_item_served": served_all,
              "per_item": {i: {"small": small[i]["score"], "large": large[i]["score"], "confidence": conf[i],
                               "large_tokens": large[i]["output_tokens"]} for i in ids}}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(f"\ncascade at {chosen['min_logprob']}: {chosen['quality_vs_large']:.0%} of the large model's quality "
          f"with {chosen['large_tokens_share']:.0%} of its tokens (served: quality {served.quality}); "
          "its threshold chosen leave-one-out, " + ", ".join(
              f"{rule}: {cv['quality_vs_large']:.1%} with {cv['large_tokens_share']:.1%}"
              for rule, cv in report["cascade_cross_validated"].items()), file=sys.stderr)


if __name__ == "__main__":
    main()
