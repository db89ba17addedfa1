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
