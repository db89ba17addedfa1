"""A GGUF file's tokenizer (`tokenizer.ggml.*`) built as a `tokenizers` Tokenizer, as the model's
Hugging Face `tokenizer.json` would describe it:
- "gpt2": byte-level BPE from the file's tokens and merges, text split before merging as the
  vocabulary's `tokenizer.ggml.pre` says (the splits llama.cpp applies for the same names);
- "llama": SentencePiece BPE (spaces as U+2581, unknown bytes as `<0xNN>` tokens), its merges
  derived from the tokens' scores, as SentencePiece ranks them.
Control tokens (type 3) are special tokens and user-defined ones (type 4) added tokens, matched
whole in text; `add_bos_token` puts the BOS token first."""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from pyserve.model.config import UnsupportedModelError
from pyserve.model.gguf.file import GgufFile

_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")


def _byte_level(split: str | None = None, digits: bool = False) -> pre_tokenizers.PreTokenizer:
    """Byte-level splitting: GPT-2's own pattern (split None), or `split` then bytes; `digits`:
    each digit a piece of its own first."""
    steps: list[pre_tokenizers.PreTokenizer] = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    if split is None:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps += [pre_tokenizers.Split(Regex(split), behavior="isolated"),
                  pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    return pre_tokenizers.Sequence(steps)


# tokenizer.ggml.pre -> how text is split before BPE.
PRE_TOKENIZERS = {
    "default": lambda: _byte_level(),
    "gpt-2": lambda: _byte_level(),
    "smollm": lambda: _byte_level(digits=True),
    "qwen2": lambda: _byte_level(_QWEN2),
    "deepseek-r1-qwen": lambda: _byte_level(_QWEN2),
    "llama3": lambda: _byte_level(_LLAMA3),
    "llama-v3": lambda: _byte_level(_LLAMA3),
    "llama-bpe": lambda: _byte_level(_LLAMA3),
}
CONTROL, USER_DEFINED = 3, 4


def build_tokenizer(f: GgufFile) -> tuple[HFTokenizer, dict[str, Any]]:
    """(the tokenizer, its tokenizer_config-like facts: chat_template, bos_token, eos_token)."""
    kind = f.get("tokenizer.ggml.model")
    tokens: list[str] = f.get("tokenizer.ggml.tokens") or []
    if not tokens:
        raise UnsupportedModelError("GGUF file has no tokenizer (tokenizer.ggml.tokens)")
    types: list[int] = f.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "gpt2":
        tok = _gpt2(f, tokens)
    elif kind == "llama":
        tok = _sentencepiece(f, tokens, types)
    else:
        raise UnsupportedModelError(f"GGUF tokenizer.ggml.model {kind!r} is not supported (gpt2, llama)")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == USER_DEFINED])
    bos_id, eos_id = f.get("tokenizer.ggml.bos_token_id"), f.get("tokenizer.ggml.eos_token_id")
    bos = tokens[bos_id] if bos_id is not None and bos_id < len(tokens) else None
    eos = tokens[eos_id] if eos_id is not None and eos_id < len(tokens) else None
    if bos is not None and f.get("tokenizer.ggml.add_bos_token", kind == "llama"):
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, bos_id)])
    return tok, {"chat_template": f.get("tokenizer.chat_template"), "bos_token": bos, "eos_token": eos}


def _gpt2(f: GgufFile, tokens: list[str]) -> HFTokenizer:
    pre = f.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise UnsupportedModelError(f"GGUF tokenizer.ggml.pre {pre!r} is not supported; supported: "
                                    f"{', '.join(PRE_TOKENIZERS)}")
    merges = [tuple(m.split(" ", 1)) for m in f.get("tokenizer.ggml.merges") or []]
    tok = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(f: GgufFile, tokens: list[str], types: list[int]) -> HFTokenizer:
    scores: list[float] = f.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    unk = f.get("tokenizer.ggml.unknown_token_id")
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=_merges_by_score(tokens, scores, types), fuse_unk=True,
                                byte_fallback=True, unk_token=tokens[unk] if unk is not None else None))
    steps = [normalizers.Replace(" ", "\u2581")]
    if f.get("tokenizer.ggml.add_space_prefix", True):
        steps.insert(0, normalizers.Prepend("\u2581"))
    tok.normalizer = normalizers.Sequence(steps)
    strip = [decoders.Strip(" ", 1, 0)] if f.get("tokenizer.ggml.add_space_prefix", True) else []
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), *strip])
    return tok


def _merges_by_score(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """SentencePiece BPE merges in the order it applies them: every split of a normal token into
    two tokens of the vocabulary, the merged token with the higher score first (then the lower id)."""
    normal = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == 1}
    ranked = []
    for token, i in normal.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in normal and right in normal:
                ranked.append((-scores[i], i, left, right))
    ranked.sort()
    return [(left, right) for _, _, left, right in ranked]
