"""An EAGLE-3 draft head: one decoder layer that reads the target's own hidden states and drafts
the target's next tokens, laid out as the EAGLE-3 authors release their heads (so vLLM's and
SGLang's published heads load as they are):

- `fc` [H, 3 * H_target]: fuses the target's residual stream as it enters three of its layers (a
  low, a middle and a high one; `eagle_aux_hidden_state_layer_ids`, by default 2, L // 2, L - 3,
  i.e. Hugging Face's `hidden_states[id]`);
- `midlayer`: a Llama decoder layer whose attention reads [input_layernorm(embedding of the next
  token), hidden_norm(hidden)] side by side (q/k/v take 2 * H inputs);
- `norm`, `lm_head` [draft vocab, H] and `d2t` (draft id d is target id d + d2t[d]).

The head's position p pairs the target's features at p with the token at p + 1 and predicts the
token at p + 2. Its next draft step feeds its own output (H wide, not fused again) with its
guess. It has its own one-layer paged KV cache, addressed through the target's block tables.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from pyserve.model.attention import AttentionBackend, AttentionMetadata
from pyserve.model.config import ModelConfig
from pyserve.model.cpu_linear import can_use, use_cpu_linears
from pyserve.model.decoder import MLP, RMSNorm, joined_linear
from pyserve.model.quantized_linear import quantize_linears
from pyserve.model.rope import RotaryEmbedding, apply_rotary
from pyserve.speculative.eagle_config import HeadConfig


class HeadAttention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.scale = c.head_dim**-0.5
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.qkv_proj: nn.Linear | None = None  # set by fuse_projections

    def fuse_projections(self) -> None:
        """q/k/v as one projection (serving only: training reads the three)."""
        self.qkv_proj = joined_linear((self.q_proj, self.k_proj, self.v_proj))
        del self.q_proj, self.k_proj, self.v_proj

    def qkv(self, x: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k (rotated) and v of x [n, 2H]: [n, heads, head_dim] each."""
        n, h, hkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split([h * d, hkv * d, hkv * d], dim=1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k, v = q.view(n, h, d), k.view(n, hkv, d), v.view(n, hkv, d)
        return apply_rotary(q, rope), apply_rotary(k, rope), v


class HeadLayer(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = HeadAttention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def attention_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)

    def finish(self, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The layer's output from its input `hidden` and the attention's [n, heads * head_dim]."""
        h = hidden + self.self_attn.o_proj(attended)
        return h + self.mlp(self.post_attention_layernorm(h))


class EagleHead(nn.Module):
    def __init__(self, config: HeadConfig, dtype: torch.dtype, max_positions: int):
        super().__init__()
        c = config.layer
        self.config = config
        self.fc = nn.Linear(3 * config.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = HeadLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.rotary = RotaryEmbedding(c.rope, c.head_dim, max_positions, dtype)

    def forward(self, hidden: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                backend: AttentionBackend) -> torch.Tensor:
        """The head's output [n, H] at each row: `hidden` is the target's fused features (3 * H
        wide: fused by `fc` here) or the head's own output of the step before; `embeds` the
        embedding of the token after each row's position. Writes the rows' keys and values into
        `kv_cache`."""
        if hidden.shape[-1] != self.fc.out_features:
            hidden = self.fc(hidden)
        layer = self.midlayer
        x = layer.attention_input(embeds, hidden)
        q, k, v = layer.self_attn.qkv(x, self.rotary.tables(positions))
        attn = layer.self_attn
        out = backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, attn.scale)
        return layer.finish(hidden, out.reshape(len(x), attn.num_heads * attn.head_dim))

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """f32 [n, draft vocab]: the logits over the head's own vocabulary (`target_ids` maps them)."""
        return self.lm_head(self.norm(hidden)).float()

    def target_ids(self) -> torch.Tensor:
        """int64 [draft vocab]: the target token of each draft id."""
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t


def load_head(path: str | Path, config: HeadConfig, target, dtype: torch.dtype, device: torch.device,
              max_positions: int) -> tuple[EagleHead, nn.Module]:
    """(the head, the embedding it reads tokens through) from `path`'s safetensors, strictly (a
    missing, unexpected or misshapen tensor is a ValueError naming it); the embedding is the
    target's unless the head ships one (`embed_tokens.weight`). `t2d` (the inverse of d2t) is not
    needed and is skipped."""
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"speculative_config.model: no .safetensors file in the head directory {path}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    tensors.pop("t2d", None)
    embed = tensors.pop("embed_tokens.weight", None)
    with torch.device(device):
        head = EagleHead(config, dtype, max_positions)
    expected = dict(head.state_dict())
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ValueError(f"speculative_config.model: the head's tensors do not match the EAGLE-3 layout "
                         f"(missing {missing[:4]}, unexpected {unexpected[:4]})")
    for name, t in tensors.items():
        if t.shape != expected[name].shape:
            raise ValueError(f"speculative_config.model: tensor {name} has shape {list(t.shape)}, "
                             f"the config asks for {list(expected[name].shape)}")
    head.load_state_dict({k: (v if k == "d2t" else v.to(dtype)) for k, v in tensors.items()})
    head.to(device)
    head.rotary.reset()
    embedding = target.model.embed_tokens if embed is None else \
        nn.Embedding.from_pretrained(embed.to(dtype=dtype, device=device))
    return head.eval().requires_grad_(False), embedding


def finish_head(head: EagleHead, quantization: str | None, group_size: int, device: torch.device,
                dtype: torch.dtype) -> None:
    """A loaded head made ready to serve, as the target is (`finish_model`): q/k/v and gate/up
    fused, quantized by the target's method, and on fp32 CPUs on the CPU kernels. On a CPU a
    head's step reads its weights as a target step reads the target's: their bytes are its cost."""
    head.midlayer.self_attn.fuse_projections()
    head.midlayer.mlp.fuse_projections()
    if quantization is not None:
        quantize_linears(head, quantization, group_size)
    if can_use(device, dtype):
        use_cpu_linears(head)
