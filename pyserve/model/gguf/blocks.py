"""A GGUF block type's row sizes and the widening of its rows to f32 in Rust (`_core.gguf_widen`:
gguf's arithmetic, bit for bit, a row at a time), shared by the loader (model/gguf/weights.py) and
the layers that keep a file's blocks (KQuantLinear, BlockEmbedding). The sizes of the types the
Rust kernels read come from their own table (`_core.GGUF_BLOCK_SIZES`; tests/model/test_gguf.py
checks it against the `gguf` package's), so that loading a file whose metadata is cached does not
import `gguf` (~0.05 s); other types take gguf's table."""

from __future__ import annotations

import numpy as np

from pyserve import _core

BLOCK_SIZES: dict[str, tuple[int, int]] = _core.GGUF_BLOCK_SIZES  # (weights, bytes) of a block
WIDENED_IN_RUST = tuple(BLOCK_SIZES)  # the types gguf_widen reads


def block_size(kind: str) -> tuple[int, int]:
    """(weights, bytes) of a block of a GGUF type."""
    if kind in BLOCK_SIZES:
        return BLOCK_SIZES[kind]
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType[kind]]


def fan_in(kind: str, bytes_per_row: int) -> int:
    """Weights in a row of `bytes_per_row` bytes of a block type."""
    weights, size = block_size(kind)
    return bytes_per_row // size * weights


def row_bytes(kind: str, k: int) -> int:
    """Bytes of a row of `k` weights of a block type; -1 where k is not a whole number of its blocks."""
    weights, size = block_size(kind)
    return -1 if k % weights else k // weights * size


def widened(blocks: np.ndarray, kind: str, threads: int) -> np.ndarray:
    """Rows of blocks [rows, row bytes] of a WIDENED_IN_RUST type as f32 [rows, fan_in]."""
    out = np.empty((blocks.shape[0], fan_in(kind, blocks.shape[1])), dtype=np.float32)
    _core.gguf_widen(kind, np.ascontiguousarray(blocks), out, threads)
    return out
