"""An EAGLE-3 head as `_core.eagle_greedy` reads it: the head's feed and its greedy guesses in one
Rust call (rust/cpu_kernels/src/eagle_draft.rs), with no interpreter between its ops. It is
there where every projection of the head runs on a CPU kernel (fp32 on a CPU: CpuLinear; or the
target's quantized CPU layers) and the embedding it reads is an fp32 table or a GGUF file's blocks;
elsewhere (and for sampled drafts) the head runs op by op (EagleHead.forward). A head's step on a
small target costs about what a target step does when its dozen ops each pay torch's dispatch."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pyserve import _core
from pyserve.model.block_embedding import BlockEmbedding
from pyserve.model.cpu_ops import weight_view
from pyserve.model.decoder import kernel_projection
from pyserve.speculative.eagle_head import EagleHead


@dataclass(frozen=True, slots=True)
class HeadView:
    """The head as the Rust call reads it (by these attribute names): numpy views, no copies."""

    fc: tuple
    embed: np.ndarray | tuple  # [vocab, hidden] f32, or a BlockEmbedding's (blocks, GGUF type)
    hidden_norm: np.ndarray
    layer: tuple  # (input_norm, qkv, o, post_norm, gate_up, down, eps), as `_core.decoder_layer` takes it
    norm: np.ndarray
    lm_head: tuple
    target_ids: np.ndarray  # int64 [draft vocab]
    heads: int
    head_dim: int
    kv_heads: int
    cos: np.ndarray  # [max positions, head_dim]
    sin: np.ndarray
    scale: float


def head_view(head: EagleHead, embedding: nn.Module) -> HeadView | None:
    """The served head's view (projections fused: finish_head), or None where a projection has
    no CPU kernel or the embedding is not an fp32 CPU table or a GGUF file's blocks."""
    layer, attn = head.midlayer, head.midlayer.self_attn
    mlp = layer.mlp
    projections = [kernel_projection(p) if p is not None else None
                   for p in (head.fc, attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj, head.lm_head)]
    if any(p is None for p in projections):
        return None
    if isinstance(embedding, BlockEmbedding):
        embed = embedding.view
    elif embedding.weight.dtype == torch.float32 and embedding.weight.device.type == "cpu":
        embed = embedding.weight.detach().numpy()
    else:
        return None
    fc, qkv, o, gate_up, down, lm_head = projections
    if head.rotary.cos.dtype != torch.float32 or head.rotary.cos.device.type != "cpu":
        return None
    eps = layer.input_layernorm.eps
    if any(n.eps != eps for n in (layer.hidden_norm, layer.post_attention_layernorm, head.norm)):
        return None
    norms = [weight_view(n.weight) for n in (layer.input_layernorm, layer.hidden_norm,
                                                layer.post_attention_layernorm, head.norm)]
    input_norm, hidden_norm, post_norm, norm = norms
    return HeadView(fc, embed, hidden_norm, (input_norm, qkv, o, post_norm, gate_up, down, eps), norm, lm_head,
                    np.ascontiguousarray(head.target_ids().numpy()), attn.num_heads, attn.head_dim,
                    attn.num_kv_heads, head.rotary.cos.numpy(), head.rotary.sin.numpy(), attn.scale)


def eagle_greedy(view: HeadView, kv_cache: tuple[torch.Tensor, torch.Tensor], features: torch.Tensor,
                 tokens: np.ndarray, positions: np.ndarray, requests: np.ndarray, block_tables: np.ndarray,
                 depth: np.ndarray) -> np.ndarray:
    """int32 [requests, max(depth)]: the pairs fed (row i: request requests[i]'s features at
    positions[i] with the next token tokens[i]), then depth[r] greedy guesses for request r
    (-1 past its depth)."""
    return _core.eagle_greedy(view, kv_cache[0].numpy(), kv_cache[1].numpy(),
                              np.ascontiguousarray(features.float().numpy()), np.asarray(tokens, dtype=np.int32),
                              np.asarray(positions, dtype=np.int64), np.asarray(requests, dtype=np.int64),
                              np.ascontiguousarray(block_tables, dtype=np.int32), np.asarray(depth, dtype=np.int64),
                              threads=torch.get_num_threads())
