"""Tensor parallelism over two gloo ranks on the CPU (one thread each): the same greedy tokens as
transformers and as one rank, through chunked prefill, prefix reuse, forked samples (KV block
copies), n-gram speculation, LoRA adapters and weights quantized at load; bad sizes refused
naming the field."""

from __future__ import annotations

import pytest

from pyserve import LLM, LoRARequest, SamplingParams
from pyserve.testing import MAX_TOKENS, assert_parity, build_model, hf_greedy, make_adapter, prompts
from pyserve.testing.tiny_gguf import LLAMA_ROPE, gguf_from_hf

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_two_ranks_give_transformers_greedy_tokens(arch, model_dirs):
    ps = prompts(300)
    want = hf_greedy(model_dirs[arch], ps)
    with LLM(str(model_dirs[arch]), tensor_parallel_size=2, block_size=4, num_kv_blocks=256,
             max_num_batched_tokens=16) as llm:  # chunked prefill
        first = llm.generate(ps, GREEDY, use_tqdm=False)
        assert_parity([o.outputs[0].token_ids for o in first], want)
        again = llm.generate(ps, GREEDY, use_tqdm=False)  # from the prefix cache
        assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]
        assert llm.stats()["prefix_cache_hits"] > 0


def test_forks_and_speculation_match_one_rank(model_dirs):
    ps = prompts(300, seed=3)
    forked = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, n=2)
    results = {}
    for size in (1, 2):
        with LLM(str(model_dirs["llama"]), tensor_parallel_size=size, block_size=4, num_kv_blocks=256,
                 speculative_config={"method": "ngram", "num_speculative_tokens": 3}) as llm:
            outs = llm.generate(ps, forked, use_tqdm=False)
            results[size] = [[c.token_ids for c in o.outputs] for o in outs]
    assert results[2] == results[1]
    assert all(a == b for a, b in results[2])  # both greedy samples of a prompt agree


def test_ranks_import_the_installed_package_from_any_directory(model_dirs, tmp_path, monkeypatch):
    """From a folder holding a decoy `pyserve` package (as the repository's root holds its source
    tree), the follower ranks still import the installed one."""
    (tmp_path / "pyserve").mkdir()
    (tmp_path / "pyserve" / "__init__.py").write_text("raise ImportError('the decoy pyserve was imported')\n")
    monkeypatch.chdir(tmp_path)
    ps = prompts(300, seed=5, lengths=(7, 20))
    tokens = {}
    for size in (1, 2):
        with LLM(str(model_dirs["llama"]), tensor_parallel_size=size, block_size=4, num_kv_blocks=64) as llm:
            tokens[size] = [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY, use_tqdm=False)]
    assert tokens[2] == tokens[1]


def test_a_gguf_widened_at_load_splits_over_two_ranks(tmp_path):
    """--gguf-dequantize reaches every rank: each widens the file's 8-bit blocks before its shard is
    cut (a follower that loaded them as they are could not split them and failed the group)."""
    gguf = gguf_from_hf(build_model(tmp_path / "llama", "llama", **LLAMA_ROPE), tmp_path / "m.gguf", projections="Q8_0")
    ps = prompts(300, seed=9, lengths=(7, 20))
    tokens = {}
    for size in (1, 2):
        with LLM(str(gguf), tensor_parallel_size=size, gguf_dequantize=True, block_size=4, num_kv_blocks=64) as llm:
            tokens[size] = [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY, use_tqdm=False)]
    assert tokens[2] == tokens[1]


@pytest.mark.parametrize("size, field", [(3, "num_attention_heads"), (4, "num_key_value_heads")])
def test_a_size_that_does_not_divide_the_model_is_refused(size, field, model_dirs):
    with pytest.raises(ValueError, match=f"tensor_parallel_size {size} does not divide the model's {field}"):
        LLM(str(model_dirs["llama"]), tensor_parallel_size=size)


def test_adapters_split_over_two_ranks_give_one_ranks_tokens(model_dirs, tmp_path):
    base = model_dirs["llama"]
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapters = [LoRARequest(f"a{i}", i, str(make_adapter(base, tmp_path / f"a{i}", 4 * i, targets, seed=i)))
                for i in (1, 2)]
    ps = prompts(300, seed=7)
    per_prompt = [adapters[i % 2] if i % 3 else None for i in range(len(ps))]  # both adapters and the base, batched
    got = {}
    for size in (1, 2):
        with LLM(str(base), tensor_parallel_size=size, enable_lora=True, max_loras=2, block_size=4,
                 num_kv_blocks=256) as llm:
            got[size] = [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY, lora_request=per_prompt,
                                                                       use_tqdm=False)]
    assert got[2] == got[1]
    with LLM(str(base), block_size=4, num_kv_blocks=256) as llm:  # the adapters change the answers
        plain = [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY, use_tqdm=False)]
    assert sum(a != b for a, b in zip(plain, got[2])) >= 3


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_shards_give_one_ranks_quantized_tokens(method, model_dirs):
    ps = prompts(300, seed=5)
    got = {}
    for size in (1, 2):
        with LLM(str(model_dirs["llama"]), tensor_parallel_size=size, quantization=method,
                 quantization_group_size=32) as llm:
            assert llm.stats()["quantization"] == method
            got[size] = [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY, use_tqdm=False)]
    assert got[2] == got[1]


def test_an_int4_group_across_two_ranks_is_refused(model_dirs):
    # o_proj has 64 inputs: 32 per rank, fewer than a group of 64
    with pytest.raises(ValueError, match="quantization_group_size 64 does not divide model.layers.0.self_attn.o_proj"):
        LLM(str(model_dirs["llama"]), tensor_parallel_size=2, quantization="int4", quantization_group_size=64)
