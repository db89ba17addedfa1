"""What every embedding model offers the server: token ids in, one unit-length float32 vector
per input out (cosine similarity is a dot product)."""

from __future__ import annotations

from typing import Protocol

import numpy as np


class Encoder(Protocol):
    name: str  # the `model` requests give
    dim: int
    vocab_size: int
    max_input_tokens: int  # a longer input is refused (400 naming `input`)
    source: str  # where its weights are (a file, a directory)

    def tokenize(self, texts: list[str]) -> list[list[int]]: ...

    def embed_ids(self, inputs: list[list[int]]) -> np.ndarray:
        """(len(inputs), dim) float32, each row of unit length (a row of zeros for an input of
        no tokens)."""
        ...


def embed_texts(encoder: Encoder, texts: list[str]) -> np.ndarray:
    """The texts' vectors, each cut to the model's length (for the cache's and the routers'
    queries; /v1/embeddings refuses an over-long input instead)."""
    return encoder.embed_ids([ids[: encoder.max_input_tokens] for ids in encoder.tokenize(texts)])


def unit_rows(x: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return (x / np.where(norms == 0, 1, norms)).astype(np.float32, copy=False)
