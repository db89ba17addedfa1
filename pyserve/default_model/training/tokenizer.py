"""A byte-level BPE tokenizer for Python source, with the chat special tokens."""

from __future__ import annotations

import json
from pathlib import Path

from .corpus import CHAT_TEMPLATE, END, EOT, SPECIAL_TOKENS


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def save_tokenizer(tok, out: Path) -> None:
    """tokenizer.json plus a tokenizer_config.json carrying the chat template; the end-of-text
    token is the EOS (the end-of-turn token is a second stop id, listed in config.json)."""
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                                  "normalized": False, "single_word": False}
        for t in SPECIAL_TOKENS
    }
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": EOT, "pad_token": EOT,
        "unk_token": None, "added_tokens_decoder": added, "chat_template": CHAT_TEMPLATE,
        "model_max_length": 2048, "clean_up_tokenization_spaces": False,
    }, indent=2) + "\n")


def stop_ids(tok) -> list[int]:
    return [tok.token_to_id(EOT), tok.token_to_id(END)]
