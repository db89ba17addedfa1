"""The semantic cache calibrated on all-MiniLM-L6-v2 (`--embedding-model DIR --semantic-cache`):
the threshold comes from MiniLM's own similarities on the shipped calibration pairs, paraphrases
score above it, and questions about another thing (which the guards admit) below it."""

from __future__ import annotations

import pytest

from pyserve.embeddings.load import load_encoder
from pyserve.semantic_cache.calibration import NEVER, calibrate_encoder, pair_similarities

PARAPHRASES = [("How do I reverse a list in Python?", "How can I reverse a Python list?"),
               ("What is the boiling point of water at sea level?",
                "At sea level, what temperature does water boil at?"),
               ("How long should I boil an egg for a soft yolk?",
                "How many minutes to boil an egg so the yolk stays soft?")]
OTHER_QUESTIONS = [("How do I reverse a list in Python?", "How do I flatten a nested list in Python?"),
                   ("What is the boiling point of water at sea level?", "What is the freezing point of salt water?")]


@pytest.fixture(scope="module")
def encoder(minilm):
    return load_encoder(str(minilm))


def test_the_threshold_is_calibrated_on_minilms_own_similarities(encoder):
    calibration = calibrate_encoder(encoder, 0.01)
    assert calibration.negatives == 837
    assert 0.75 < calibration.threshold < 0.9  # 0.823 measured; WordLlama's is 0.817
    assert calibration.positives_hit > 0.4  # share of the shipped paraphrase pairs that hit
    assert calibrate_encoder(encoder, 0.05).threshold < calibration.threshold  # a looser bound, a lower bar

    def sims(pairs):
        return pair_similarities(encoder, [{"a": a, "b": b} for a, b in pairs])

    paraphrases, others = sims(PARAPHRASES), sims(OTHER_QUESTIONS)
    assert (paraphrases >= calibration.threshold).all(), paraphrases
    assert (others > NEVER).all(), others  # the guards admit them: only the threshold holds them off
    assert (others < calibration.threshold - 0.1).all(), others
