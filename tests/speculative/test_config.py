"""SpeculativeConfig.parse: errors name the key; the n-gram defaults."""

from __future__ import annotations

import pytest

from pyserve.speculative.config import SpeculativeConfig


def test_config_errors_name_the_key(tmp_path):
    for raw, key in [({"method": "medusa"}, "method"), ({"method": "ngram", "num_speculative_tokens": 0},
                     "num_speculative_tokens"), ({"method": "ngram", "k": 2}, "k"),
                     ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_max"),
                     ({"method": "draft_model", "model": str(tmp_path)}, "model"), ("{", "speculative_config")]:
        with pytest.raises(ValueError, match=key):
            SpeculativeConfig.parse(raw)
    cfg = SpeculativeConfig.parse('{"method": "ngram"}')
    assert (cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (4, 1, 4)


def test_vllms_older_ngram_spelling_and_a_draft_model_without_one_say_what_to_write():
    with pytest.raises(ValueError, match=r'spelled "method": "ngram" here \(not "model": "\[ngram\]"\)'):
        SpeculativeConfig.parse({"model": "[ngram]", "num_speculative_tokens": 4})
    with pytest.raises(ValueError, match="draft_model needs the draft model \\(a directory, a GGUF file or a hub id\\)"):
        SpeculativeConfig.parse({"method": "draft_model"})


def test_a_depth_the_user_gives_is_fixed_unless_adaptive_is_asked_for():
    assert SpeculativeConfig.parse({"method": "ngram"}).adaptive
    fixed = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4})
    assert (fixed.num_speculative_tokens, fixed.adaptive) == (4, False)
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4, "adaptive": True}).adaptive
    assert not SpeculativeConfig.parse({"method": "ngram", "adaptive": False}).adaptive
