"""The offline API: LLM.generate's prompt and params forms, output fields and order, the stop
conditions (max_tokens, stop_token_ids, EOS, min_tokens, stop strings), logprobs against
transformers, seeded n > 1, refusals that leave the engine serving, stats() and the progress bar."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time

import numpy as np
import pytest
import torch

from pyserve import LLM, SamplingParams
from pyserve.actors import EngineDeadError

PROMPT = "def add(a, b):"
MAX = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX, ignore_eos=True)
POOL = dict(block_size=4, num_kv_blocks=256)
STATS_KEYS = {
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens",
    "generation_tokens", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions",
    "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
}


@pytest.fixture(scope="module")
def llm(model_dirs):
    with LLM(str(model_dirs["llama"]), **POOL) as llm:
        yield llm


@pytest.fixture(scope="module")
def ref(llm) -> list[int]:
    """The greedy continuation of PROMPT, MAX tokens."""
    return llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def run(llm, prompt=PROMPT, **params):
    return llm.generate(prompt, SamplingParams(**params), use_tqdm=False)[0]


def greedy(**params) -> dict:
    return dict(temperature=0.0, max_tokens=MAX, ignore_eos=True) | params


# --- prompt and params forms, output fields ------------------------------------------------------


def test_generate_accepts_a_string_a_token_list_or_a_list_of_both(llm, ref):
    ids = llm.tokenizer.encode(PROMPT)
    one_text = llm.generate(PROMPT, GREEDY, use_tqdm=False)
    one_ids = llm.generate(ids, GREEDY, use_tqdm=False)
    both = llm.generate([ids, PROMPT], GREEDY, use_tqdm=False)
    assert len(one_text) == len(one_ids) == 1 and len(both) == 2
    for out, prompt in [(one_text[0], PROMPT), (one_ids[0], None), (both[0], None), (both[1], PROMPT)]:
        assert out.prompt == prompt
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == ref
    assert llm.generate([], GREEDY, use_tqdm=False) == []


def test_generate_accepts_vllms_dict_prompts_and_numpy_ids(llm, ref):
    ids = llm.tokenizer.encode(PROMPT)
    outs = llm.generate([{"prompt": PROMPT}, {"prompt_token_ids": ids}, np.array(ids), tuple(ids)], GREEDY,
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [ref] * 4
    assert [o.prompt for o in outs] == [PROMPT, None, None, None]
    assert llm.generate(np.array(ids), GREEDY, use_tqdm=False)[0].outputs[0].token_ids == ref
    assert llm.generate({"prompt": PROMPT}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == ref
    for bad, match in (({"prompt": PROMPT, "multi_modal_data": {}}, "multi_modal_data"),
                       ({"prompt": PROMPT, "prompt_token_ids": ids}, "one of"), ([1.5, 2.5], "text or token ids")):
        with pytest.raises(ValueError, match=match):
            llm.generate([bad], GREEDY, use_tqdm=False)
    assert llm.get_tokenizer() is llm.tokenizer


def test_an_llm_made_and_used_inside_a_running_event_loop_as_in_a_notebook(model_dirs, ref):
    async def notebook_cell():
        with LLM(str(model_dirs["llama"]), **POOL) as inner:
            return inner.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids, inner

    tokens, closed = asyncio.run(notebook_cell())
    assert tokens == ref
    with pytest.raises(RuntimeError, match="closed"):
        closed.generate(PROMPT, GREEDY, use_tqdm=False)


def test_one_sampling_params_per_prompt_in_input_order(llm):
    prompts = [list(range(5, 45)), [9, 8], PROMPT, list(range(100, 120))]
    lengths = [7, 2, 4, 10]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == lengths
    assert [o.prompt_token_ids for o in outs] == [prompts[0], [9, 8], llm.tokenizer.encode(PROMPT), prompts[3]]
    assert len({o.request_id for o in outs}) == 4
    for o in outs:
        c = o.outputs[0]
        assert o.finished and (c.index, c.finish_reason, c.stop_reason) == (0, "length", None)
        assert c.text == llm.tokenizer.decode(c.token_ids)
        assert c.logprobs is None and c.cumulative_logprob is None


def test_sampling_params_list_of_the_wrong_length_is_refused(llm):
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate([PROMPT, PROMPT], [GREEDY], use_tqdm=False)


# --- stop conditions -----------------------------------------------------------------------------


def test_max_tokens_gives_exactly_that_many_tokens_and_length(llm, ref):
    out = run(llm, **greedy(max_tokens=5)).outputs[0]
    assert out.token_ids == ref[:5]
    assert (out.finish_reason, out.stop_reason) == ("length", None)


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(llm):
    ids = list(range(5, 35))
    greedy = dict(temperature=0, max_tokens=6, ignore_eos=True)
    cut = llm.generate([ids], SamplingParams(truncate_prompt_tokens=7, **greedy), use_tqdm=False)[0]
    assert cut.prompt_token_ids == ids[-7:]
    assert cut.outputs[0].token_ids == llm.generate([ids[-7:]], SamplingParams(**greedy), use_tqdm=False)[0] \
        .outputs[0].token_ids
    whole = llm.generate([ids], SamplingParams(truncate_prompt_tokens=-1, **greedy), use_tqdm=False)[0]
    assert whole.prompt_token_ids == ids  # -1: the model's length, which these fit
    assert llm.generate([ids[:3]], SamplingParams(truncate_prompt_tokens=7, **greedy), use_tqdm=False)[0] \
        .prompt_token_ids == ids[:3]
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=-2)


def test_stop_token_id_ends_the_output_including_the_token(llm, ref):
    # the first token from step 3 on that is new in the output and decodes to whole characters
    k = next(i for i in range(3, MAX) if ref.index(ref[i]) == i and "\ufffd" not in llm.tokenizer.decode([ref[i]]))
    stop = ref[k]
    out = run(llm, **greedy(stop_token_ids=[stop])).outputs[0]
    assert out.token_ids == ref[: k + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.text == llm.tokenizer.decode(ref[:k])  # the stop token's text is not output (vLLM)


def test_min_tokens_bans_stop_tokens_until_reached(llm, ref):
    """Also the greedy fast path's guard: a lone greedy request is an all-argmax batch."""
    stop = ref[0]
    out = run(llm, **greedy(stop_token_ids=[stop], min_tokens=3)).outputs[0]
    assert len(out.token_ids) >= 3
    assert stop not in out.token_ids[:3]  # greedy took the runner-up instead
    assert out.token_ids[0] != ref[0]
    if stop in out.token_ids:
        assert out.token_ids.index(stop) == len(out.token_ids) - 1 and out.finish_reason == "stop"
    else:
        assert out.finish_reason == "length"


@pytest.fixture(scope="module")
def eos_llm(model_dirs, tmp_path_factory, ref):
    """The same weights with EOS set to the third greedy token."""
    path = tmp_path_factory.mktemp("eos") / "llama"
    shutil.copytree(model_dirs["llama"], path)
    config = json.loads((path / "config.json").read_text())
    config["eos_token_id"] = ref[2]
    (path / "config.json").write_text(json.dumps(config))
    with LLM(str(path), **POOL) as llm:
        assert llm.engine.eos_token_ids[0] == ref[2]
        yield llm


def test_eos_stops_unless_ignore_eos(eos_llm, ref):
    eos = ref[2]
    k = ref.index(eos)
    assert k > 0  # see test_sequence_finishing_on_its_first_token_keeps_the_engine_alive
    out = run(eos_llm, temperature=0.0, max_tokens=MAX).outputs[0]
    assert out.token_ids == ref[: k + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", None)
    assert out.text == eos_llm.tokenizer.decode(ref[:k])
    ignored = run(eos_llm, temperature=0.0, max_tokens=MAX, ignore_eos=True).outputs[0]
    assert ignored.token_ids == ref and ignored.finish_reason == "length"


def test_min_tokens_bans_eos_until_reached(eos_llm, ref):
    eos = ref[2]
    out = run(eos_llm, temperature=0.0, max_tokens=MAX, min_tokens=ref.index(eos) + 2).outputs[0]
    assert eos not in out.token_ids[: ref.index(eos) + 2]
    assert len(out.token_ids) >= ref.index(eos) + 2


def _stop_string(text: str) -> str:
    """A 2-character substring of `text` first found after its 4th character, no U+FFFD."""
    for i in range(4, len(text) - 2):
        s = text[i : i + 2]
        if "\ufffd" not in s and text.index(s) == i:
            return s
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_string_cuts_the_text_before_it(llm, ref):
    text = llm.tokenizer.decode(ref)
    stop = _stop_string(text)
    out = run(llm, **greedy(stop=[stop, "never in the text"])).outputs[0]
    assert out.text == text[: text.index(stop)]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.token_ids == ref[: len(out.token_ids)]
    assert llm.tokenizer.decode(out.token_ids).startswith(out.text + stop)
    stats = llm.stats()  # the sequence was aborted by the stop string: nothing is left running
    assert stats["num_requests_running"] == 0 and stats["kv_cache_usage_perc"] == 0.0


def test_stop_string_within_min_tokens_does_not_stop(llm, ref):
    text = llm.tokenizer.decode(ref)
    stop = _stop_string(text)
    out = run(llm, **greedy(stop=[stop], min_tokens=MAX)).outputs[0]
    assert out.token_ids == ref and out.text == text and out.finish_reason == "length"


# --- logprobs ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_model(model_dirs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dirs["llama"], dtype=torch.float32).eval()


def hf_logprobs(hf_model, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """[len(output_ids), V] log-softmax of transformers' logits at each generated position."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt_ids + output_ids[:-1]])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)[len(prompt_ids) - 1 :]


def test_greedy_logprobs_match_transformers(llm, hf_model, ref):
    out = run(llm, **greedy(max_tokens=6, logprobs=3))
    c = out.outputs[0]
    assert c.token_ids == ref[:6] and len(c.logprobs) == 6
    want = hf_logprobs(hf_model, out.prompt_token_ids, c.token_ids)
    for i, (token, entry) in enumerate(zip(c.token_ids, c.logprobs)):
        top = torch.topk(want[i], 3)
        assert list(entry) == [token] + [t for t in top.indices.tolist() if t != token]
        assert sorted(lp.rank for lp in entry.values()) == [1, 2, 3]
        assert entry[token].rank == 1
        for tid, lp in entry.items():
            assert lp.logprob == pytest.approx(float(want[i, tid]), abs=1e-4)
            assert lp.decoded_token == llm.tokenizer.decode([tid], skip_special_tokens=False)
    assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)), abs=1e-4)


def test_detokenize_false_gives_the_same_tokens_without_text(llm, ref):
    out = run(llm, **greedy(logprobs=2, detokenize=False))
    c = out.outputs[0]
    assert c.token_ids == ref and c.text == "" and c.finish_reason == "length"
    assert len(c.logprobs) == MAX
    assert all(lp.decoded_token is None for entry in c.logprobs for lp in entry.values())
    assert run(llm, **greedy()).outputs[0].text == llm.tokenizer.decode(ref)


def test_sampled_token_outside_the_top_k_gets_its_own_entry_and_rank(llm, hf_model):
    out = run(llm, temperature=2.0, seed=3, max_tokens=8, ignore_eos=True, logprobs=1)
    c = out.outputs[0]
    want = hf_logprobs(hf_model, out.prompt_token_ids, c.token_ids)
    outside = 0
    for i, (token, entry) in enumerate(zip(c.token_ids, c.logprobs)):
        lp = float(want[i, token])
        assert entry[token].logprob == pytest.approx(lp, abs=1e-4)
        lo, hi = (int((want[i] > lp + d).sum()) + 1 for d in (1e-4, -1e-4))
        assert lo <= entry[token].rank <= hi  # ties within the tolerance may order either way
        top1 = int(want[i].argmax())
        assert entry[top1].rank == 1
        assert len(entry) == (1 if token == top1 else 2)
        outside += token != top1
    assert outside > 0  # temperature 2 (the highest) on 300 tokens: the test exercised the case


# --- n > 1 and seeds -----------------------------------------------------------------------------


def test_n_2_with_a_seed_gives_two_different_reproducible_completions(llm):
    p = dict(n=2, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    first = run(llm, **p)
    assert [c.index for c in first.outputs] == [0, 1]
    a, b = (c.token_ids for c in first.outputs)
    assert len(a) == len(b) == 8 and a != b
    again = run(llm, **p)
    assert [c.token_ids for c in again.outputs] == [a, b]
    assert [c.text for c in again.outputs] == [c.text for c in first.outputs]
    other = run(llm, **(p | dict(seed=12)))
    assert [c.token_ids for c in other.outputs] != [a, b]


# --- refusals ------------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", [[5, 300], [-1, 5], [5, 10**12]])
def test_token_ids_outside_the_vocabulary_are_refused(llm, prompt):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate(prompt, GREEDY, use_tqdm=False)


@pytest.mark.parametrize("field, params", [("logit_bias", SamplingParams(logit_bias={300: 1.0}, max_tokens=2)),
                                           ("stop_token_ids", SamplingParams(stop_token_ids=[300], max_tokens=2))])
def test_sampling_token_ids_outside_the_vocabulary_are_refused_and_the_engine_keeps_serving(llm, field, params):
    with pytest.raises(ValueError, match=f"{field}: token id 300 is outside the vocabulary"):
        llm.generate([[5, 6]], params, use_tqdm=False)
    assert len(llm.generate([[5, 6]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) > 0


def test_empty_prompt_is_refused(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], GREEDY, use_tqdm=False)


def test_over_long_request_is_refused_and_the_engine_keeps_serving(llm, ref):
    long_prompt = [7] * 500  # max_model_len is 512
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate(long_prompt, SamplingParams(max_tokens=20), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([7] * 512, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="max_tokens"):  # queued prompts before it are aborted
        llm.generate([PROMPT, long_prompt], [GREEDY, SamplingParams(max_tokens=20)], use_tqdm=False)
    stats = llm.stats()
    assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0
    assert stats["kv_cache_usage_perc"] == 0.0
    assert run(llm, **greedy()).outputs[0].token_ids == ref
    fits = run(llm, long_prompt, **greedy(max_tokens=12)).outputs[0]
    assert len(fits.token_ids) == 12


# --- stats and progress --------------------------------------------------------------------------


def test_stats_count_the_run(llm):
    before = llm.stats()
    assert set(before) >= STATS_KEYS
    prompts = [list(range(10, 30)), PROMPT, list(range(10, 30))]
    outs = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (3, 5, 7)],
                        use_tqdm=False)
    after = llm.stats()
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    assert after["prompt_tokens"] - before["prompt_tokens"] == prompt_tokens
    assert after["generation_tokens"] - before["generation_tokens"] == 3 + 5 + 7
    assert after["prefix_cache_queries"] - before["prefix_cache_queries"] == prompt_tokens
    assert 0 < after["prefix_cache_hits"] - before["prefix_cache_hits"] <= prompt_tokens
    assert (after["num_requests_running"], after["num_requests_waiting"], after["kv_cache_usage_perc"]) == (0, 0, 0.0)
    (sampled,) = llm.generate([PROMPT], SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=2, ignore_eos=True),
                              use_tqdm=False)
    again = llm.stats()
    assert again["prompt_tokens"] - after["prompt_tokens"] == len(sampled.prompt_token_ids)  # once, as usage bills it
    assert again["generation_tokens"] - after["generation_tokens"] == 3 * 2
    assert after["num_preemptions"] == 0
    assert after["spec_decode_num_draft_tokens"] == after["spec_decode_num_accepted_tokens"] == 0
    again = llm.generate(prompts[0], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 19  # the 20-token prompt but its last token (its logits are needed)


def test_progress_bar_on_stderr_only_when_asked(llm, capsys):
    params = SamplingParams(temperature=0.0, max_tokens=2)
    llm.generate([PROMPT, [5, 6, 7]], params, use_tqdm=True)
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "2/2" in err
    llm.generate([PROMPT, [5, 6, 7]], params, use_tqdm=False)
    assert capsys.readouterr().err == ""


# --- engine failures -----------------------------------------------------------------------------


def _error_within(seconds: float, call) -> BaseException | None:
    """Runs `call` in a daemon thread, so that a hang fails the test instead of stalling the suite;
    returns what it raised."""
    raised = []

    def target():
        try:
            call()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            raised.append(e)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still waiting after {seconds} s"
    return raised[0] if raised else None


def test_engine_death_fails_every_waiting_request_instead_of_hanging(model_dirs, monkeypatch):
    with LLM(str(model_dirs["llama"]), **POOL) as llm:
        def crash(out, rows, *rest):
            time.sleep(0.05)  # the next prompt's Add is in flight when the EngineCore dies
            raise RuntimeError("device lost")

        monkeypatch.setattr(llm.engine.worker, "execute", crash)
        for prompts in ([PROMPT, [5, 6, 7], [8, 9]], PROMPT):
            error = _error_within(30, lambda: llm.generate(prompts, GREEDY, use_tqdm=False))
            assert isinstance(error, EngineDeadError) and "device lost" in str(error)


def test_sequence_finishing_on_its_first_token_keeps_the_engine_alive(model_dirs, ref):
    with LLM(str(model_dirs["llama"]), **POOL) as llm:
        one = run(llm, **greedy(max_tokens=1)).outputs[0]
        assert (one.token_ids, one.finish_reason) == (ref[:1], "length")
        stop = run(llm, **greedy(stop_token_ids=[ref[0]])).outputs[0]
        assert (stop.token_ids, stop.text, stop.finish_reason, stop.stop_reason) == ([ref[0]], "", "stop", ref[0])
