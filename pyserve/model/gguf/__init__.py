"""GGUF files (llama.cpp's format) served as they are: read with the `gguf` package (llama.cpp's
own reader), their metadata turned into the config and tokenizer pyserve builds from a Hugging
Face directory, their tensors into pyserve's layers (4-bit blocks on the int4 path, 8-bit blocks
on the int8 path, other block formats dequantized once at load)."""

from pyserve.model.gguf.file import GgufFile, gguf_path, open_gguf

__all__ = ["GgufFile", "gguf_path", "open_gguf"]
