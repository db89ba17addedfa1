"""Speculative decoding through the engine: n-gram and draft-model proposals verified in mixed
batches give the plain engine's outputs (greedy rows next to sampled ones too), a draft equal to
the target has every guess accepted, and stops inside accepted runs end where plain decoding does."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pyserve import LLM, SamplingParams  # noqa: E402
from pyserve.testing import assert_parity, hf_greedy  # noqa: E402


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, llama_dir):
    """A draft that partly disagrees: the target's weights plus noise, with its tokenizer."""
    import shutil

    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("draft")
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.5 * p.std().nan_to_num(0.0))
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(llama_dir / name, out / name)
    return out


def looping_prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(3)
    base = [list(rng.integers(2, vocab, size=n)) for n in (5, 9, 3)]
    return [[int(t) for t in b * 4] for b in base] + [[int(t) for t in rng.integers(2, vocab, size=12)]]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_outputs_equal_plain_decoding_in_mixed_batches(method, llama_dir, draft_dir):
    prompts = looping_prompts(300)
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2)  # decodes plainly
    config = {"method": method, "num_speculative_tokens": 3, "adaptive": False}
    if method == "draft_model":
        config["model"] = str(draft_dir)
    with LLM(str(llama_dir), block_size=4, num_kv_blocks=512, speculative_config=config) as llm:
        outs = llm.generate(prompts + prompts[:1], [greedy] * len(prompts) + [with_logprobs], use_tqdm=False)
        stats = llm.stats()
    ref = hf_greedy(llama_dir, prompts, max_tokens=20)
    assert_parity([o.outputs[0].token_ids for o in outs[: len(prompts)]], ref)
    assert outs[-1].outputs[0].token_ids == outs[0].outputs[0].token_ids
    assert stats["spec_decode_num_draft_tokens"] > 0
    assert 0 < stats["spec_decode_num_accepted_tokens"] <= stats["spec_decode_num_draft_tokens"]


def test_greedy_requests_verified_next_to_sampled_ones_equal_plain_decoding(llama_dir, draft_dir):
    """All-greedy steps verify by argmax; a step that also verifies sampled requests takes the
    rejection sampler for every row: greedy rows must come out the same either way."""
    prompts = looping_prompts(300)
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True, seed=5)
    config = {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 3, "adaptive": False}
    with LLM(str(llama_dir), block_size=4, num_kv_blocks=512, speculative_config=config) as llm:
        outs = llm.generate(prompts + prompts, [greedy] * len(prompts) + [sampled] * len(prompts), use_tqdm=False)
        stats = llm.stats()
    assert_parity([o.outputs[0].token_ids for o in outs[: len(prompts)]], hf_greedy(llama_dir, prompts, max_tokens=20))
    assert all(len(o.outputs[0].token_ids) == 20 for o in outs[len(prompts):])
    assert stats["spec_decode_num_accepted_tokens"] > 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_draft_equal_to_target_accepts_everything(temperature, llama_dir):
    config = {"method": "draft_model", "model": str(llama_dir), "num_speculative_tokens": 3, "adaptive": False}
    params = SamplingParams(temperature=temperature, max_tokens=24, ignore_eos=True, seed=11)
    with LLM(str(llama_dir), block_size=4, num_kv_blocks=512, speculative_config=config) as llm:
        llm.generate(looping_prompts(300), params, use_tqdm=False)
        stats = llm.stats()
    assert stats["spec_decode_num_draft_tokens"] > 20
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"]
    assert stats["spec_decode_depth"] == 3  # the fixed depth, still shown once every request ended


def test_stops_inside_an_accepted_run_end_at_the_right_token(llama_dir):
    """max_tokens, a stop token id and a stop string that fall inside runs of accepted drafts
    end the request exactly where plain decoding does."""
    prompts = looping_prompts(300)[:3]
    with LLM(str(llama_dir), block_size=4, num_kv_blocks=512) as llm:
        plain = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
                             use_tqdm=False)
    cases = []
    for o in plain:
        toks, text = o.outputs[0].token_ids, o.outputs[0].text
        cases.append(SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True))
        cases.append(SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[toks[9]]))
        cases.append(SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[text[12:15]]))
    config = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}
    ps = [p for p in prompts for _ in range(3)]
    results = {}
    for spec in (None, config):
        with LLM(str(llama_dir), block_size=4, num_kv_blocks=512, speculative_config=spec) as llm:
            outs = llm.generate(ps, cases, use_tqdm=False)
            results[spec is None] = [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason)
                                     for o in outs]
            if spec is not None:
                assert llm.stats()["spec_decode_num_accepted_tokens"] > 0
    assert results[False] == results[True]
    assert [len(r[0]) for r in results[True][0::3]] == [7, 7, 7]
    assert all(r[2] == "stop" for r in results[True][1::3] + results[True][2::3])


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_a_seeded_request_gives_plain_samplings_tokens_whatever_the_batch_and_depths(method, llama_dir, draft_dir):
    """The seeded request alone, again on a fresh engine, and inside two different batches,
    against the same request on an engine without speculation. The draft model with adaptive
    depth; n-gram lookup at a fixed depth (its drafts come and go with the matches: random
    weights rarely give the adaptive depth a reason to keep guessing)."""
    prompts = looping_prompts(300)
    mine = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=24, ignore_eos=True, seed=123)
    others = [SamplingParams(temperature=1.0, max_tokens=18, ignore_eos=True),
              SamplingParams(temperature=0.7, max_tokens=30, ignore_eos=True, seed=5),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)]
    config = {"method": method, "num_speculative_tokens": 4, "adaptive": method == "draft_model"}
    if method == "draft_model":
        config["model"] = str(draft_dir)
    engine = dict(block_size=4, num_kv_blocks=512)
    with LLM(str(llama_dir), **engine) as llm:
        plain = llm.generate([prompts[0]], mine, use_tqdm=False)[0].outputs[0].token_ids
    runs = []
    for _ in range(2):
        with LLM(str(llama_dir), speculative_config=config, **engine) as llm:
            runs.append(llm.generate([prompts[0]], mine, use_tqdm=False)[0].outputs[0].token_ids)
            runs.append(llm.generate([prompts[1], prompts[0], prompts[2]], [others[0], mine, others[1]],
                                     use_tqdm=False)[1].outputs[0].token_ids)
            runs.append(llm.generate([prompts[3], prompts[2], prompts[0]], [others[2], others[1], mine],
                                     use_tqdm=False)[2].outputs[0].token_ids)
            stats = llm.stats()
        assert stats["spec_decode_num_draft_tokens"] > 0
    assert len(plain) == 24 and all(run == plain for run in runs)
