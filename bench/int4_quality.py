"""`--quantization int4` on a real small model: perplexity per choice of group size and head.

Model: SmolLM2-135M-Instruct, its published Q4_1 GGUF widened by transformers into fp32 (the
weights pyserve quantizes at load, as a user with the HF checkpoint would). Text: this
repository's README.md and docs/*.md pages (written after the model was trained; the figures in
bench/README.md were scored on the README and architecture.md before the README's topics moved
to docs/, 27.4k tokens), scored in
windows of 1024 tokens. Each choice runs in transformers with every linear layer replaced by
pyserve's CPU arithmetic for it (pyserve.testing.quantized_reference: int4 groups on int16
activations, int8 weight-only on the dequantized weight; tests hold pyserve to both), and also
through pyserve's own engine for the default (prompt logprobs), so the table is what `serve`
gives. Reports perplexity, its change against fp32, top-1 agreement with fp32, and the greedy
continuation of "The three primary colors are" (32 tokens) with its common prefix with fp32's.
Writes bench/results/int4_quality.json.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import torch
from torch import nn

import harness
from quantization_real import WINDOW, scored as scored_by_engine  # windows of the same size
from pyserve import LLM
from pyserve.testing.quantized_reference import use_int4_reference, use_int8_reference
from pyserve.testing.real_models import fetch

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "The three primary colors are"
# name -> (group size, how the LM head is held); None: fp32
CHOICES = {
    "fp32": None,
    "int8": ("int8", "int8"),
    "int4 g64, head int4": (64, "int4"),
    "int4 g32, head int4": (32, "int4"),
    "int4 g64, head int8": (64, "int8"),
    "int4 g32, head int8": (32, "int8"),
}


def hf_dir(out: Path) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = fetch("smollm2-135m-instruct")
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = model.config
    del config.quantization_config  # transformers will not save a model it loaded from a GGUF
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)
    return out


def prepared(model_dir: Path, choice) -> nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if choice == ("int8", "int8"):
        use_int8_reference(model)
    elif choice is not None:
        use_int4_reference(model, *choice)
    return model


def scored(model: nn.Module, ids: list[int]) -> tuple[float, torch.Tensor]:
    """(summed negative log-likelihood, argmax per position) over windows of WINDOW tokens."""
    nll, tops = 0.0, []
    with torch.no_grad():
        for lo in range(0, len(ids) - 1, WINDOW):
            chunk = torch.tensor([ids[lo : lo + WINDOW + 1]])
            logits = model(chunk[:, :-1]).logits[0]
            nll += nn.functional.cross_entropy(logits, chunk[0, 1:], reduction="sum").item()
            tops.append(logits.argmax(-1))
    return nll, torch.cat(tops)


def greedy(model: nn.Module, ids: list[int], tokens: int = 32) -> list[int]:
    out = list(ids)
    with torch.no_grad():
        for _ in range(tokens):
            out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids):]


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def engine_ppl(model_dir: Path, ids: list[int], quantization: str | None) -> float:
    """Perplexity through pyserve's engine (prompt logprobs of each window), default group size."""
    with LLM(str(model_dir), quantization=quantization, max_model_len=WINDOW + 8) as llm:
        nll, _, count = scored_by_engine(llm, ids)
        print(f"  engine ({quantization or 'fp32'}): weight bytes {llm.stats()['weight_bytes'] / 1e6:.1f} MB")
    return math.exp(nll / count)


def main() -> None:
    ap = harness.parser(__doc__, "int4_quality")
    args = ap.parse_args()
    head = harness.header(__file__)
    harness.print_header(head)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = hf_dir(Path(tmp) / "smollm2")
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
        pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
        text = "\n".join(page.read_text() for page in pages)
        ids = tok.encode(text)
        prompt = tok.encode(PROMPT)
        rows, reference = {}, {}
        for name, choice in CHOICES.items():
            model = prepared(model_dir, choice)
            nll, tops = scored(model, ids)
            continuation = greedy(model, prompt)
            if choice is None:
                reference = {"nll": nll, "tops": tops, "greedy": continuation}
            rows[name] = {"ppl": math.exp(nll / (len(ids) - 1)),
                          "ppl_change": math.exp((nll - reference["nll"]) / (len(ids) - 1)) - 1,
                          "top1_agreement": float((tops == reference["tops"]).float().mean()),
                          "greedy_common_prefix": common_prefix(continuation, reference["greedy"]) / len(continuation),
                          "greedy": tok.decode(continuation)}
            r = rows[name]
            print(f"{name:22s} perplexity {r['ppl']:.3f} ({100 * r['ppl_change']:+.2f}%), top-1 agreement "
                  f"{100 * r['top1_agreement']:.1f}%, greedy prefix {r['greedy_common_prefix']:.2f}: "
                  f"{r['greedy'][:60]!r}", flush=True)
        engine = {q or "fp32": engine_ppl(model_dir, ids, q) for q in (None, "int4")}
        engine["int4_change"] = engine["int4"] / engine["fp32"] - 1
        print(f"engine, default settings: fp32 perplexity {engine['fp32']:.3f}, --quantization int4 "
              f"{engine['int4']:.3f} ({100 * engine['int4_change']:+.2f}%)")
    harness.write_report(args.out, {**head, "tokens": len(ids), "window": WINDOW, "choices": rows, "engine": engine})


if __name__ == "__main__":
    main()
