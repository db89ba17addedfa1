"""What a model path names, read without torch: a Hugging Face directory (config.json,
tokenizer.json) or a GGUF file (or a directory holding one), whose metadata gives both."""

from __future__ import annotations

from pathlib import Path

from pyserve.model.config import ModelConfig
from pyserve.model.gguf import gguf_path, open_gguf
from pyserve.model.gguf.config import config_dict
from pyserve.model.gguf.tokenizer import build_tokenizer
from pyserve.model.tokenizer import Tokenizer


def load_config(path: str | Path) -> ModelConfig:
    gguf = gguf_path(path)
    if gguf is None:
        return ModelConfig.from_dir(path)
    return ModelConfig.from_dict(config_dict(open_gguf(gguf)))


def load_tokenizer(path: str | Path) -> Tokenizer:
    gguf = gguf_path(path)
    if gguf is None:
        return Tokenizer.from_dir(path)
    inner, facts = build_tokenizer(open_gguf(gguf))
    eos = facts["eos_token"]
    return Tokenizer(inner=inner, chat_template=facts["chat_template"], bos_token=facts["bos_token"], eos_token=eos,
                     eos_token_id=inner.token_to_id(eos) if eos else None)
