"""Renders the model card (docs/embedded-model.md) from card.json: `python -m pyserve.default_model.training.card`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .. import FAMILY_DIR


def _fence(text: str) -> str:
    return "```\n" + text.rstrip() + "\n```"


def card_markdown(card: dict) -> str:
    t, d, acc = card["target"], card["draft"], card["draft_acceptance"]
    mib = card["bytes_on_disk"] / 2**20

    def shape(m: dict) -> str:
        return (f"{m['num_hidden_layers']} layers, hidden {m['hidden_size']}, {m['num_attention_heads']} heads "
                f"({m['num_key_value_heads']} KV), MLP {m['intermediate_size']}")

    lines = [
        "| | target | draft |",
        "|---|---|---|",
        f"| parameters | {t['parameters']:,} | {d['parameters']:,} |",
        f"| shape (Llama, tied embeddings, vocab {card['tokenizer']['vocab_size']}) | {shape(t)} | {shape(d)} |",
        f"| training tokens (steps x batch x context) | {t['train_tokens']:,} ({t['steps']} x {t['batch']} x "
        f"{t['seq_len']}) | {d['train_tokens']:,} ({d['steps']} x {d['batch']} x {d['seq_len']}) |",
        f"| training objective | next token | {_draft_objective(d)} |",
        f"| training time ({card['threads']} CPU threads) | {t['train_seconds'] / 60:.1f} min | "
        f"{d['train_seconds'] / 60:.1f} min |",
        f"| held-out loss (nats/token) | {t['held_out']['loss']:.4f} | {d['held_out']['loss']:.4f} |",
        f"| held-out perplexity | {t['held_out']['perplexity']:.2f} | {d['held_out']['perplexity']:.2f} |",
        f"| draft acceptance, greedy / temperature 1 | {acc['greedy']:.4f} / {acc['temperature_1']:.4f} | |",
        "",
        f"Corpus: the standard library of Python {card['python']} ({card['corpus']['train_modules']} modules, "
        f"{card['corpus']['train_tokens']:,} tokens with one chat exchange per documented function: the "
        "docstring's summary asks, the function answers). Held out: "
        f"{', '.join(card['corpus']['held_out_modules'])} ({card['corpus']['held_out_tokens']:,} tokens; the "
        f"figures above use the first {card['eval_tokens']:,}). Tokenizer: byte-level BPE, "
        f"{card['tokenizer']['held_out_bytes_per_token']} bytes per token on the held-out code. The draft "
        "acceptance is measured per position of the held-out text: greedy = the draft's top token is the "
        "target's; temperature 1 = the mean of sum_x min(p(x), q(x)), the chance rejection sampling keeps "
        "a draft token.",
        "",
        "| adapter | rank / alpha | modules | training | held-out style loss, base -> adapter |",
        "|---|---|---|---|---|",
    ]
    for name, a in card["adapters"].items():
        loss = a["held_out_style_loss"]
        lines.append(f"| `{name}` | {a['rank']} / {a['lora_alpha']} | {', '.join(a['target_modules'])} | "
                     f"{a['train_tokens']:,} tokens, {a['train_seconds'] / 60:.1f} min | "
                     f"{loss['base']:.3f} -> {loss['adapter']:.3f} |")
    lines += ["", f"Whole family on disk: {mib:.1f} MiB. One training run: {card['total_seconds'] / 60:.1f} min "
              "(tokenizer, both models, both adapters and these measurements)."]
    if "draft_only_seconds" in card:
        lines[-1] += (f" The draft was then retrained alone against the shipped target (`--only draft`): "
                      f"{card['draft_only_seconds'] / 60:.1f} min, continuations and measurements included.")
    samples = card["samples"]
    for prompt_name, prompt in samples["prompts"].items():
        lines += ["", f"Greedy samples, {prompt_name} (`{prompt}`):"]
        for who, text in samples["outputs"][prompt_name].items():
            lines += ["", f"{who}:", "", _fence(text)]
    return "\n".join(lines) + "\n"


def _draft_objective(d: dict) -> str:
    dist = d.get("distillation")
    if dist is None:
        return "next token"
    return (f"KL to the target's next-token distribution; half the windows corpus, half the target's greedy "
            f"continuations of {dist['count']:,} corpus prefixes of {dist['prompt_len']} tokens "
            f"({dist['tokens']:,} tokens, {dist['seconds'] / 60:.1f} min to generate)")


if __name__ == "__main__":
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else FAMILY_DIR / "card.json"
    sys.stdout.write(card_markdown(json.loads(path.read_text())))
