"""The replicas' /v1/stats as one document of the same shape, so the dashboard served by the
router reads every replica at once: counts are summed (requests, latency histogram buckets,
route requests, embedded inputs), each replica's engines are listed under `NAME@URL`, and each
replica's semantic-cache figures under its URL."""

from __future__ import annotations


def merge_stats(stats: dict[str, dict]) -> dict:
    """`stats`: replica URL -> its /v1/stats body. A latency histogram whose bucket bounds differ
    from the first replica's (another pyserve version) is left out of the sum."""
    models: dict[str, dict] = {}
    requests: dict[str, dict[str, float]] = {}
    latency: dict[str, dict] = {}
    routes: dict[str, dict] = {}
    caches: dict[str, dict] = {}
    embedded = 0.0
    for url, s in stats.items():
        for name, engine in s.get("models", {}).items():
            models[f"{name}@{url}"] = engine
        for model, adapters in s.get("requests", {}).items():
            merged = requests.setdefault(model, {})
            for adapter, n in adapters.items():
                merged[adapter] = merged.get(adapter, 0) + n
        for name, h in s.get("latency", {}).items():
            total = latency.setdefault(name, {"le": h["le"], "counts": [0] * len(h["counts"]), "count": 0, "sum": 0.0})
            if h["le"] != total["le"]:
                continue
            total["counts"] = [a + b for a, b in zip(total["counts"], h["counts"], strict=True)]
            total["count"] += h["count"]
            total["sum"] += h["sum"]
        for name, r in s.get("routes", {}).items():
            merged = routes.setdefault(name, {**r, "requests": dict.fromkeys(r["requests"], 0), "escalations": 0})
            for model, n in r["requests"].items():
                merged["requests"][model] = merged["requests"].get(model, 0) + n
            merged["escalations"] += r["escalations"]
        if s.get("semantic_cache") is not None:
            caches[url] = s["semantic_cache"]
        embedded += s.get("embedding_inputs", 0)
    for r in routes.values():
        total = sum(r["requests"].values())
        r["large_share"] = r["requests"].get(r["large"], 0) / total if total else None
    return {"models": models, "requests": requests, "latency": latency, "routes": routes,
            "semantic_cache": caches or None, "embedding_inputs": embedded, "replicas": list(stats)}
