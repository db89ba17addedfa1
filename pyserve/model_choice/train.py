"""`pyserve route-train`: a route's classifier from an eval where both models were scored
(`pyserve eval` writes each configuration's per-item scores to eval.json).

The label of an item is 1 when the large model's score beats the small one's. The classifier is
scikit-learn's logistic regression (L2, balanced classes) over the item prompts' embeddings; the
threshold is the quantile of its predictions that sends `large_share` of the items to the large
model. The figures printed are cross-validated (k folds: each item routed by a classifier that
did not see it): the routed quality against each model's, the share of large-model calls and of
large-model tokens, and the recovered quality, (routed - small) / (large - small).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from pyserve.embeddings.encoder import Encoder, embed_texts
from pyserve.model_choice.classifier import RouteClassifier

FOLDS = 5


def eval_scores(eval_json: str | Path, config: str) -> dict[str, dict]:
    """item id -> {score, output_tokens} of one configuration of an eval.json."""
    data = json.loads(Path(eval_json).read_text(encoding="utf-8"))
    for report in data["configs"]:
        if report["name"] == config:
            return {r["id"]: r for r in report["results"] if r.get("score") is not None}
    names = ", ".join(r["name"] for r in data["configs"])
    raise ValueError(f"{eval_json}: no configuration {config!r} (it has {names})")


def _fit(x: np.ndarray, y: np.ndarray):
    from sklearn.linear_model import LogisticRegression

    if len(set(y.tolist())) < 2:  # one class only: a constant predictor
        return None
    return LogisticRegression(C=1.0, class_weight="balanced", max_iter=2000).fit(x, y)


def _predict(model, x: np.ndarray) -> np.ndarray:
    """P(large needed); a constant 0.5 where the labels were all alike (see _threshold)."""
    return np.full(len(x), 0.5) if model is None else model.predict_proba(x)[:, 1]


def _threshold(model, p: np.ndarray, y: np.ndarray, large_share: float) -> float:
    """The quantile of `p` that sends `large_share` above it; where the labels were all alike,
    below or above every prediction (all to the model that was never beaten)."""
    if model is None:
        return -1.0 if y.mean() > 0.5 else 2.0
    return float(np.quantile(p, 1 - large_share))


def train_classifier(encoder: Encoder, prompts: dict[str, str], small: dict[str, dict], large: dict[str, dict],
                     small_name: str, large_name: str, large_share: float,
                     seed: int = 0) -> tuple[RouteClassifier, dict]:
    if not 0 < large_share < 1:
        raise ValueError(f"large_share must be in (0, 1), got {large_share}")
    ids = sorted(set(small) & set(large) & set(prompts))
    if len(ids) < 2 * FOLDS:
        raise ValueError(f"only {len(ids)} items were scored for both models; at least {2 * FOLDS} are needed")
    x = embed_texts(encoder, [prompts[i] for i in ids])
    s = np.array([float(small[i]["score"]) for i in ids])
    g = np.array([float(large[i]["score"]) for i in ids])
    y = (g > s).astype(int)
    # cross-validated predictions: each item by a classifier trained without it
    order = np.random.default_rng(seed).permutation(len(ids))
    held_p = np.zeros(len(ids))
    for fold in range(FOLDS):
        test = order[fold::FOLDS]
        train = np.setdiff1d(order, test)
        model = _fit(x[train], y[train])
        threshold = _threshold(model, _predict(model, x[train]), y[train], large_share)
        held_p[test] = _predict(model, x[test]) - threshold  # > 0: large
    to_large = held_p > 0
    model = _fit(x, y)
    threshold = _threshold(model, _predict(model, x), y, large_share)
    weights = np.zeros(encoder.dim) if model is None else model.coef_[0]
    bias = 0.0 if model is None else float(model.intercept_[0])  # no weights: p = 0.5
    figures = routed_figures(s, g, to_large, [large[i].get("output_tokens", 0) for i in ids])
    trained_on = {"items": len(ids), "large_better": int(y.sum()), **figures}
    classifier = RouteClassifier(small_name, large_name, encoder.name, [float(w) for w in weights], bias,
                                 float(threshold), large_share, trained_on)
    return classifier, figures


def routed_figures(small: np.ndarray, large: np.ndarray, to_large: np.ndarray, large_tokens: list[int]) -> dict:
    routed = np.where(to_large, large, small)
    q_small, q_large, q_routed = float(small.mean()), float(large.mean()), float(routed.mean())
    tokens = np.asarray(large_tokens, dtype=float)
    return {"quality_small": round(q_small, 4), "quality_large": round(q_large, 4),
            "quality_routed": round(q_routed, 4),
            "quality_vs_large": round(q_routed / q_large, 4) if q_large else None,
            "recovered": round((q_routed - q_small) / (q_large - q_small), 4) if q_large != q_small else None,
            "large_calls": round(float(to_large.mean()), 4),
            "large_tokens_share": round(float(tokens[to_large].sum() / tokens.sum()), 4) if tokens.sum() else None}
