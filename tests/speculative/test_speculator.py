"""Speculative decoding: the exact rejection sampler (Triton kernel vs torch reference, and the
distribution it samples), n-gram and draft-model proposals verified in mixed batches with the
plain engine's outputs, and the adaptive depth's choices."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pyserve import LLM, SamplingParams, _core  # noqa: E402
from pyserve.kernels.rejection_sample import rejection_sample, rejection_sample_ref  # noqa: E402
from pyserve.spec.config import SpeculativeConfig  # noqa: E402
from pyserve.spec.depth import DepthController  # noqa: E402
from pyserve.testing import assert_parity, hf_greedy  # noqa: E402


def random_case(num_drafts: list[int], vocab: int, seed: int, with_q: bool, greedy_rows=()):
    g = torch.Generator().manual_seed(seed)
    rows = sum(k + 1 for k in num_drafts)
    p = torch.rand(rows, vocab, generator=g).pow(3)
    p /= p.sum(1, keepdim=True)
    for r in greedy_rows:
        p[r] = torch.nn.functional.one_hot(p[r].argmax(), vocab).float()
    q = None
    if with_q:
        q = torch.rand(rows, vocab, generator=g)
        q /= q.sum(1, keepdim=True)
    drafts = torch.randint(0, vocab, (rows,), generator=g)
    # Make some drafts the target's favourite so that runs of acceptances occur.
    fav = p.argmax(1)
    drafts = torch.where(torch.rand(rows, generator=g) < 0.5, fav, drafts)
    u = torch.rand(rows, generator=g)
    noise = torch.empty(rows, vocab).exponential_(generator=g).clamp_min_(1e-30)
    cu = torch.tensor(np.concatenate([[0], np.cumsum([k + 1 for k in num_drafts])]), dtype=torch.int32)
    return p, q, drafts, u, noise, cu


@pytest.mark.parametrize("with_q", [False, True])
def test_rejection_kernel_matches_reference(with_q):
    case = random_case([3, 0, 5, 1, 2], vocab=37, seed=1, with_q=with_q, greedy_rows=(0, 1, 2, 3))
    want_tokens, want_num = rejection_sample_ref(*case)
    got_tokens, got_num = rejection_sample(*case)
    assert got_num.tolist() == want_num.tolist()
    assert got_tokens.tolist() == want_tokens.tolist()
    cu = case[-1].tolist()
    for b, n in enumerate(want_num.tolist()):  # accepted drafts are the drafts, then -1 padding
        row = want_tokens[cu[b] : cu[b + 1]].tolist()
        assert row[: n - 1] == case[2][cu[b] : cu[b] + n - 1].tolist()
        assert all(t == -1 for t in row[n:]) and row[n - 1] >= 0


def test_greedy_rows_keep_drafts_while_they_are_the_argmax():
    vocab = 11
    p = torch.zeros(4, vocab)
    p[torch.arange(4), torch.tensor([3, 5, 7, 9])] = 1.0  # target argmax 3, 5, 7, then bonus 9
    drafts = torch.tensor([3, 5, 2, -1])  # the third draft is wrong
    u = torch.full((4,), 0.999)
    noise = torch.ones(4, vocab)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    for fn in (rejection_sample_ref, rejection_sample):
        tokens, num = fn(p, None, drafts, u, noise, cu)
        assert num.tolist() == [3] and tokens.tolist() == [3, 5, 7, -1]


@pytest.mark.parametrize("with_q", [False, True])
def test_rejection_sampling_preserves_the_target_distribution(with_q):
    """One draft token per request drawn from q (or fixed, for n-gram lookup): the first output
    token must be distributed as p. 40000 samples; total variation must stay under 0.015
    (its sampling noise is about 0.005 here)."""
    vocab, n = 6, 40000
    g = torch.Generator().manual_seed(7)
    p_row = torch.tensor([0.05, 0.4, 0.1, 0.25, 0.15, 0.05])
    q_row = torch.tensor([0.3, 0.1, 0.3, 0.1, 0.1, 0.1])
    p = p_row.repeat(2 * n, 1)
    if with_q:
        draft = torch.multinomial(q_row, n, replacement=True, generator=g)
        q = q_row.repeat(2 * n, 1)
    else:
        draft, q = torch.full((n,), 2), None  # always guess token 2
    drafts = torch.stack([draft, torch.full((n,), -1)], 1).reshape(-1)
    u = torch.rand(2 * n, generator=g)
    noise = torch.empty(2 * n, vocab).exponential_(generator=g)
    cu = torch.arange(0, 2 * n + 1, 2, dtype=torch.int32)
    tokens, num = rejection_sample_ref(p, q, drafts, u, noise, cu)
    first = tokens[0::2]
    freq = torch.bincount(first, minlength=vocab).float() / n
    assert 0.5 * (freq - p_row).abs().sum() < 0.015
    accept_rate = float((num == 2).float().mean())
    expected = float(torch.minimum(p_row, q_row).sum()) if with_q else float(p_row[2])
    assert accept_rate == pytest.approx(expected, abs=0.01)


def test_ngram_lookup_in_the_scheduler():
    s = _core.Scheduler(num_blocks=64, block_size=4)
    s.add_request(1, [5, 6, 7, 8, 9, 5, 6], max_tokens=8)
    assert s.propose_ngram(1, 2, 1, 3) == [7, 8]
    assert s.propose_ngram(1, 2, 3, 3) == []  # "9 5 6" never occurred before
    with pytest.raises(KeyError):
        s.propose_ngram(99, 2)


def test_config_errors_name_the_key(tmp_path):
    for raw, key in [({"method": "medusa"}, "method"), ({"method": "ngram", "num_speculative_tokens": 0},
                     "num_speculative_tokens"), ({"method": "ngram", "k": 2}, "k"),
                     ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_max"),
                     ({"method": "draft_model", "model": str(tmp_path)}, "model"), ("{", "speculative_config")]:
        with pytest.raises(ValueError, match=key):
            SpeculativeConfig.parse(raw)
    cfg = SpeculativeConfig.parse('{"method": "ngram"}')
    assert (cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (4, 1, 4)


def test_depth_follows_the_measured_costs():
    def trained(seconds_per_draft: float, batch: int, accepted: int) -> DepthController:
        ctl = DepthController(4)
        for _ in range(30):
            k = ctl.choose(batch, batch)
            ctl.observe_step(batch, batch * k, 0.010 + seconds_per_draft * batch * k)
            if k:
                ctl.observe_proposal(batch, k, batch * k, 0.0)
                for _ in range(batch):
                    ctl.observe_verification(k, min(k, accepted))
        return ctl

    # Widening the step is nearly free (memory- or overhead-bound decode): full depth.
    assert trained(1e-6, 1, 3).choose(1, 1) == 4
    # Every draft token costs as much as the fixed part of the step: speculation off.
    assert trained(0.010 / 64, 64, 3).choose(64, 64) == 0
    # A draft token costs 30% of a step and guesses always fail: off too.
    assert trained(0.003, 1, 0).choose(1, 1) == 0
    assert DepthController(3, adaptive=False).choose(64, 64) == 3


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
