"""The decoder split over the ranks of a tensor-parallel group, in place after loading:

- q/k/v and gate/up are column-parallel: rank r keeps its share of the heads (query heads and KV
  heads alike) and of the intermediate features, so attention and the MLP's activation run on
  local data;
- o and down are row-parallel: rank r keeps the matching input columns, and its partial sums are
  all-reduced (one all-reduce after attention, one after the MLP); a bias is added by rank 0 only;
- the embedding and the LM head are vocab-parallel: rank r keeps rows [r * V', (r + 1) * V') of
  the vocabulary padded to a multiple of the group's size; the embedding's lookups are
  all-reduced, the head's logits all-gathered (the padding cut off).

Norms and rotary tables are replicated. After sharding every rank holds the same residual
stream, so the same hidden rows give every rank the same logits.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from pyserve.model.block_embedding import BlockEmbedding
from pyserve.model.config import ModelConfig
from pyserve.model.decoder import CausalLM
from pyserve.model.quantized_linear import Fp8Linear, Int8Linear
from pyserve.parallel.group import TensorParallelGroup


def check_divisible(cfg: ModelConfig, size: int) -> None:
    """ValueError naming tensor_parallel_size when the model cannot be split `size` ways."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {size}")
    for name, value in (("num_attention_heads", cfg.num_heads), ("num_key_value_heads", cfg.num_kv_heads),
                        ("intermediate_size", cfg.intermediate_size)):
        if value % size:
            raise ValueError(f"tensor_parallel_size {size} does not divide the model's {name} ({value})")


def local_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The shapes one rank holds (its KV cache is allocated from them)."""
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // size, num_kv_heads=cfg.num_kv_heads // size,
                               intermediate_size=cfg.intermediate_size // size)


class RowParallel(nn.Module):
    """A row-parallel projection: the local partial product, all-reduced."""

    def __init__(self, inner: nn.Module, group: TensorParallelGroup):
        super().__init__()
        self.inner, self.group = inner, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.inner(x))


class VocabParallelEmbedding(nn.Module):
    def __init__(self, weight: torch.Tensor, start: int, group: TensorParallelGroup):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start, self.group = start, group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        rows = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        return self.group.all_reduce(rows.masked_fill_(outside.unsqueeze(-1), 0))


class VocabParallelHead(nn.Module):
    """The rank's rows of the LM head (`inner`, a plain projection the CPU kernels or
    quantization may replace like any other), its logits all-gathered, the padding cut off."""

    def __init__(self, inner: nn.Module, vocab_size: int, group: TensorParallelGroup):
        super().__init__()
        self.inner, self.vocab_size, self.group = inner, vocab_size, group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather_last(self.inner(hidden))[..., : self.vocab_size]


def _rows(t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    return t[lo:hi].clone()


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    layer.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias, requires_grad=False)
    return layer


def _column(layer: nn.Module, parts: int, rank: int, name: str) -> nn.Linear:
    if not isinstance(layer, nn.Linear):
        raise ValueError(f"tensor_parallel_size: {name} is a {type(layer).__name__}; pre-quantized checkpoints "
                         "are not split over ranks (quantize at load with --quantization instead)")
    step = layer.out_features // parts
    lo, hi = rank * step, (rank + 1) * step
    return _linear(_rows(layer.weight, lo, hi), None if layer.bias is None else _rows(layer.bias, lo, hi))


def _row(layer: nn.Module, parts: int, rank: int, name: str, group: TensorParallelGroup,
         quantization: str | None, group_size: int) -> RowParallel:
    """Rank `rank`'s input columns of `layer`. Per-channel 8-bit weights are quantized whole
    first, so every rank scales by the full row's scale (one rank's sums, split); 4-bit groups
    must not straddle two ranks."""
    if not isinstance(layer, nn.Linear):
        raise ValueError(f"tensor_parallel_size: {name} is a {type(layer).__name__}; pre-quantized checkpoints "
                         "are not split over ranks (quantize at load with --quantization instead)")
    step = layer.in_features // parts
    cols = slice(rank * step, (rank + 1) * step)
    bias = None if layer.bias is None else (layer.bias.clone() if rank == 0 else torch.zeros_like(layer.bias))
    if quantization in ("int8", "fp8"):
        kind = Int8Linear if quantization == "int8" else Fp8Linear
        qweight, scales = kind.quantize(layer.weight)
        return RowParallel(kind(qweight[:, cols].contiguous(), scales, bias), group)
    if quantization == "int4" and step % group_size:
        raise ValueError(f"quantization_group_size {group_size} does not divide {name}'s {step} input features per "
                         f"rank (tensor_parallel_size {parts}): a group would straddle two ranks")
    return RowParallel(_linear(layer.weight[:, cols].contiguous(), bias), group)


def shard_model(model: CausalLM, group: TensorParallelGroup, quantization: str | None, group_size: int) -> None:
    """Splits a loaded (unfused, unquantized) model in place for `group.rank` of `group.size`;
    with `quantization` (done at load after this) the row-parallel layers are split so that the
    ranks' sums are one rank's (see _row)."""
    cfg, n, r = model.config, group.size, group.rank
    check_divisible(cfg, n)
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            prefix = f"model.layers.{i}"
            attn.q_proj = _column(attn.q_proj, n, r, f"{prefix}.self_attn.q_proj")
            attn.k_proj = _column(attn.k_proj, n, r, f"{prefix}.self_attn.k_proj")
            attn.v_proj = _column(attn.v_proj, n, r, f"{prefix}.self_attn.v_proj")
            attn.o_proj = _row(attn.o_proj, n, r, f"{prefix}.self_attn.o_proj", group, quantization, group_size)
            attn.num_heads, attn.num_kv_heads = cfg.num_heads // n, cfg.num_kv_heads // n
            mlp.gate_proj = _column(mlp.gate_proj, n, r, f"{prefix}.mlp.gate_proj")
            mlp.up_proj = _column(mlp.up_proj, n, r, f"{prefix}.mlp.up_proj")
            mlp.down_proj = _row(mlp.down_proj, n, r, f"{prefix}.mlp.down_proj", group, quantization, group_size)
        vocab = cfg.vocab_size
        per_rank = -(-vocab // n)
        lo, hi = r * per_rank, min((r + 1) * per_rank, vocab)

        def vocab_shard(weight: torch.Tensor) -> torch.Tensor:
            shard = weight.new_zeros(per_rank, weight.shape[1])
            if hi > lo:
                shard[: hi - lo] = weight[lo:hi]
            return shard

        if not isinstance(model.lm_head, nn.Linear):
            raise ValueError("tensor_parallel_size: lm_head is quantized in the checkpoint; it is not split over ranks")
        table = model.model.embed_tokens
        embed = vocab_shard(table.dequantized() if isinstance(table, BlockEmbedding) else table.weight)
        model.model.embed_tokens = VocabParallelEmbedding(embed, lo, group)
        head = embed if cfg.tie_word_embeddings else vocab_shard(model.lm_head.weight)
        model.lm_head = VocabParallelHead(_linear(head, None), vocab, group)

