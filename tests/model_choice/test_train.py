"""A route's classifier trained from eval scores (pyserve/model_choice/train.py) and saved by
`pyserve route-train`; how a route serves with it: tests/server/test_decision.py."""

from __future__ import annotations

import json

import numpy as np

from pyserve.cli import main
from pyserve.embeddings.encoder import embed_texts
from pyserve.embeddings.packaged import NAME as ENCODER, PackagedEncoder
from pyserve.model_choice.classifier import RouteClassifier
from pyserve.model_choice.train import train_classifier


def test_a_classifier_trained_from_scores_routes_the_items_the_large_model_wins(tmp_path):
    """The large model wins exactly the sorting questions: the cross-validated classifier sends them
    there and recovers the large model's quality with half the calls; route-train writes it."""
    topics = ["sort a list", "sort numbers", "sort strings by length", "sort a dictionary by value"]
    others = ["bake bread", "plant tomatoes", "paint a fence", "tune a guitar"]
    prompts, small, large = {}, {}, {}
    for i in range(40):
        sorting = i % 2 == 0
        text = f"How do I {(topics if sorting else others)[i // 2 % 4]}? ({i})"
        prompts[f"i{i}"] = text
        small[f"i{i}"] = {"id": f"i{i}", "score": 0.0 if sorting else 1.0, "output_tokens": 10}
        large[f"i{i}"] = {"id": f"i{i}", "score": 1.0, "output_tokens": 10}
    classifier, figures = train_classifier(PackagedEncoder(), prompts, small, large, "s", "l", large_share=0.5)
    assert figures["quality_routed"] == figures["quality_large"] == 1.0 and figures["recovered"] == 1.0
    assert 0.4 <= figures["large_calls"] == figures["large_tokens_share"] <= 0.6  # per-fold quantiles
    vec = embed_texts(PackagedEncoder(), ["How do I sort a list?", "How do I bake bread?"])
    assert [classifier.choose(v) for v in vec] == ["l", "s"]
    items = tmp_path / "items.jsonl"
    items.write_text("".join(json.dumps({"id": k, "prompt": v, "scorer": "exact", "reference": "x"}) + "\n"
                             for k, v in prompts.items()))
    eval_json = tmp_path / "eval.json"
    eval_json.write_text(json.dumps({"configs": [{"name": "small", "results": list(small.values())},
                                                 {"name": "large", "results": list(large.values())}]}))
    out = tmp_path / "router.json"
    main(["route-train", "--eval", str(eval_json), "--data", str(items), "--small", "small", "--large", "large",
          "--small-model", "s", "--large-model", "l", "--large-share", "0.5", "--out", str(out)])
    saved = RouteClassifier.load(out)
    tied = {k: dict(v, score=1.0) for k, v in small.items()}  # the small model is never beaten
    never, figures = train_classifier(PackagedEncoder(), prompts, tied, large, "s", "l", large_share=0.5)
    assert figures["large_calls"] == 0 and {never.choose(v) for v in vec} == {"s"}
    assert (saved.small, saved.large, saved.encoder) == ("s", "l", ENCODER)
    assert np.allclose(saved.weights, classifier.weights) and saved.trained_on["recovered"] == 1.0
