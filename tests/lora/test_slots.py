"""Multi-LoRA through the engine: mixed batches (base + adapters of different ranks and target
sets, more adapters than device slots) against transformers on the PEFT-merged models, the
embedded adapters' styles, and the prefix cache namespaced per adapter."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pyserve import LLM, LoRARequest, SamplingParams  # noqa: E402
from pyserve.default_model import ADAPTER_DIRS  # noqa: E402
from pyserve.testing import assert_parity, hf_greedy, prompts  # noqa: E402


def merged(base_dir, adapter_dir, out):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    PeftModel.from_pretrained(base, adapter_dir).merge_and_unload().save_pretrained(out, safe_serialization=True)
    return out


def test_mixed_batch_matches_transformers_on_merged_models(llama_dir, adapters, tmp_path):
    ps = prompts(300, seed=4, lengths=(5, 17, 9, 30, 3, 12, 21, 8))
    names = [None, "all8", "attn4", "mlp16rs", "all8", None, "mlp16rs", "attn4"]
    ids = {name: i + 1 for i, name in enumerate(adapters)}
    reqs = [None if n is None else LoRARequest(n, ids[n], str(adapters[n])) for n in names]
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    with LLM(str(llama_dir), block_size=4, num_kv_blocks=512, enable_lora=True, max_loras=2) as llm:
        outs = llm.generate(ps, greedy, lora_request=reqs, use_tqdm=False)
    refs = {None: llama_dir, **{n: merged(llama_dir, p, tmp_path / n) for n, p in adapters.items()}}
    for name in refs:
        idx = [i for i, n in enumerate(names) if n == name]
        want = hf_greedy(refs[name], [ps[i] for i in idx], max_tokens=10)
        assert_parity([outs[i].outputs[0].token_ids for i in idx], want)
    # The adapters really change the output.
    base_tokens = outs[0].outputs[0].token_ids
    with LLM(str(llama_dir), block_size=4, num_kv_blocks=512, enable_lora=True, max_loras=2) as llm:
        same_prompt = llm.generate([ps[0]] * 4, greedy, use_tqdm=False,
                                   lora_request=[None] + [LoRARequest(n, ids[n], str(p)) for n, p in adapters.items()])
    assert same_prompt[0].outputs[0].token_ids == base_tokens
    assert len({tuple(o.outputs[0].token_ids) for o in same_prompt}) == 4


def test_embedded_adapters_change_the_style():
    chat = [{"role": "user", "content": "Write a Python function: Return the number of lines in the file at path."}]
    greedy = SamplingParams(temperature=0.0, max_tokens=40)
    with LLM(enable_lora=True) as llm:
        outs = [llm.chat(chat, greedy, use_tqdm=False, lora_request=lora)[0].outputs[0].text
                for lora in (None, LoRARequest("docstrings", 1, str(ADAPTER_DIRS["docstrings"])),
                             LoRARequest("tests", 2, str(ADAPTER_DIRS["tests"])))]
    assert outs[0].startswith("def ") and not outs[0].startswith("def test")
    assert outs[1].startswith('"""')
    assert outs[2].startswith("def test")


def test_prefix_cache_is_namespaced_per_adapter(llama_dir, adapters):
    prompt = prompts(300, seed=9, lengths=(24,))[0]
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    a = LoRARequest("all8", 1, str(adapters["all8"]))
    b = LoRARequest("attn4", 2, str(adapters["attn4"]))
    with LLM(str(llama_dir), block_size=4, num_kv_blocks=256, enable_lora=True, max_loras=2) as llm:
        cached = [llm.generate([prompt], one, lora_request=lora, use_tqdm=False)[0].num_cached_tokens
                  for lora in (a, b, None, a, b)]
    assert cached == [0, 0, 0, 23, 23]  # 24 tokens: all but the last (its logits are needed)


def test_the_triton_lora_path_gives_the_torch_tokens_and_its_warm_up_covers_every_launch(llama_dir, adapters):
    """The Triton backend (the interpreter here) with two adapters in one batch: the same greedy
    tokens as the CPU path, and no LoRA kernel variant that LoraSlots.warm_up did not launch."""
    from pyserve.kernels._launch import recording

    ps = prompts(300, seed=5, lengths=(5, 9, 3))
    ids = {name: i + 1 for i, name in enumerate(adapters)}
    reqs = [LoRARequest("all8", ids["all8"], str(adapters["all8"])), None,
            LoRARequest("mlp16rs", ids["mlp16rs"], str(adapters["mlp16rs"]))]
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    config = dict(block_size=4, num_kv_blocks=128, enable_lora=True, max_loras=2)
    with LLM(str(llama_dir), **config) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(ps, greedy, lora_request=reqs, use_tqdm=False)]
    with LLM(str(llama_dir), attention_backend="triton", **config) as llm:
        with recording() as warm:
            llm.engine.worker.lora.warm_up()
        with recording() as later:
            got = [o.outputs[0].token_ids for o in llm.generate(ps, greedy, lora_request=reqs, use_tqdm=False)]
    assert got == want
    for name in ("_shrink_kernel", "_expand_kernel"):
        assert later[name] and later[name] <= warm[name]
