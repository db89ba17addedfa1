"""vLLM's LLM keywords: those with pyserve's meaning are taken (renamed where pyserve names them
otherwise), the rest refused with a message naming pyserve's equivalent or why there is none."""

from __future__ import annotations

import pytest

from pyserve import LLM, SamplingParams


def test_vllms_keywords_with_pyserves_meaning_build_the_engine(llama_dir):
    with LLM(str(llama_dir), trust_remote_code=True, enforce_eager=True, max_num_seqs=3, dtype="float",
             num_gpu_blocks_override=40, block_size=4, swap_space=0, tokenizer_mode="auto", tokenizer=None,
             enable_chunked_prefill=True, disable_log_stats=True, seed=7) as llm:
        config = llm.engine.config
        assert (config.enforce_eager, config.max_num_seqs, config.dtype, config.num_kv_blocks, config.seed) == (
            True, 3, "float32", 40, 7)
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("keyword, value, message", [
    ("gpu_memory_utilization", 0.9, "gpu_memory_utilization: not served by pyserve .*gpu_memory_fraction"),
    ("swap_space", 4, "swap_space: .*preempts by recomputing"),
    ("cpu_offload_gb", 2, "cpu_offload_gb: .*every weight on the device"),
    ("tokenizer", "other/tokenizer", "tokenizer: .*tokenizer.json"),
    ("pipeline_parallel_size", 2, "pipeline_parallel_size: .*tensor_parallel_size"),
    ("kv_cache_dtype", "fp8", "kv_cache_dtype: .*serving dtype"),
    ("enable_chunked_prefill", False, "enable_chunked_prefill: .*max_num_batched_tokens"),
    ("quantization", "awq", "quantization: 'awq' .*leave quantization unset"),
])
def test_vllms_keywords_pyserve_does_not_serve_say_why(llama_dir, keyword, value, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(llama_dir), **{keyword: value})


def test_an_unknown_keyword_lists_pyserves(llama_dir):
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_num_sequences' .*max_num_seqs"):
        LLM(str(llama_dir), max_num_sequences=4)
    with pytest.raises(TypeError, match="num_gpu_blocks_override and num_kv_blocks are the same setting"):
        LLM(str(llama_dir), num_gpu_blocks_override=8, num_kv_blocks=8)
