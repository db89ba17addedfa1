"""The threshold for one encoder, from the shipped calibration pairs (calibration_set.py): the
similarities of the negative pairs the guards do not already tell apart, calibrated to the
error bound (threshold.py); a negative its guards tell apart can never hit."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pyserve.embeddings.encoder import Encoder, embed_texts
from pyserve.semantic_cache.guard import guard_of
from pyserve.semantic_cache.question import conversation_text, question_text
from pyserve.semantic_cache.threshold import calibrate

PAIRS = Path(__file__).resolve().parent / "data" / "calibration.jsonl"
NEVER = -2.0  # below any cosine similarity


@dataclass(slots=True)
class Calibration:
    threshold: float
    negatives: int
    positives_hit: float  # share of the positive pairs that hit at the threshold


def pair_similarities(encoder: Encoder, pairs: list[dict]) -> np.ndarray:
    """Each pair's similarity as the cache sees it (NEVER where the guards tell them apart)."""
    def texts(side: str) -> list[str]:
        return [question_text(conversation_text([("user", p[side])])) for p in pairs]

    a, b = (embed_texts(encoder, texts(side)) for side in ("a", "b"))
    sims = (a * b).sum(axis=1)
    apart = np.array([not guard_of(conversation_text([("user", p["a"])])).admits(
        guard_of(conversation_text([("user", p["b"])]))) for p in pairs])
    return np.where(apart, NEVER, sims)


def calibration_pairs(path: Path = PAIRS) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def calibrate_encoder(encoder: Encoder, error_bound: float, path: Path = PAIRS) -> Calibration:
    pairs = calibration_pairs(path)
    sims = pair_similarities(encoder, pairs)
    same = np.array([p["same"] for p in pairs])
    threshold = calibrate(sims[~same].tolist(), error_bound)
    if threshold is None:
        raise ValueError(f"semantic_cache_error_bound: {error_bound} cannot be shown with {int((~same).sum())} "
                         f"calibration pairs (95% confidence); give a larger bound")
    return Calibration(threshold, int((~same).sum()), float((sims[same] >= threshold).mean()))
