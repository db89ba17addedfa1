"""The semantic cache's bench: wrong hits and paraphrase hits on the bench's own pairs, lookup
time with 100k entries in one scope, cross-tenant hits, and the time a hit takes to answer.

    python bench/semantic_cache.py [--entries 100000] [--embedding-model DIR] [--out FILE.json]

1. Pairs (bench/semantic_cache_pairs.py): each pair's first question stored in a scope of its
   own, the second looked up, as the server does (its conversation's content words embedded by
   the packaged WordLlama model or `--embedding-model`'s, guards compared, the threshold calibrated to 1% on the shipped
   calibration pairs). A trick that hits is a wrong hit; rates with 95% Clopper-Pearson intervals.
   The same for other error bounds (`--semantic-cache-error-bound`). Beside it, one global
   cosine threshold of 0.8 on the same model's embedding of the whole
   text, no guards (GPTCache's default threshold), on the same pairs.
2. Lookups: `--entries` synthetic questions in one scope (usearch index), then lookups of other
   questions; the index search and checks timed (p50, p99), the embedding apart. Then the same
   texts looked up under another tenant's scope: hits must be 0.
3. Hits over HTTP: the embedded model served in process with the cache; one answer stored, then
   hits timed from the request to the body (an upper bound on the server-side time), cold (the
   first) and warm.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from semantic_cache_pairs import FAMILIES, bench_pairs  # noqa: E402

from pyserve.embeddings.encoder import embed_texts  # noqa: E402
from pyserve.embeddings.load import load_encoder  # noqa: E402
from pyserve.semantic_cache.guard import guard_of  # noqa: E402
from pyserve.semantic_cache.calibration import calibrate_encoder, calibration_pairs  # noqa: E402
from pyserve.semantic_cache.question import conversation_text, question_text  # noqa: E402
from pyserve.semantic_cache.store import SemanticStore  # noqa: E402
from pyserve.semantic_cache.threshold import binomial_upper_bound  # noqa: E402

GPTCACHE_THRESHOLD = 0.8
TRADE_OFF_BOUNDS = (0.01, 0.02, 0.05, 0.1)


def interval(k: int, n: int) -> list[float]:
    """Two-sided 95% Clopper-Pearson interval of k/n."""
    low = 0.0 if k == 0 else 1.0 - binomial_upper_bound(n - k, n, 0.975)
    return [round(low, 4), round(binomial_upper_bound(k, n, 0.975), 4)]


def conversation(text: str) -> str:
    return conversation_text([("user", text)])


def pair_rates(encoder, threshold: float) -> dict:
    pairs = bench_pairs()
    store = SemanticStore(encoder.dim, ttl=1e9, max_entries=10 ** 7, max_bytes=1 << 40)
    a = embed_texts(encoder, [question_text(conversation(p["a"])) for p in pairs])
    b = embed_texts(encoder, [question_text(conversation(p["b"])) for p in pairs])
    raw_a = embed_texts(encoder, [p["a"] for p in pairs])
    raw_b = embed_texts(encoder, [p["b"] for p in pairs])
    tally: dict[str, list[int]] = {}
    baseline: dict[str, list[int]] = {}
    admitted: dict[str, int] = {}
    for i, p in enumerate(pairs):
        guard_a, guard_b = guard_of(conversation(p["a"])), guard_of(conversation(p["b"]))
        store.insert(str(i), a[i], guard_a, b"answer", "t", "m", threshold)
        hit = store.lookup(str(i), b[i], guard_b).entry is not None
        admits = guard_a.admits(guard_b)
        kinds = [p["kind"]] + (["tricks"] if p["kind"] in ("number", "name", "negation") else [])
        for kind in kinds:
            tally.setdefault(kind, [0, 0])
            baseline.setdefault(kind, [0, 0])
            tally[kind][0] += hit
            tally[kind][1] += 1
            admitted[kind] = admitted.get(kind, 0) + admits
            baseline[kind][0] += float(raw_a[i] @ raw_b[i]) >= GPTCACHE_THRESHOLD
            baseline[kind][1] += 1

    def table(counts, guards=False):
        return {k: {"hits": h, "pairs": n, "rate": round(h / n, 4), "ci95": interval(h, n),
                    **({"admitted_by_guards": admitted[k]} if guards else {})} for k, (h, n) in counts.items()}

    return {"pyserve": table(tally, guards=True), "global_0.8_no_guard": table(baseline), "families": len(FAMILIES)}


def one_word_apart(encoder) -> dict:
    """The shipped calibration pairs that only the one-word rule refuses (same anchors, content
    words one word replaced), whatever their similarity: how the encoder scores them, so whether a
    threshold of their own could let the paraphrases among them through."""
    def refused_for_one_word(p: dict) -> bool:
        a, b = guard_of(conversation(p["a"])), guard_of(conversation(p["b"]))
        return a.anchors == b.anchors and a.one_word_apart(b)

    pairs = [p for p in calibration_pairs() if refused_for_one_word(p)]
    a = embed_texts(encoder, [question_text(conversation(p["a"])) for p in pairs])
    b = embed_texts(encoder, [question_text(conversation(p["b"])) for p in pairs])
    sims = (a * b).sum(axis=1)
    same = np.array([p["same"] for p in pairs])
    top_negative = float(sims[~same].max())
    return {"paraphrases": int(same.sum()), "negatives": int((~same).sum()),
            "negatives_max_similarity": round(top_negative, 4),
            "paraphrases_above_every_negative": int((sims[same] > top_negative).sum())}


def synthetic_questions(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = ["price", "river", "engine", "garden", "market", "planet", "recipe", "museum", "battery", "ticket",
             "island", "library", "protein", "voltage", "harbor", "violin", "glacier", "sensor", "lantern", "orchard"]
    out = set()
    while len(out) < count:
        fam = rng.choice(FAMILIES)
        slots = {k: rng.choice(fam[k]) for k in ("n", "m", "name", "topic") if k in fam}
        extra = " ".join(rng.sample(words, 3))
        out.add(rng.choice(fam["phrasings"]).format(**slots) + f" ({extra} {rng.randrange(10 ** 6)})")
    return sorted(out)


def lookups(encoder, entries: int, threshold: float) -> dict:
    texts = synthetic_questions(entries + 2000, seed=5)
    stored, asked = texts[:entries], texts[entries:]
    began = time.perf_counter()
    vectors = embed_texts(encoder, [question_text(conversation(t)) for t in stored])
    embed_s = time.perf_counter() - began
    store = SemanticStore(encoder.dim, ttl=1e9, max_entries=entries, max_bytes=1 << 40)
    began = time.perf_counter()
    for t, v in zip(stored, vectors):
        store.insert("tenant-a", v, guard_of(conversation(t)), b"x" * 200, "a", "m", threshold)
    insert_s = time.perf_counter() - began
    seconds, embed_one = [], []
    for t in asked:
        e0 = time.perf_counter()
        v = embed_texts(encoder, [question_text(conversation(t))])[0]
        embed_one.append(time.perf_counter() - e0)
        seconds.append(store.lookup("tenant-a", v, guard_of(conversation(t))).seconds)
    cross = sum(store.lookup("tenant-b", vectors[i], guard_of(conversation(stored[i]))).entry is not None
                for i in range(0, entries, max(1, entries // 2000)))
    own = sum(store.lookup("tenant-a", vectors[i], guard_of(conversation(stored[i]))).entry is not None
              for i in range(0, entries, max(1, entries // 2000)))
    ms = np.array(seconds) * 1e3
    return {"entries": entries, "embed_all_s": round(embed_s, 2), "insert_all_s": round(insert_s, 2),
            "lookup_ms_p50": round(float(np.percentile(ms, 50)), 3),
            "lookup_ms_p99": round(float(np.percentile(ms, 99)), 3),
            "embed_one_ms_p50": round(float(np.percentile(np.array(embed_one) * 1e3, 50)), 3),
            "stored_texts_looked_up_again": {"own_tenant_hits": int(own), "other_tenant_hits": int(cross),
                                             "lookups": len(range(0, entries, max(1, entries // 2000)))}}


async def http_hits(repeats: int) -> dict:
    import httpx

    from pyserve.default_model import DEFAULT_MODEL_NAME, TARGET_DIR
    from pyserve.testing.in_process import serving_models

    body = {"model": DEFAULT_MODEL_NAME, "messages": [{"role": "user", "content": "Write a function that adds two "
                                                        "numbers."}], "max_tokens": 16, "temperature": 0}
    async with serving_models({DEFAULT_MODEL_NAME: {"model": str(TARGET_DIR)}}, semantic_cache=True) as (_, client):
        client: httpx.AsyncClient
        t0 = time.perf_counter()
        miss = await client.post("/v1/chat/completions", json=body)
        miss_s = time.perf_counter() - t0
        assert miss.headers["x-pyserve-cache"] == "miss", miss.text
        seconds = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            r = await client.post("/v1/chat/completions", json=body)
            seconds.append(time.perf_counter() - t0)
            assert r.headers["x-pyserve-cache"] == "hit"
    ms = np.array(seconds) * 1e3
    return {"miss_ms": round(miss_s * 1e3, 2), "cold_hit_ms": round(float(ms[0]), 3),
            "warm_hit_ms_p50": round(float(np.percentile(ms[1:], 50)), 3),
            "warm_hit_ms_p99": round(float(np.percentile(ms[1:], 99)), 3), "hits": repeats}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--entries", type=int, default=100_000)
    p.add_argument("--http-hits", type=int, default=200)
    p.add_argument("--embedding-model", default="wordllama", help="as the server's --embedding-model")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    encoder = load_encoder(args.embedding_model)
    calibration = calibrate_encoder(encoder, 0.01)
    trade = {}
    for bound in TRADE_OFF_BOUNDS:
        t = calibrate_encoder(encoder, bound).threshold
        rates = pair_rates(encoder, t)["pyserve"]
        trade[str(bound)] = {"threshold": round(t, 4), **{k: rates[k]["rate"] for k in rates}}
    report = {"embedding_model": encoder.name, "threshold": round(calibration.threshold, 4), "calibration_negatives": calibration.negatives,
              "calibration_positives_hit": round(calibration.positives_hit, 4),
              "pairs": pair_rates(encoder, calibration.threshold), "one_word_apart": one_word_apart(encoder),
              "error_bound_trade_off": trade,
              "lookups": lookups(encoder, args.entries, calibration.threshold),
              "http": asyncio.run(http_hits(args.http_hits))}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    tricks = report["pairs"]["pyserve"]["tricks"]
    print(f"\nwrong hits on tricks {tricks['hits']}/{tricks['pairs']} (95% upper {tricks['ci95'][1]:.2%}); "
          f"paraphrases hit {report['pairs']['pyserve']['paraphrase']['rate']:.1%} (the guards admit "
          f"{report['pairs']['pyserve']['paraphrase']['admitted_by_guards']} of "
          f"{report['pairs']['pyserve']['paraphrase']['pairs']}); "
          f"lookup p99 {report['lookups']['lookup_ms_p99']} ms at {args.entries} entries; "
          f"warm hit p50 {report['http']['warm_hit_ms_p50']} ms", file=sys.stderr)


if __name__ == "__main__":
    main()
