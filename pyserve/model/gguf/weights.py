"""A GGUF file's tensors under the Hugging Face names pyserve's model uses, and the served layer of
each quantized projection:
- Q4_K, Q5_0, Q6_K, Q8_0, Q4_0 and Q4_1 on a CPU: a KQuantLinear over the file's blocks as they
  are (the mapped file itself; model/kquant_linear.py); on other devices they take the
  conversions below (the Triton kernels' layouts);
- Q4_0 / Q4_1 (32 weights a block: a scale, and for Q4_1 a minimum) and Q4_K (256 weights a
  block: fp16 d and dmin, 6-bit scale sc and minimum m for each of 8 groups of 32) off the CPU:
  an Int4Linear in groups of 32, the nibbles repacked into its order, each group's scale and
  offset in f16 as the file has them (Q4_0's offset is -8 scales): the same weights, bit for bit,
  no widening; Q4_K's scale d * sc and offset -dmin * m are products rounded to f16 (within 2^-11
  of each);
- Q8_0, Q5_0, Q6_K off the CPU, and Q5_1 and Q5_K anywhere: an Int8Linear, whose kernels take one
  scale per row: each row widened (gguf's arithmetic) and re-rounded to int8 (half a step at most,
  the step the row's largest weight / 127): tests/model/test_gguf.py bounds it; on
  Qwen2.5-Coder-0.5B's Q4_K_M file RMS(error) / RMS(weight) is 0.9% for Q8_0 and Q5_0, 1.6% for
  Q6_K (2.0-2.7% the worst tensor). The 4-bit repacking and Q8_0 / Q5_0 / Q6_K's rounding run in
  Rust a row at a time (rust/cpu_kernels/src/gguf_blocks.rs); Q5_1 / Q5_K go through gguf's
  widening;
- Q2_K / Q3_K: dequantized once with the `gguf` package (llama.cpp's reference arithmetic) into a
  full-precision layer (no file of them measured on the int8 path yet);
- F32 / F16 / BF16 as they are (an F32 tensor on the CPU is the mapped file itself).
A quantized embedding of a type `_core.gguf_widen` reads stays in its blocks on a CPU (a
BlockEmbedding widens the rows a step looks up); elsewhere, or of another type, it is widened.
llama.cpp's converter reorders the rows of a Llama-family file's q and k projections for its own
rotary layout; `_rows_in_hf_order` restores Hugging Face's, for raw blocks as for floats (a row's
blocks move whole)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import torch
from torch import nn

from pyserve.model.block_embedding import BlockEmbedding
from pyserve.model.errors import WeightsError
from pyserve.model.gguf.blocks import WIDENED_IN_RUST, fan_in, row_bytes, widened
from pyserve.model.gguf.file import INT4_TYPES, INT8_TYPES, PLAIN_TYPES, GgufFile
from pyserve.model.kquant_linear import KQUANT_TYPES, KQuantLinear
from pyserve.model.quantized_linear import Int4Linear, Int8Linear, quantize_int8

_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
QK_PERMUTED = ("llama", "mistral")  # architectures whose converter permutes q/k rows
ROWS_IN_RUST = ("Q8_0", "Q5_0", "Q6_K")  # INT8_TYPES rounded to int8 in Rust; the others through gguf's widening


def hf_name(name: str) -> str | None:
    if name in _GLOBAL:
        return _GLOBAL[name]
    m = _BLOCK.fullmatch(name)
    if m is None or m.group(2) not in _LAYER:
        return None
    return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}.{m.group(3)}"


class GgufWeights:
    """The loader's view of a GGUF file (model/loader.py): `tensors()` gives (HF name, tensor);
    a quantized projection's tensor is its raw blocks, which `owns` claims and `layer` serves."""

    def __init__(self, f: GgufFile, num_heads: int, num_kv_heads: int, head_dim: int, dequantize: bool,
                 device: torch.device):
        """`dequantize`: every projection widened to the serving dtype (the reference the native
        layers are measured against); `device`: where the model is served."""
        self.file = f
        kind = f.type_of("token_embd.weight")
        # the embedding's blocks in place, for a BlockEmbedding (None: it is widened)
        self.embedding_kind = kind if kind in WIDENED_IN_RUST and device.type == "cpu" and not dequantize else None
        self.heads = {"attn_q": num_heads, "attn_k": num_kv_heads}
        self.head_dim = head_dim
        self.dequantize = dequantize
        self.types: dict[str, str] = {}  # HF name of a quantized projection's weight -> its GGUF type

    @property
    def method(self) -> str | None:
        """The quantization served, as stats() reports a pre-quantized checkpoint's (after tensors())."""
        if self.dequantize or not self.types:
            return None
        return "gguf-" + "+".join(sorted(set(self.types.values())))

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        f = self.file
        for name in f.tensors:
            target = hf_name(name)
            if target is None:
                raise WeightsError(f"GGUF tensor {name} is not one pyserve's {f.architecture} model uses")
            kind = f.type_of(name)
            data = self._rows_in_hf_order(name, f.data(name))
            if name == "token_embd.weight" and f.head_from_quantized_embedding:  # the head, from the same blocks
                self.types["lm_head.weight"] = kind
                yield "lm_head.weight", torch.from_numpy(np.ascontiguousarray(data))
            if kind in PLAIN_TYPES:
                tensor = torch.from_numpy(data)
                yield target, tensor.view(torch.bfloat16) if kind == "BF16" else tensor
            elif name == "token_embd.weight":  # looked up a row at a time: its blocks, or widened once
                yield target, torch.from_numpy(data if self.embedding_kind else _dequantize(data, kind, name))
            else:
                self.types[target] = kind
                yield target, torch.from_numpy(data)

    def owns(self, name: str, tensor: torch.Tensor) -> bool:
        return name in self.types or (name == "model.embed_tokens.weight" and self.embedding_kind is not None)

    def embedding(self, blocks: torch.Tensor, table: nn.Embedding, dtype: torch.dtype) -> BlockEmbedding:
        """The embedding `table` stands for, over its blocks as the file holds them, its rows
        looked up as `dtype`."""
        kind, dim = self.embedding_kind, table.embedding_dim
        if tuple(blocks.shape) != (table.num_embeddings, row_bytes(kind, dim)):
            raise WeightsError(f"GGUF token_embd.weight ({kind}) has {tuple(blocks.shape)} bytes, the config "
                               f"implies {(table.num_embeddings, row_bytes(kind, dim))}")
        return BlockEmbedding(blocks, kind, dtype)

    def layer(self, module_name: str, tensors: dict[str, torch.Tensor], linear: nn.Linear, dtype: torch.dtype,
              device: torch.device) -> nn.Module:
        kind = self.types[f"{module_name}.weight"]
        blocks = tensors["weight"].numpy()
        bias = None if linear.bias is None else linear.bias.detach()
        n, k = linear.out_features, linear.in_features
        if blocks.shape != (n, row_bytes(kind, k)):
            raise WeightsError(f"GGUF weight of {module_name} ({kind}) has {blocks.shape} bytes, the config implies "
                               f"{(n, row_bytes(kind, k))}")
        if kind in KQUANT_TYPES and device.type == "cpu" and not self.dequantize:  # the file's blocks in place
            return KQuantLinear(tensors["weight"], kind, bias)
        if kind in INT4_TYPES and not self.dequantize:
            packed, scales, offsets = q4_blocks(blocks, kind)
            return Int4Linear(packed.to(device), scales.to(device), offsets.to(device), 32,
                              None if bias is None else bias.to(device))
        if kind in INT8_TYPES and not self.dequantize:
            if kind in ROWS_IN_RUST:
                q, scales = int8_rows(blocks, kind)
            else:
                q, scales = quantize_int8(torch.from_numpy(_dequantize(blocks, kind, module_name)))
            return Int8Linear(q.to(device), scales.to(device), None if bias is None else bias.to(device))
        weight = torch.from_numpy(_dequantize(blocks, kind, module_name))
        out = nn.Linear(k, n, bias=bias is not None, device="meta")
        out.weight = nn.Parameter(weight.to(device=device, dtype=dtype), requires_grad=False)
        if bias is not None:
            out.bias = nn.Parameter(bias.to(device=device, dtype=dtype), requires_grad=False)
        return out

    def _rows_in_hf_order(self, name: str, data: np.ndarray) -> np.ndarray:
        """The inverse of llama.cpp's q/k row permutation: within each head its converter interleaves
        the rotary halves' rows (row 2i from the first half, 2i + 1 from the second)."""
        role = name.split(".")[2] if name.startswith("blk.") else ""
        if self.file.architecture not in QK_PERMUTED or role not in self.heads:
            return data
        heads = self.heads[role]
        rest = data.shape[1:]
        return data.reshape(heads, self.head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(data.shape)


def q4_blocks(blocks: np.ndarray, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed uint8 [N, K / 2] in Int4Linear's order, scales [N, K / 32], offsets [N, K / 32] f16)
    of Q4_0 / Q4_1 / Q4_K blocks [N, row bytes], converted in Rust one row at a time
    (rust/cpu_kernels/src/gguf_blocks.rs has the layouts)."""
    from pyserve import _core

    n, k = blocks.shape[0], fan_in(kind, blocks.shape[1])
    packed = np.empty((n, k // 2), dtype=np.uint8)
    scales, offsets = (np.empty((n, k // 32), dtype=np.float16) for _ in range(2))
    _core.gguf_repack_q4(kind, np.ascontiguousarray(blocks), packed, scales, offsets, torch.get_num_threads())
    return torch.from_numpy(packed), torch.from_numpy(scales), torch.from_numpy(offsets)


def int8_rows(blocks: np.ndarray, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [N, K], scales f32 [N]) of Q8_0 / Q5_0 / Q6_K blocks [N, row bytes]: each row widened
    with gguf's arithmetic and rounded as quantize_int8 rounds, in Rust one row at a time (the
    bits of quantize_int8 over gguf's dequantization, without the widened tensor)."""
    from pyserve import _core

    n, k = blocks.shape[0], fan_in(kind, blocks.shape[1])
    q, scales = np.empty((n, k), dtype=np.int8), np.empty(n, dtype=np.float32)
    _core.gguf_requantize_int8(kind, np.ascontiguousarray(blocks), q, scales, torch.get_num_threads())
    return torch.from_numpy(q), torch.from_numpy(scales)


def _dequantize(blocks: np.ndarray, kind: str, name: str) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    if kind in WIDENED_IN_RUST:  # gguf's arithmetic, bit for bit, a row at a time
        return widened(blocks, kind, torch.get_num_threads())
    try:
        return np.ascontiguousarray(dequantize(blocks, GGMLQuantizationType[kind]), dtype=np.float32)
    except (ValueError, KeyError, NotImplementedError) as e:
        raise WeightsError(f"GGUF tensor {name} ({kind}) could not be dequantized: {e}") from None
