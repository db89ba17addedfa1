"""A GGUF block type's row sizes (from the `gguf` package's table) and the widening of its rows to
f32 in Rust (`_core.gguf_widen`: gguf's arithmetic, bit for bit, a row at a time), shared by the
loader (model/gguf/weights.py) and the layers that keep a file's blocks (KQuantLinear,
BlockEmbedding)."""

from __future__ import annotations

import numpy as np

WIDENED_IN_RUST = ("Q4_0", "Q4_1", "Q4_K", "Q8_0", "Q5_0", "Q6_K")  # the types gguf_widen reads


def fan_in(kind: str, bytes_per_row: int) -> int:
    """Weights in a row of `bytes_per_row` bytes of a block type."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    weights, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    return bytes_per_row // size * weights


def row_bytes(kind: str, k: int) -> int:
    """Bytes of a row of `k` weights of a block type; -1 where k is not a whole number of its blocks."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    weights, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    return -1 if k % weights else k // weights * size


def widened(blocks: np.ndarray, kind: str, threads: int) -> np.ndarray:
    """Rows of blocks [rows, row bytes] of a WIDENED_IN_RUST type as f32 [rows, fan_in]."""
    from pyserve import _core

    out = np.empty((blocks.shape[0], fan_in(kind, blocks.shape[1])), dtype=np.float32)
    _core.gguf_widen(kind, np.ascontiguousarray(blocks), out, threads)
    return out
