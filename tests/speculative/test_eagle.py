"""EAGLE-3 heads: trained by `train_eagle`, loaded in their authors' layout, drafting inside the
worker from the target's own hidden states. Exactness (greedy and seeded outputs equal plain
decoding, through chunked prefill, prefix-cache hits, preemption and mixed batches), the drafts
equal to what the trainer's unrolled head predicts on the same sequence (serving and training
see the same head), and refusals naming what does not match."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from pyserve import LLM, SamplingParams
from pyserve.default_model import TARGET_DIR
from pyserve.eagle_training.data import Recorder
from pyserve.eagle_training.options import TrainOptions
from pyserve.eagle_training.train import train_eagle
from pyserve.eagle_training.ttt import unrolled
from pyserve.model.checkpoint import load_config
from pyserve.speculative.config import SpeculativeConfig
from pyserve.speculative.eagle import EagleProposer
from pyserve.speculative.eagle_config import HeadConfig
from pyserve.speculative.eagle_head import load_head

PROMPTS = ["def parse_price(text):\n    \"\"\"Return the amount in cents of a price such as '$12.50'.\"\"\"\n",
           "class ShoppingCart:\n    def __init__(self):\n        self.items = {}\n\n    def add(self, sku, quantity=1):\n",
           "def moving_average(values, window):\n    if window <= 0:\n",
           "import os\n\n\ndef walk(path):\n"]


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    """A head for the embedded target, trained briefly on its own answers (some guesses kept,
    some not: both paths of the verification run)."""
    out = tmp_path_factory.mktemp("head")
    options = TrainOptions(num_prompts=48, text=True, max_tokens=48, max_len=192, steps=60, batch=4, lr=3e-3,
                           checkpoint_every=30)
    report = train_eagle(str(TARGET_DIR), out, options, log=lambda _: None)
    assert report["steps"] == 60
    return out


def spec(head_dir, k=3, adaptive=False, tree_nodes=None):
    """The head's config: token trees by default (eagle3's), chains with tree_nodes=0."""
    config = {"method": "eagle3", "model": str(head_dir), "num_speculative_tokens": k, "adaptive": adaptive}
    return config if tree_nodes is None else {**config, "tree_nodes": tree_nodes}


def outputs(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_training_writes_the_eagle3_layout_and_resumes(head_dir, tmp_path):
    config = json.loads((head_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # 4 layers: L/4, L/2, L-1
    report = json.loads((head_dir / "training.json").read_text())
    assert report["held_out_sequences"] > 0
    assert len(report["held_out_acceptance_by_position"]) == 3
    # Resumed: the data and the 60 steps are reused, 10 more are run.
    shutil.copytree(head_dir, tmp_path / "more")
    again = train_eagle(str(TARGET_DIR), tmp_path / "more", TrainOptions(steps=70, batch=4, text=True, max_len=192),
                        log=lambda _: None)
    assert again["steps"] == 70 and again["train_sequences"] == report["train_sequences"]


def test_greedy_outputs_equal_plain_decoding(head_dir):
    """A mixed batch, prompts split into chunks (16-token steps) and a repeated prompt that hits
    the prefix cache; then a KV pool small enough to preempt."""
    prompts = PROMPTS + PROMPTS[:1]
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    engine = dict(block_size=4, num_kv_blocks=256, max_num_batched_tokens=16)
    with LLM(str(TARGET_DIR), **engine) as llm:
        plain = outputs(llm, prompts, greedy)
    with LLM(str(TARGET_DIR), speculative_config=spec(head_dir), **engine) as llm:
        eagle = outputs(llm, prompts, greedy)
        stats = llm.stats()
    assert eagle == plain
    assert stats["spec_decode_num_draft_tokens"] > 40
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    drafted, kept = stats["spec_decode_num_draft_tokens_per_pos"], stats["spec_decode_num_accepted_tokens_per_pos"]
    assert len(drafted) == len(kept) == 3
    assert drafted[0] == stats["spec_decode_num_drafts"] and stats["spec_decode_num_trees"] > 0
    # Per position counts a tree once a depth: its drafts off the chain are the difference.
    assert 0 < stats["spec_decode_num_draft_tokens"] - sum(drafted) < stats["spec_decode_num_tree_nodes"]
    assert sum(kept) == stats["spec_decode_num_accepted_tokens"]
    assert all(k <= d for k, d in zip(kept, drafted)) and kept == sorted(kept, reverse=True)
    with LLM(str(TARGET_DIR), speculative_config=spec(head_dir), block_size=4, num_kv_blocks=40) as llm:
        assert outputs(llm, prompts, greedy) == plain
        assert llm.stats()["num_preemptions"] > 0


def test_pairs_dropped_from_the_record_cost_guesses_not_tokens(head_dir, monkeypatch):
    """With two steps recorded at most, a prompt prefilled in 16-token chunks reaches its first
    proposal with only its last chunks' pairs: the head is fed the run after the gap, outputs stay
    plain decoding's, and guesses are still made."""
    import pyserve.speculative.eagle as eagle

    monkeypatch.setattr(eagle, "RECORDED_STEPS", 2)
    prompt = PROMPTS[1] * 2
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    engine = dict(block_size=4, num_kv_blocks=256, max_num_batched_tokens=16)
    with LLM(str(TARGET_DIR), **engine) as llm:
        plain = outputs(llm, [prompt], greedy)
    with LLM(str(TARGET_DIR), speculative_config=spec(head_dir), **engine) as llm:
        assert len(llm.tokenizer.encode(prompt)) > 48
        assert outputs(llm, [prompt], greedy) == plain
        assert llm.stats()["spec_decode_num_accepted_tokens"] > 0


def test_seeded_samples_equal_plain_sampling(head_dir):
    """Seeded sampled requests (n=2 each) give plain sampling's tokens next to greedy ones."""
    params = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=32, ignore_eos=True, seed=7, n=2),
              SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True),
              SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True, seed=3)]
    prompts = PROMPTS[:3]

    def run(config):
        with LLM(str(TARGET_DIR), speculative_config=config, block_size=4, num_kv_blocks=256) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
            return [[c.token_ids for c in o.outputs] for o in outs], llm.stats()

    plain, _ = run(None)
    eagle, stats = run(spec(head_dir, k=4))
    assert eagle == plain
    assert stats["spec_decode_num_accepted_tokens"] > 0


@pytest.mark.parametrize("in_kernel", [True, False])
def test_drafts_are_the_trained_heads_chained_guesses(head_dir, monkeypatch, in_kernel):
    """Each proposal's guesses, as far as the guesses before them were right, equal the argmax of
    the trainer's unrolled head (ttt.unrolled) over the same sequence: the head serves what it
    was trained as (features of the same layers, pairs at the same positions, the same attention
    over its own guesses), in the one-call kernel (`_core.eagle_greedy`) and op by op."""
    import pyserve.speculative.eagle as eagle

    greedy = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    calls, kernel_calls = [], []
    original, kernel = EagleProposer.propose, eagle.eagle_greedy

    def recording(self, batch, seeds):
        drafts = original(self, batch, seeds)
        calls.append((len(batch.token_ids[0]), list(drafts[0])))
        return drafts

    monkeypatch.setattr(EagleProposer, "propose", recording)
    monkeypatch.setattr(eagle, "eagle_greedy", lambda *a: kernel_calls.append(1) or kernel(*a))
    if not in_kernel:
        monkeypatch.setattr(eagle, "head_view", lambda head, embedding: None)
    config = spec(head_dir, k=4, tree_nodes=0)  # chains: a tree's chain is these guesses too, grown op by op
    with LLM(str(TARGET_DIR), speculative_config=config, block_size=4, num_kv_blocks=256) as llm:
        out = llm.generate([PROMPTS[0]], greedy, use_tqdm=False)[0]
    assert len(kernel_calls) >= len(calls) if in_kernel else kernel_calls == []
    sequence = [*out.prompt_token_ids, *out.outputs[0].token_ids]
    recorder = Recorder(str(TARGET_DIR), 256, 32)
    cfg = load_config(TARGET_DIR)
    head, embedding = load_head(head_dir, HeadConfig.from_dir(head_dir, cfg), recorder.model, torch.float32,
                                torch.device("cpu"), 256)
    with torch.inference_mode():
        recorded = recorder.record(sequence)
        ids = torch.tensor(sequence)
        steps = unrolled(head, embedding(ids[1:]), recorder.model.aux_hidden[:-1], 4)
        guesses = [head.target_ids()[head.draft_logits(s).argmax(-1)].numpy() for s in steps]
    assert len(recorded.tokens) == len(sequence)
    compared = matched = 0
    for length, drafts in calls:
        start = length - 2  # the pair of the newest token
        for j, d in enumerate(drafts):
            compared += 1
            matched += int(d == guesses[j][start + j])
            if start + 1 + j >= len(sequence) - 1 or d != sequence[start + 2 + j]:
                break  # later guesses were fed a wrong guess: the unrolled head was fed the true token
    assert compared > 20
    # Served, the head's projections run on the CPU kernels; unrolled, on torch's matmuls: the
    # same function, sums in another order, so a near-tie may flip a rare guess. A head fed
    # misaligned pairs (a position off by one, another layer's features) gets most of them wrong.
    assert matched >= 0.97 * compared


def test_a_head_that_does_not_match_is_refused_naming_it(head_dir, tmp_path, llama_dir):
    target = load_config(TARGET_DIR)
    with pytest.raises(ValueError, match="hidden states of size 256, the target's are 64; its vocabulary has 4096 "
                                         "tokens, the target's 300"):
        HeadConfig.from_dir(head_dir, load_config(llama_dir))
    bad = tmp_path / "bad"
    shutil.copytree(head_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 3, 9]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"eagle_aux_hidden_state_layer_ids \[1, 3, 9\] are not three of the target's 4"):
        HeadConfig.from_dir(bad, target)
    config["architectures"] = ["LlamaForCausalLM"]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="is not an EAGLE-3 head"):
        HeadConfig.from_dir(bad, target)
    with pytest.raises(ValueError, match="speculative_config.model: eagle3 needs the EAGLE-3 head's directory"):
        SpeculativeConfig.parse({"method": "eagle3"})
    from safetensors.torch import load_file, save_file

    shutil.rmtree(bad)
    shutil.copytree(head_dir, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    del tensors["fc.weight"]
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing \['fc.weight'\]"):
        with LLM(str(TARGET_DIR), speculative_config=spec(bad)):
            pass


@pytest.mark.parametrize("length", [10, 40])
def test_features_are_the_inputs_of_the_named_layers(length):
    """CausalLM keeps the residual stream entering the layers it is asked for (Hugging Face's
    hidden_states[i]), on the layer-kernel path (a few rows) as op by op (more)."""
    from transformers import AutoModelForCausalLM

    recorder = Recorder(str(TARGET_DIR), 64, 32)
    ids = list(range(5, 5 + length))
    with torch.inference_mode():
        recorder.record(ids)
        hf = AutoModelForCausalLM.from_pretrained(TARGET_DIR, dtype=torch.float32)
        states = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    expected = torch.cat([states[i][0] for i in recorder.aux_layer_ids], dim=-1)
    assert recorder.model.aux_hidden.shape == (length, 3 * 256)
    np.testing.assert_allclose(recorder.model.aux_hidden.numpy(), expected.numpy(), atol=2e-4)


async def test_metrics_publish_drafts_and_acceptance_by_position(head_dir):
    from pyserve.testing import parse_metrics
    from pyserve.testing.in_process import serving

    async with serving(TARGET_DIR, speculative_config=json.dumps(spec(head_dir)), block_size=4,
                       num_kv_blocks=256) as (engine, client):
        body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        metrics = parse_metrics((await client.get("/metrics")).text, "tiny")
        stats = engine.stats()
    for key in ("spec_decode_num_draft_tokens_per_pos", "spec_decode_num_accepted_tokens_per_pos"):
        published = [metrics[f'pyserve:{key}_total{{position="{p}"}}'] for p in range(3)]
        assert published == stats[key] and sum(published) > 0


def test_adapters_grammars_and_cached_prefixes_decode_as_without_the_head(head_dir):
    """The head drafts on the base model's features whatever adapter a request uses (the target
    verifies with its adapter), drafts of a constrained request are cut to its grammar, and a
    prompt served from the prefix cache is drafted for: each gives the plain engine's tokens."""
    from pyserve import LoRARequest
    from pyserve.default_model import ADAPTER_DIRS

    adapter = LoRARequest("tests", 1, str(ADAPTER_DIRS["tests"]))
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "size": {"type": "integer"}},
              "required": ["name", "size"], "additionalProperties": False}
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    constrained = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs={"json": schema})
    engine = dict(block_size=4, num_kv_blocks=256, enable_lora=True, max_loras=1)

    def run(config):
        with LLM(str(TARGET_DIR), speculative_config=config, **engine) as llm:
            with_adapter = llm.generate(PROMPTS[:2], greedy, lora_request=adapter, use_tqdm=False)
            json_out = llm.generate([PROMPTS[2]], constrained, use_tqdm=False)
            first = llm.generate([PROMPTS[3]], greedy, use_tqdm=False)
            cached = llm.generate([PROMPTS[3]], greedy, use_tqdm=False)
            tokens = [o.outputs[0].token_ids for o in [*with_adapter, *json_out, *first, *cached]]
            return tokens, json_out[0].outputs[0].text, cached[0].num_cached_tokens, llm.stats()

    plain, _, _, _ = run(None)
    eagle, text, cached_tokens, stats = run(spec(head_dir))
    assert eagle == plain
    assert set(json.loads(text)) == {"name", "size"}
    assert cached_tokens > 0
    assert stats["spec_decode_num_accepted_tokens"] > 0


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_a_quantized_target_drafts_with_a_head_quantized_alike_in_one_call(head_dir, monkeypatch, quantization):
    """The head is quantized by the target's method and its greedy proposals still go through
    `_core.eagle_greedy` (the quantized CPU layers' kernels); outputs are the quantized plain
    engine's."""
    from pyserve.speculative import eagle

    kernel_calls = []
    kernel = eagle.eagle_greedy
    monkeypatch.setattr(eagle, "eagle_greedy", lambda *a: kernel_calls.append(1) or kernel(*a))
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    engine = {"block_size": 4, "num_kv_blocks": 256, "quantization": quantization}
    with LLM(str(TARGET_DIR), **engine) as llm:
        plain = outputs(llm, PROMPTS[:2], greedy)
    with LLM(str(TARGET_DIR), speculative_config=spec(head_dir, tree_nodes=0), **engine) as llm:
        assert outputs(llm, PROMPTS[:2], greedy) == plain
        assert llm.stats()["spec_decode_num_accepted_tokens"] > 0
    assert len(kernel_calls) > 5
