"""A whole model in one Rust call for fp32 CPU steps of a few rows (`_core.model_forward`, a
decode or verification step's logits; `_core.greedy_decode`, a draft's guesses): the embedding
lookup, every layer kernel, the final norm and the head with no interpreter between them. The
ops are those CausalLM.forward and compute_logits run on a few rows (the layer kernel,
cpu_ops.rms_norm, CpuLinear), so the logits have their bits; tests/model/test_whole_model.py
holds the two to it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pyserve import _core
from pyserve.model.block_embedding import BlockEmbedding
from pyserve.model.cpu_linear import FEW_ROWS
from pyserve.model.decoder import kernel_projection

# Rows a one-call kernel (a draft model's `greedy_decode`, an EAGLE head's `eagle_greedy`) is fed
# at most: its kernels stream each weight once per 16 rows, which many rows (a large batch's
# accepted tokens) pay more for than the op-by-op forward does (oneDNN on packed weights above
# FEW_ROWS).
FEED_ROWS = 4 * FEW_ROWS


@dataclass(frozen=True, slots=True)
class ModelView:
    """The model as the Rust calls read it (by these attribute names): numpy views, no copies."""

    embed: np.ndarray | tuple  # [vocab, hidden] f32, or a BlockEmbedding's (blocks, GGUF type)
    layers: list[tuple]  # each as `_core.decoder_layer` takes it (DecoderLayer.kernel_weights)
    norm: np.ndarray
    eps: float
    head: tuple  # (weight, bias) or a quantized layer's kernel_weights()
    heads: int
    head_dim: int
    kv_heads: int
    cos: np.ndarray  # [max positions, head_dim]
    sin: np.ndarray
    scale: float


class WholeModel:
    """A CausalLM and its paged KV cache as `_core.model_forward` and `_core.greedy_decode` take
    them. Rows are (token, position, request): row i of a step is `tokens[i]` at `positions[i]`
    of request `requests[i]`, whose block table is `block_tables[requests[i]]`."""

    def __init__(self, view: ModelView, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], model):
        self.view = view
        self.model = model  # its aux_layer_ids are kept as aux_hidden, as its own forward does
        self.k_caches = [k.numpy() for k, _ in kv_caches]
        self.v_caches = [v.numpy() for _, v in kv_caches]

    @classmethod
    def of(cls, model, kv_caches) -> WholeModel | None:
        """The model's whole-model kernel, or None where a layer or the head has no CPU kernel
        (the model runs op by op then): fp32 on a CPU, every layer on the layer kernel
        (CausalLM.use_cpu_ops), a head on CpuLinear or a quantized CPU layer."""
        if not model.layer_kernel or model.lockstep is not None:
            return None
        head_weights = kernel_projection(model.lm_head)
        if head_weights is None:
            return None
        inner = model.model
        attn = inner.layers[0].self_attn
        table = inner.embed_tokens
        embed = table.view if isinstance(table, BlockEmbedding) else table.weight.detach().numpy()
        view = ModelView(embed, [layer.kernel_weights for layer in inner.layers],
                         inner.norm.weight_view, inner.norm.eps, head_weights, attn.num_heads, attn.head_dim,
                         attn.num_kv_heads, inner.rotary.cos.numpy(), inner.rotary.sin.numpy(), attn.scale)
        return cls(view, kv_caches, model)

    def forward(self, tokens, positions, requests, block_tables, logits_rows) -> torch.Tensor:
        """float32 [len(logits_rows), vocab]: the logits of rows `logits_rows` after one forward
        over all the rows (their keys and values written to the cache); the inputs of the
        model's `aux_layer_ids` become its `aux_hidden`."""
        aux_layers = np.asarray(self.model.aux_layer_ids, dtype=np.int64)
        logits, aux = _core.model_forward(self.view, self.k_caches, self.v_caches, *_rows(tokens, positions, requests),
                                          np.ascontiguousarray(block_tables, dtype=np.int32),
                                          np.asarray(logits_rows, dtype=np.int64), aux_layers,
                                          threads=torch.get_num_threads())
        if len(aux_layers):
            self.model.aux_hidden = torch.from_numpy(aux)
        return torch.from_numpy(logits)

    def greedy(self, tokens, positions, requests, block_tables, depth) -> np.ndarray:
        """int32 [requests, max(depth)]: the rows fed, then depth[r] greedy guesses for request r,
        each fed back for the next (-1 past a request's depth)."""
        return _core.greedy_decode(self.view, self.k_caches, self.v_caches, *_rows(tokens, positions, requests),
                                   np.ascontiguousarray(block_tables, dtype=np.int32),
                                   np.asarray(depth, dtype=np.int64), threads=torch.get_num_threads())


def _rows(tokens, positions, requests) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return (np.asarray(tokens, dtype=np.int32), np.asarray(positions, dtype=np.int64),
            np.asarray(requests, dtype=np.int64))
