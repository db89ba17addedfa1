"""The decoder family: Llama, Mistral, Qwen2 (qkv bias) and Qwen3 (per-head q/k RMSNorm).

Module names mirror the Hugging Face checkpoints (`model.layers.N.self_attn.q_proj`, ...) so weights
load by name. The forward runs over the step's flat token axis: no batch dimension, no padding;
attention reads and writes the paged KV cache through the backend.
"""

from __future__ import annotations

import torch
from torch import nn

from pyserve import _core
from pyserve.model import cpu_ops
from pyserve.model.attention import AttentionBackend, AttentionMetadata
from pyserve.model.config import ModelConfig
from pyserve.model.cpu_linear import FEW_ROWS, CpuLinear
from pyserve.model.kquant_linear import KQuantLinear
from pyserve.model.quantized_linear import QUANTIZED
from pyserve.model.quantized_linear import concatenated as quantized_concatenated
from pyserve.model.rope import RotaryEmbedding, apply_rotary


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.weight_view = None  # a numpy view of the weight, for cpu_ops (set by CausalLM.use_cpu_ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalized in fp32, scaled in the input's dtype: Hugging Face's Llama op for op, so the
        bits match. (torch's fused rms_norm gives the same bits but, on the CPUs measured, takes
        17x longer on 2048 rows of 512.)"""
        h = x.float()
        h = h * h.pow(2).mean(-1, keepdim=True).add_(self.eps).rsqrt_()
        return h.mul_(self.weight) if x.dtype == torch.float32 else self.weight * h.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.qkv_proj: nn.Linear | None = None  # set by fuse_projections

    def fuse_projections(self) -> None:
        """Replaces q/k/v_proj by one projection of their concatenated weights: fewer ops per
        step, and on the CPUs measured the same bits per output. LoRA wraps the separate
        projections: never both."""
        fused = joined_linear((self.q_proj, self.k_proj, self.v_proj))
        if fused is not None:
            self.qkv_proj = fused
            del self.q_proj, self.k_proj, self.v_proj

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        x: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
        fused: bool = False,
    ) -> torch.Tensor:
        """`fused`: x is a few fp32 CPU rows and the model uses the CPU kernels (CausalLM.use_cpu_ops)."""
        n, h, hkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        if not self.qk_norm and (self.qkv_proj is not None or fused):  # q and k side by side: one rotation
            # unfused parts (of different kinds, or under LoRA) side by side, as the layer kernel runs them
            qkv = self.qkv_proj(x) if self.qkv_proj is not None else \
                torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=1)
            if fused:  # in place, in one call
                cpu_ops.rotary_(qkv, h + hkv, d, rope)
                q, k = qkv[:, : h * d].view(n, h, d), qkv[:, h * d : (h + hkv) * d].view(n, hkv, d)
            else:
                qk = apply_rotary(qkv[:, : (h + hkv) * d].view(n, h + hkv, d), rope)
                q, k = qk[:, :h], qk[:, h:]
            v = qkv[:, (h + hkv) * d :].view(n, hkv, d)
        else:
            if self.qkv_proj is not None:
                q, k, v = self.qkv_proj(x).split([h * d, hkv * d, hkv * d], dim=1)
            else:
                q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            q, k, v = q.view(n, h, d), k.view(n, hkv, d), v.view(n, hkv, d)
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rotary(q, rope), apply_rotary(k, rope)
        out = backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.gate_up_proj: nn.Linear | None = None  # set by fuse_projections

    def fuse_projections(self) -> None:
        """gate_proj and up_proj as one projection (see Attention.fuse_projections)."""
        fused = joined_linear((self.gate_proj, self.up_proj))
        if fused is not None:
            self.gate_up_proj = fused
            del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        if fused:
            gate_up = self.gate_up_proj(x) if self.gate_up_proj is not None else \
                torch.cat([self.gate_proj(x), self.up_proj(x)], dim=1)
            return self.down_proj(cpu_ops.silu_mul(gate_up))
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(nn.functional.silu(gate) * up)


def kernel_projection(p: nn.Module | None) -> tuple | None:
    """A projection as `_core`'s kernels take it (`Weight`): (weight, bias) views of a CpuLinear,
    a quantized CPU layer's kernel_weights(); None where it has no CPU kernel."""
    if isinstance(p, CpuLinear):
        return p.weight_view, p.bias_view
    if isinstance(p, QUANTIZED) and p.cpu:
        return p.kernel_weights()
    return None


def _joined_projection(module: nn.Module, fused: str, parts: tuple[str, ...]) -> tuple | list | None:
    """The kernel view of `module`'s fused projection, or where its parts did not fuse (stored in
    different kinds, as a GGUF file's Q4_K q and k beside its Q6_K v) the list of theirs, which
    the kernels run side by side, each run of K-quant parts of one type joined (q and k there);
    None where one has no CPU kernel."""
    if getattr(module, fused) is not None:
        return kernel_projection(getattr(module, fused))
    views = [kernel_projection(p) for p in _kquant_runs_joined([getattr(module, name) for name in parts])]
    return None if any(v is None for v in views) else views


def _kquant_runs_joined(layers: list[nn.Module]) -> list[nn.Module]:
    """`layers` with each run of consecutive K-quant layers that KQuantLinear.joined can join
    (one type, the same inputs) as one layer over their rows where they are."""
    out: list[nn.Module] = []
    for layer in layers:
        joined = KQuantLinear.joined([out[-1], layer]) \
            if out and isinstance(out[-1], KQuantLinear) and isinstance(layer, KQuantLinear) else None
        if joined is not None:
            out[-1] = joined
        else:
            out.append(layer)
    return out


def joined_linear(parts: tuple[nn.Module, ...]) -> nn.Module | None:
    """One Linear whose outputs are those of `parts`, in order (built on `meta`, then given the
    concatenated tensors: no second copy of the weights is ever allocated); for layers of a
    pre-quantized checkpoint one quantized layer, or None where theirs cannot be joined."""
    if not all(isinstance(p, nn.Linear) for p in parts):
        return quantized_concatenated(parts) if all(isinstance(p, QUANTIZED) for p in parts) else None
    with torch.no_grad():
        weight = torch.cat([p.weight for p in parts])
        bias = torch.cat([p.bias for p in parts]) if parts[0].bias is not None else None
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        fused.bias = nn.Parameter(bias, requires_grad=False)
    return fused


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def use_layer_kernel(self) -> bool:
        """Readies `kernel_weights` (numpy views, in `_core.decoder_layer`'s order) where the
        whole layer can run in one kernel call: fused projections on CpuLinear or a quantized
        layer (on the CPU), no q/k norm. Returns whether it can."""
        attn, mlp = self.self_attn, self.mlp
        if attn.qk_norm:
            return False
        weights = [_joined_projection(attn, "qkv_proj", ("q_proj", "k_proj", "v_proj")), kernel_projection(attn.o_proj),
                   _joined_projection(mlp, "gate_up_proj", ("gate_proj", "up_proj")),
                   kernel_projection(mlp.down_proj)]
        if any(w is None for w in weights):
            return False
        qkv, o, gate_up, down = weights
        self.kernel_weights = (self.input_layernorm.weight_view, qkv, o, self.post_attention_layernorm.weight_view,
                               gate_up, down, self.input_layernorm.eps)
        return self.input_layernorm.eps == self.post_attention_layernorm.eps

    def forward(self, rope, x, kv_cache, meta, backend, fused: bool = False) -> torch.Tensor:
        """`fused`: x is a few fp32 CPU rows of a model that uses the CPU kernels; x is then
        updated in place (the residual stream) and returned."""
        if fused:
            attn_in, post = self.input_layernorm, self.post_attention_layernorm
            h = cpu_ops.rms_norm(x, attn_in.weight_view, attn_in.eps)
            h = cpu_ops.add_rms_norm(self.self_attn(rope, h, kv_cache, meta, backend, True), x,
                                     post.weight_view, post.eps)
            return x.add_(self.mlp(h, True))
        x = x + self.self_attn(rope, self.input_layernorm(x), kv_cache, meta, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_positions: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, max_positions, dtype)


class CausalLM(nn.Module):
    """The whole model. `forward` returns the final hidden states of every scheduled token;
    `compute_logits` projects only the rows that are sampled."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_positions: int):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, dtype, max_positions)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.cpu_ops = False  # set by use_cpu_ops
        self.layer_kernel = False  # every layer can run as one kernel call (use_cpu_ops)
        self.checkpoint_quantization: str | None = None  # a pre-quantized checkpoint's method (the loader's)
        # Rank 0 of a tensor-parallel group: announces each call for the other ranks to replay.
        self.lockstep = None
        # Layers whose input (the residual stream entering them: Hugging Face's hidden_states[i])
        # each forward keeps, side by side, as `aux_hidden` [tokens, len(ids) * hidden] (an EAGLE
        # head reads them).
        self.aux_layer_ids: tuple[int, ...] = ()
        self.aux_hidden: torch.Tensor | None = None
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        if self.lockstep is not None:
            self.lockstep.announce_forward(input_ids, positions, meta)
        x = self.model.embed_tokens(input_ids)
        rope = self.model.rotary.tables(positions)
        fused = self.cpu_ops and x.shape[0] <= FEW_ROWS
        rows = backend.in_place_rows(meta, kv_caches[0][0]) if fused and self.layer_kernel else None
        aux: list[torch.Tensor] = []
        if rows is not None:  # every layer in one kernel call
            x = x.contiguous()
            x_np, slots = x.numpy(), meta.slot_mapping.numpy()
            cos, sin = (t.numpy().reshape(len(x_np), -1) for t in rope)
            threads = torch.get_num_threads()
            for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.model.layers, kv_caches, strict=True)):
                if i in self.aux_layer_ids:
                    aux.append(x.clone())  # the kernel updates x in place
                attn = layer.self_attn
                _core.decoder_layer(x_np, *layer.kernel_weights, attn.num_heads, attn.head_dim, attn.num_kv_heads,
                                    k_cache.numpy(), v_cache.numpy(), slots, rows.block_tables, rows.seq_lens,
                                    cos, sin, attn.scale, threads=threads, masks=rows.masks)
        else:
            for i, (layer, kv) in enumerate(zip(self.model.layers, kv_caches, strict=True)):
                if i in self.aux_layer_ids:
                    aux.append(x.clone() if fused else x)  # the fused layers update x in place
                x = layer(rope, x, kv, meta, backend, fused)
        if self.aux_layer_ids:
            self.aux_hidden = torch.cat(aux, dim=-1)
        norm = self.model.norm
        return cpu_ops.rms_norm(x, norm.weight_view, norm.eps) if fused else norm(x)

    def use_cpu_ops(self) -> None:
        """Steps of up to FEW_ROWS tokens run their norms, residual adds, activation and (with
        fused q/k/v) rotary embedding through cpu_ops; for fp32 on the CPU only."""
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.weight_view = cpu_ops.weight_view(m.weight)
        self.cpu_ops = True
        self.layer_kernel = all(layer.use_layer_kernel() for layer in self.model.layers)

    def fuse_projections(self) -> None:
        """Fused q/k/v and gate/up projections in every layer, for a model that serves no LoRA."""
        for layer in self.model.layers:
            layer.self_attn.fuse_projections()
            layer.mlp.fuse_projections()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lockstep is not None:
            self.lockstep.announce_logits(hidden)
        return self.lm_head(hidden).float()
