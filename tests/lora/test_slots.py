"""Multi-LoRA: the batched LoRA kernels against their reference and a dense computation, PEFT
adapter validation, and mixed batches (base + adapters of different ranks and target sets, more
adapters than device slots) against transformers on the PEFT-merged models."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pyserve import LLM, LoRARequest, SamplingParams, _core  # noqa: E402
from pyserve.default_model import ADAPTER_DIRS  # noqa: E402
from pyserve.kernels import lora as lora_kernels  # noqa: E402
from pyserve.kernels.lora import add_lora, add_lora_cpu, add_lora_ref  # noqa: E402
from pyserve.lora.adapter import LoraError, load_adapter  # noqa: E402
from pyserve.testing import assert_parity, hf_greedy, make_adapter, prompts  # noqa: E402


def dense_delta(x, a, b, scaling, slots):
    out = torch.zeros(x.shape[0], b.shape[1], dtype=torch.float64)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            out[t] = scaling[s].double() * (b[s].double() @ (a[s].double() @ x[t].double()))
    return out


@pytest.mark.parametrize("gather", [True, False])
def test_lora_kernels_match_reference_and_dense(gather, monkeypatch):
    g = torch.Generator().manual_seed(0)
    t, fan_in, fan_out, slots, rank = 9, 24, 40, 3, 8
    x = torch.randn(t, fan_in, generator=g)
    a = torch.randn(slots, rank, fan_in, generator=g)
    b = torch.randn(slots, fan_out, rank, generator=g)
    scaling = torch.tensor([0.5, 2.0, 0.0])
    token_slots = torch.tensor([0, -1, 1, 1, 2, 0, -1, 1, 0])
    y0 = torch.randn(t, fan_out, generator=g)
    want = y0.double() + dense_delta(x, a, b, scaling, token_slots)
    if not gather:
        monkeypatch.setattr(lora_kernels, "GATHER_LIMIT", 0)
    ref = add_lora_ref(y0.clone(), x, a, b, scaling, token_slots)
    torch.testing.assert_close(ref.double(), want, atol=1e-4, rtol=1e-4)
    got = add_lora(y0.clone(), x, a, b, scaling, token_slots)
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)
    b_scaled = (b.transpose(1, 2) * scaling[:, None, None]).contiguous()
    cpu = add_lora_cpu(y0.clone(), x, a, b_scaled, token_slots.numpy())
    torch.testing.assert_close(cpu.double(), want, atol=1e-4, rtol=1e-4)
    assert torch.equal(cpu[1], y0[1])
    assert torch.equal(got[1], y0[1]) and torch.equal(ref[6], y0[6])  # base tokens untouched


def test_cpu_kernel_refuses_bad_arguments_naming_them():
    x, y = np.zeros((2, 8), np.float32), np.zeros((2, 4), np.float32)
    a, b = np.zeros((3, 2, 8), np.float32), np.zeros((3, 2, 4), np.float32)
    with pytest.raises(ValueError, match="token 1: slot 5 is outside the 3 slots"):
        _core.lora_add(y, x, np.array([0, 5]), a, b)
    with pytest.raises(ValueError, match="x must be"):
        _core.lora_add(y, np.zeros((2, 9), np.float32), np.array([0, 1]), a, b)
    with pytest.raises(ValueError, match="b_scaled must be C-contiguous"):
        _core.lora_add(y, x, np.array([0, 1]), a, np.zeros((3, 4, 2), np.float32).transpose(0, 2, 1))
    assert not y.any()  # nothing written by a refused call


def test_cpu_kernel_on_torchs_threads_gives_the_bits_of_one_thread():
    # 64 tokens over 8 slots at rank 16: enough work that, with threads=2, the blocks are spread
    # over the calling thread's OpenMP team (torch's libgomp)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((64, 96), dtype=np.float32)
    a = rng.standard_normal((8, 16, 96), dtype=np.float32)
    b = rng.standard_normal((8, 16, 200), dtype=np.float32)
    slots = np.array([-1 if t % 9 == 4 else t % 8 for t in range(64)], dtype=np.int64)
    y0 = rng.standard_normal((64, 200), dtype=np.float32)
    outs = []
    for threads in (1, 2):
        y = y0.copy()
        _core.lora_add(y, x, slots, a, b, threads=threads)
        outs.append(y)
    np.testing.assert_array_equal(outs[0], outs[1])
    want = y0.astype(np.float64)
    for t, s in enumerate(slots):
        if s >= 0:
            want[t] += b[s].astype(np.float64).T @ (a[s].astype(np.float64) @ x[t])
    np.testing.assert_allclose(outs[1], want, rtol=1e-4, atol=1e-3)


def merged(base_dir, adapter_dir, out):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    PeftModel.from_pretrained(base, adapter_dir).merge_and_unload().save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, llama_dir):
    root = tmp_path_factory.mktemp("adapters")
    specs = {
        "all8": (8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False),
        "attn4": (4, ["q_proj", "v_proj"], False),
        "mlp16rs": (16, ["gate_proj", "down_proj", "o_proj"], True),
    }
    return {name: make_adapter(llama_dir, root / name, r, t, seed=i, rslora=rs)
            for i, (name, (r, t, rs)) in enumerate(specs.items())}


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


def test_adapters_are_validated_before_use(llama_dir, adapters, tmp_path):
    shapes = {"q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32), "o_proj": (64, 64),
              "gate_proj": (64, 128), "up_proj": (64, 128), "down_proj": (128, 64)}
    load_adapter(adapters["all8"], shapes, num_layers=2, max_rank=8)
    with pytest.raises(LoraError, match="max_lora_rank"):
        load_adapter(adapters["mlp16rs"], shapes, num_layers=2, max_rank=8)
    with pytest.raises(LoraError, match="directory"):
        load_adapter(tmp_path / "missing", shapes, num_layers=2, max_rank=64)
    pickled = tmp_path / "pickled"
    shutil.copytree(adapters["attn4"], pickled)
    (pickled / "adapter_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(LoraError, match="pickled"):
        load_adapter(pickled, shapes, num_layers=2, max_rank=64)
    wrong = tmp_path / "wrong"
    shutil.copytree(adapters["attn4"], wrong)
    cfg = json.loads((wrong / "adapter_config.json").read_text())
    (wrong / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": ["q_proj", "lm_head"]}))
    with pytest.raises(LoraError, match="target_modules"):
        load_adapter(wrong, shapes, num_layers=2, max_rank=64)
    with pytest.raises(LoraError, match="do not fit"):
        load_adapter(adapters["attn4"], {**shapes, "q_proj": (64, 48)}, num_layers=2, max_rank=64)
    with LLM(str(llama_dir), block_size=4, num_kv_blocks=64, enable_lora=True, max_lora_rank=8) as llm:
        with pytest.raises(ValueError, match="max_lora_rank"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2),
                         lora_request=LoRARequest("big", 3, str(adapters["mlp16rs"])), use_tqdm=False)
        ok = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
        assert len(ok[0].outputs[0].token_ids) == 2  # the engine carries on


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
    assert cached == [0, 0, 0, 20, 20]  # 24 tokens: all full blocks but the last (its last token is recomputed)
