"""The embedded default model family: what ships, that pyserve serves it exactly, and that the
model card's figures (docs/embedded-model.md and card.json) are what the shipped weights give."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from pyserve import LLM, SamplingParams
from pyserve.default_model import ADAPTER_DIRS, DEFAULT_MODEL_NAME, DRAFT_DIR, FAMILY_DIR, HEAD_DIR, TARGET_DIR
from pyserve.embeddings.packaged import NAME as EMBEDDING_MODEL
from pyserve.server.model_specs import DRAFT_MODEL_NAME
from pyserve.testing import assert_parity, hf_greedy, start_server, stop_server

CARD = json.loads((FAMILY_DIR / "card.json").read_text())
MODEL_CARD = Path(__file__).resolve().parents[2] / "docs" / "embedded-model.md"
CHAT = [{"role": "user", "content": CARD["samples"]["prompts"]["chat: a function"]}]


def num_params(model_dir: Path) -> int:
    from safetensors import safe_open

    with safe_open(model_dir / "model.safetensors", "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def card_row(label: str) -> list[str]:
    """The cells of the model card's table row that starts with `label`."""
    for line in MODEL_CARD.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0] == label:
            return cells[1:]
    raise AssertionError(f"docs/embedded-model.md has no model-card row {label!r}")


def test_family_ships_complete_small_and_in_safetensors():
    for d in (TARGET_DIR, DRAFT_DIR):
        for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
            assert (d / name).is_file(), d / name
    for name in ("config.json", "model.safetensors", "training.json"):
        assert (HEAD_DIR / name).is_file(), HEAD_DIR / name
    assert (DRAFT_DIR / "tokenizer.json").read_bytes() == (TARGET_DIR / "tokenizer.json").read_bytes()
    for d in ADAPTER_DIRS.values():
        assert (d / "adapter_config.json").is_file() and (d / "adapter_model.safetensors").is_file()
    files = [f for f in FAMILY_DIR.rglob("*") if f.is_file()]
    assert not [f for f in files if f.suffix in (".bin", ".pt", ".pth", ".pkl")]
    assert sum(f.stat().st_size for f in files) < 40_000_000
    target, draft = num_params(TARGET_DIR), num_params(DRAFT_DIR)
    assert (target, draft) == (CARD["target"]["parameters"], CARD["draft"]["parameters"])
    assert draft * 4 < target
    ranks = {json.loads((d / "adapter_config.json").read_text())["r"] for d in ADAPTER_DIRS.values()}
    assert ranks == {a["rank"] for a in CARD["adapters"].values()}


def test_default_llm_is_the_embedded_model_and_matches_transformers():
    with LLM(num_kv_blocks=256) as llm:
        prompt = llm.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
        prompts = [llm.tokenizer.encode(prompt), llm.tokenizer.encode("def read_lines(path):\n")]
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                            use_tqdm=False)
    assert_parity([o.outputs[0].token_ids for o in outs], hf_greedy(TARGET_DIR, prompts, max_tokens=24))


def test_card_samples_are_what_the_shipped_weights_write():
    """Base and adapter sample outputs in the card are reproduced (greedy, by the code that wrote
    them; pyserve's own parity with transformers is the test above) and differ visibly."""
    from peft import PeftModel
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from pyserve.default_model.training.evaluate import greedy_text
    from pyserve.default_model.training.tokenizer import stop_ids

    tok = Tokenizer.from_file(str(TARGET_DIR / "tokenizer.json"))
    outputs = CARD["samples"]["outputs"]["chat: a function"]
    prompt = f"<|user|>\n{CHAT[0]['content']}<|end|>\n<|assistant|>\n"
    base = AutoModelForCausalLM.from_pretrained(TARGET_DIR, dtype=torch.float32).eval()
    assert greedy_text(base, tok, prompt, stop_ids(tok)) == outputs["base"]
    for name, path in ADAPTER_DIRS.items():
        base = AutoModelForCausalLM.from_pretrained(TARGET_DIR, dtype=torch.float32).eval()
        model = PeftModel.from_pretrained(base, path).eval()
        assert greedy_text(model, tok, prompt, stop_ids(tok)) == outputs[name]
    assert len({outputs["base"], outputs["docstrings"], outputs["tests"]}) == 3


def test_card_held_out_figures_are_what_the_shipped_weights_give():
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from pyserve.default_model.training import corpus
    from pyserve.default_model.training.evaluate import draft_acceptance, mean_loss, windows
    from pyserve.default_model.training.pretrain import encode_stream

    _, held = corpus.source_files()
    docs = [text for _, text in held]
    if corpus.fingerprint(docs) != CARD["corpus"]["held_out_sha256"]:
        pytest.skip(f"this Python's held-out modules differ from Python {CARD['python']}'s")
    tok = Tokenizer.from_file(str(TARGET_DIR / "tokenizer.json"))
    batches = windows(encode_stream(tok, docs, tok.token_to_id(corpus.EOT)))
    assert batches.numel() == CARD["eval_tokens"]
    models = {name: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
              for name, d in (("target", TARGET_DIR), ("draft", DRAFT_DIR))}
    shown = card_row("held-out loss (nats/token)")
    for i, (name, model) in enumerate(models.items()):
        loss = mean_loss(model, batches)
        assert loss == pytest.approx(CARD[name]["held_out"]["loss"], abs=2e-3), name
        assert float(shown[i]) == pytest.approx(loss, abs=2e-3), f"model card, {name}"
    accept = draft_acceptance(models["target"], models["draft"], batches)
    assert accept["greedy"] == pytest.approx(CARD["draft_acceptance"]["greedy"], abs=2e-3)
    shown = card_row("draft acceptance, greedy / temperature 1")
    assert [float(x) for x in re.findall(r"[\d.]+", shown[0])] == pytest.approx(
        [accept["greedy"], accept["temperature_1"]], abs=2e-3)


def test_serve_with_no_model_answers_chat_with_the_embedded_model(tmp_path):
    import openai

    with LLM() as llm:
        want = llm.chat(CHAT, SamplingParams(temperature=0.0, max_tokens=48), use_tqdm=False)[0].outputs[0].text
    proc, base = start_server(None, workdir=tmp_path)
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
        assert [m.id for m in client.models.list().data] == [DEFAULT_MODEL_NAME, DRAFT_MODEL_NAME, EMBEDDING_MODEL]
        resp = client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=CHAT, max_tokens=48,
                                              temperature=0.0)
        assert resp.choices[0].message.content == want
        assert re.search(r"\b(def|return|self|if|for|import)\b", want), want  # it writes Python
    finally:
        assert stop_server(proc) == 0


def test_draft_model_speculation_defaults_to_the_embedded_draft():
    params = SamplingParams(temperature=0.0, max_tokens=48)
    with LLM() as llm:
        plain = llm.chat(CHAT, params, use_tqdm=False)[0].outputs[0].token_ids
    with LLM(speculative_config={"method": "draft_model", "adaptive": False}) as llm:
        assert llm.engine.spec_config.model == str(DRAFT_DIR)
        spec = llm.chat(CHAT, params, use_tqdm=False)[0].outputs[0].token_ids
        stats = llm.stats()
    assert spec == plain
    assert stats["spec_decode_num_accepted_tokens"] > 0


def test_eagle_speculation_defaults_to_the_shipped_head_which_keeps_most_guesses():
    """The shipped EAGLE-3 head (trained by `pyserve train-eagle` on the target's own answers;
    its training.json says how) on held-out standard-library code: plain decoding's tokens, and at
    a fixed depth of 4 more than 2.5 tokens a verifying step (its held-out acceptance: 3.36)."""
    from pyserve.default_model.training import corpus

    _, held = corpus.source_files()
    prompts = ["\n".join(fn.source.splitlines()[:3]) + "\n" for _, text in held for fn in corpus.functions(text)][:6]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    with LLM() as llm:
        plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(speculative_config={"method": "eagle3", "num_speculative_tokens": 4, "adaptive": False}) as llm:
        assert llm.engine.spec_config.model == str(HEAD_DIR)
        spec = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.stats()
    assert spec == plain
    assert stats["spec_decode_mean_acceptance_length"] > 2.5
    report = json.loads((HEAD_DIR / "training.json").read_text())
    assert report["held_out_mean_accepted"] > 2 and report["options"]["ttt_steps"] == 4
