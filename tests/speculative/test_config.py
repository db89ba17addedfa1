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


def test_a_depth_the_user_gives_is_fixed_unless_adaptive_is_asked_for():
    assert SpeculativeConfig.parse({"method": "ngram"}).adaptive
    fixed = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4})
    assert (fixed.num_speculative_tokens, fixed.adaptive) == (4, False)
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4, "adaptive": True}).adaptive
    assert not SpeculativeConfig.parse({"method": "ngram", "adaptive": False}).adaptive
