"""Trains the embedded default model family from the Python standard library's source:

    pip install 'pyserve[train]'
    python -m pyserve.default_model.training [--out DIR] [--quick]

It writes DIR/target and DIR/draft (Hugging Face model directories), DIR/adapters/docstrings and
DIR/adapters/tests (PEFT LoRA adapters) and DIR/card.json (every figure of the model card, as
measured by this run). The default DIR is the one the package serves from. The draft is distilled
from the target (distill.py). `--only draft` retrains just the draft against the target and
tokenizer already in DIR and updates the draft's figures in the card.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import time
from pathlib import Path

import torch

from .. import FAMILY_DIR
from . import corpus
from .distill import kl_to_teacher, target_continuations
from .evaluate import draft_acceptance, greedy_text, loss_report, mean_loss, windows
from .pretrain import Schedule, encode_stream, train
from .tokenizer import save_tokenizer, stop_ids, train_tokenizer

SEED = 1234
VOCAB_SIZE = 4096
TARGET = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=768)
DRAFT = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             intermediate_size=384)
ADAPTERS = {
    "docstrings": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                           "gate_proj", "up_proj", "down_proj"]),
    "tests": dict(r=16, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"]),
}
SCHEDULES = {
    "full": dict(target=Schedule(700, 8, 512, 2e-3), draft=Schedule(700, 8, 512, 3e-3),
                 adapter=Schedule(150, 8, 256, 2e-3, warmup=10),
                 continuations=dict(count=1024, prompt_len=64, max_tokens=256)),
    "quick": dict(target=Schedule(4, 2, 64, 2e-3, warmup=2), draft=Schedule(4, 2, 64, 3e-3, warmup=2),
                  adapter=Schedule(3, 2, 64, 2e-3, warmup=1),
                  continuations=dict(count=4, prompt_len=16, max_tokens=64)),
}
SAMPLE_PROMPTS = {
    "chat: a function": "Write a Python function: Return the number of lines in the file at path.",
    "chat: a test": "Write a test: split quoted words",
}


def llama_config(tok, sizes: dict):
    from transformers import LlamaConfig

    eot, end = stop_ids(tok)
    return LlamaConfig(
        vocab_size=tok.get_vocab_size(), max_position_embeddings=2048, rope_theta=10000.0,
        tie_word_embeddings=True, bos_token_id=eot, eos_token_id=[eot, end], pad_token_id=eot,
        initializer_range=0.02, **sizes,
    )


def params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def chat_prompt(text: str) -> str:
    return f"<|user|>\n{text}<|end|>\n<|assistant|>\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m pyserve.default_model.training", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=FAMILY_DIR)
    ap.add_argument("--quick", action="store_true", help="a few steps only: checks the pipeline")
    ap.add_argument("--only", choices=["draft"], help="retrain only the draft, against the target in DIR")
    args = ap.parse_args(argv)
    from peft import LoraConfig, get_peft_model
    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM

    torch.set_num_threads(max(1, torch.get_num_threads()))
    plan = SCHEDULES["quick" if args.quick else "full"]
    started = time.perf_counter()
    train_files, held_files = corpus.source_files()
    base_docs = corpus.shuffled(corpus.base_documents(train_files), SEED)
    held_docs = [text for _, text in held_files]
    t0 = time.perf_counter()
    if args.only:
        tok = Tokenizer.from_file(str(args.out / "target" / "tokenizer.json"))
    else:
        tok = train_tokenizer(base_docs, VOCAB_SIZE)
    tok_seconds = time.perf_counter() - t0
    eot = stop_ids(tok)[0]
    stream = encode_stream(tok, base_docs, eot)
    held_stream = encode_stream(tok, held_docs, eot)
    bytes_per_token = sum(len(d.encode()) for d in held_docs) / (len(held_stream) - len(held_docs))
    print(f"tokenizer: {tok.get_vocab_size()} tokens in {tok_seconds:.0f} s; corpus {len(stream):,} tokens, "
          f"held-out {len(held_stream):,}", flush=True)

    card: dict = {
        "python": platform.python_version(), "torch": torch.__version__, "seed": SEED,
        "threads": torch.get_num_threads(), "quick": args.quick,
        "corpus": {"train_modules": len(train_files), "train_tokens": int(len(stream)),
                   "held_out_modules": list(corpus.HELD_OUT), "held_out_tokens": int(len(held_stream)),
                   "held_out_sha256": corpus.fingerprint(held_docs)},
        "tokenizer": {"vocab_size": tok.get_vocab_size(), "seconds": round(tok_seconds, 1),
                      "held_out_bytes_per_token": round(bytes_per_token, 2)},
    }
    if args.only:  # the tokenizer and target stay; so do their figures
        card = {**json.loads((args.out / "card.json").read_text()), "draft": {}}
    models = {}
    for name, sizes in (("target", TARGET), ("draft", DRAFT)):
        if name == "target" and args.only:
            models[name] = LlamaForCausalLM.from_pretrained(args.out / name, dtype=torch.float32).eval()
            continue
        torch.manual_seed(SEED)
        model = LlamaForCausalLM(llama_config(tok, sizes))
        if name == "draft":
            t0 = time.perf_counter()
            continuations = plan["continuations"]
            generated = target_continuations(str(args.out / "target"), stream, eot, **continuations, seed=SEED)
            print(f"target continuations: {len(generated):,} tokens in {time.perf_counter() - t0:.0f} s", flush=True)
            report = train(model, [stream, generated], plan[name], SEED, name, loss_fn=kl_to_teacher(models["target"]))
            report["distillation"] = {**continuations, "tokens": int(len(generated)),
                                      "seconds": round(time.perf_counter() - t0 - report["train_seconds"], 1)}
        else:
            report = train(model, stream, plan[name], SEED, name)
        out = args.out / name
        shutil.rmtree(out, ignore_errors=True)
        model.save_pretrained(out, safe_serialization=True)
        save_tokenizer(tok, out)
        models[name] = model
        card[name] = {"parameters": params(model), **sizes, **report}

    eval_batches = windows(held_stream)
    for name, model in models.items():
        card[name]["held_out"] = loss_report(mean_loss(model, eval_batches))
        print(f"{name}: held-out {card[name]['held_out']}", flush=True)
    card["draft_acceptance"] = draft_acceptance(models["target"], models["draft"], eval_batches)
    card["eval_tokens"] = int(eval_batches.numel())
    if args.only:
        write_card(args.out, card, started, seconds_key="draft_only_seconds")
        return

    test_train, test_held = corpus.test_files()
    style_docs = {
        "docstrings": (corpus.docstring_documents(train_files), corpus.docstring_documents(held_files)),
        "tests": (corpus.test_documents(test_train), corpus.test_documents(test_held)),
    }
    card["adapters"] = {}
    samples = {name: {"base": greedy_text(models["target"], tok, chat_prompt(p), stop_ids(tok))}
               for name, p in SAMPLE_PROMPTS.items()}
    for name, lora in ADAPTERS.items():
        train_docs, held_style = style_docs[name]
        style_stream = encode_stream(tok, corpus.shuffled(train_docs, SEED), eot)
        style_eval = windows(encode_stream(tok, held_style, eot), seq_len=256)
        base_loss = mean_loss(models["target"], style_eval)
        peft_model = get_peft_model(models["target"], LoraConfig(lora_dropout=0.0, **lora))
        report = train(peft_model, style_stream, plan["adapter"], SEED, f"lora:{name}")
        out = args.out / "adapters" / name
        shutil.rmtree(out, ignore_errors=True)
        peft_model.save_pretrained(out, safe_serialization=True)
        adapter_loss = mean_loss(peft_model, style_eval)
        for prompt_name, p in SAMPLE_PROMPTS.items():
            samples[prompt_name][name] = greedy_text(peft_model, tok, chat_prompt(p), stop_ids(tok))
        models["target"] = peft_model.unload()  # the base weights, unchanged
        card["adapters"][name] = {
            "rank": lora["r"], "lora_alpha": lora["lora_alpha"], "target_modules": lora["target_modules"],
            **report, "held_out_style_loss": {"base": round(base_loss, 4), "adapter": round(adapter_loss, 4)},
        }
        print(f"lora:{name}: held-out style loss {base_loss:.3f} -> {adapter_loss:.3f}", flush=True)
    card["samples"] = {"prompts": SAMPLE_PROMPTS, "outputs": samples}
    write_card(args.out, card, started)


def write_card(out_dir: Path, card: dict, started: float, seconds_key: str = "total_seconds") -> None:
    """Fixes the written files' permissions and writes card.json (with the run's time)."""
    card[seconds_key] = round(time.perf_counter() - started, 1)
    for f in out_dir.rglob("*"):
        if f.name == "README.md":
            f.unlink()  # PEFT's blank model-card template; the card is docs/embedded-model.md
        elif f.is_file():
            f.chmod(0o644)  # safetensors are written 0600; installed files must be world-readable
    card["bytes_on_disk"] = sum(f.stat().st_size for f in out_dir.rglob("*") if f.is_file())
    (out_dir / "card.json").write_text(json.dumps(card, indent=2) + "\n")
    print(json.dumps(card, indent=2))


if __name__ == "__main__":
    main()
