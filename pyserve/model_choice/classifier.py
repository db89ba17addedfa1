"""A route's trained classifier (the "router" file of `pyserve route-train` and `--route`):
logistic regression over the embedding of a request's text, predicting that the large model is
needed (it scored better than the small one on such an item); above the threshold, the large
model answers. The threshold was set for a chosen share of large-model calls on the training
items (a classifier trained where one model always won or tied has no weights and a threshold
outside [0, 1]: it always picks that model). Stored as JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np


def routed_text(messages: list[tuple[str, str]]) -> str:
    """What a route's classifier embeds of chat messages, (role, text) pairs: their texts but the
    system prompt's, one per line (a completion's prompt is embedded as it is)."""
    return "\n".join(text for role, text in messages if role not in ("system", "developer"))


@dataclass(slots=True)
class RouteClassifier:
    small: str  # the served model names it chooses between
    large: str
    encoder: str  # the embedding model its weights are for
    weights: list[float]
    bias: float
    threshold: float
    large_share: float  # the share of large-model calls the threshold was set for
    trained_on: dict = field(default_factory=dict)  # where its labels came from, its cross-validated figures

    def p_large(self, vector: np.ndarray) -> float:
        z = float(np.dot(np.asarray(self.weights, dtype=np.float32), vector)) + self.bias
        return 1.0 / (1.0 + np.exp(-z))

    def choose(self, vector: np.ndarray) -> str:
        return self.large if self.p_large(vector) > self.threshold else self.small

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> RouteClassifier:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
        try:
            return cls(**raw)
        except TypeError as e:
            raise ValueError(f"{path}: not a pyserve router ({e})") from e
