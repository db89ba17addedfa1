"""The OutputProcessor: its token-ids-only path and its full (detokenizing) path give the same
tokens; the engine's long-lived objects are frozen out of the garbage collector while it runs."""

from __future__ import annotations

import gc

from pyserve import LLM, SamplingParams


def test_ids_only_outputs_and_text_outputs_agree(llama_dir):
    """The OutputProcessor's fast path (token ids only) and its full path give the same tokens."""
    with LLM(str(llama_dir), device="cpu", num_kv_blocks=64) as llm:
        prompts = [[5, 6, 7, 8], [9, 10, 11]]
        fast = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=9, detokenize=False), use_tqdm=False)
        full = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=9), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in full]
        assert all(len(o.outputs[0].token_ids) == 9 and o.outputs[0].finish_reason == "length" for o in fast)
        assert gc.get_freeze_count() > 0  # the engine's long-lived objects are out of the collector's sight
    assert gc.get_freeze_count() == 0  # and back once it stopped
