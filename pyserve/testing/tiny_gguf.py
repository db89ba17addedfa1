"""Tiny GGUF files written from the tiny Hugging Face models (tiny_models) with the `gguf`
package's writer, as llama.cpp's converter writes them: its tensor names, q/k rows permuted for
Llama-family files, the byte-level tokenizer as `tokenizer.ggml.*`, and projections in the block
format asked for (quantized by gguf's reference code)."""

from __future__ import annotations

import json
from pathlib import Path

ROLES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
         "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}


LLAMA_ROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}  # build_model override


def _permute(w, heads: int):
    """llama.cpp's converter's q/k row order: each head's rotary halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_from_hf(model_dir: Path, out: Path, projections: str = "F32", embedding: str = "F32",
                 arch: str | None = None, by_role: dict[str, str] | None = None) -> Path:
    """Writes `model_dir` as the GGUF file `out`: its projections in `projections` (F32, F16,
    Q4_0, Q4_1, Q8_0, Q5_0, Q4_K, ...) but those of the roles in `by_role` ("attn_v": "Q8_0", as
    llama.cpp's mixes store some), and its embedding in `embedding`; `arch` overrides the GGUF
    architecture (to write one pyserve refuses)."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize
    from safetensors.numpy import load_file

    cfg = json.loads((model_dir / "config.json").read_text())
    family = arch or cfg["model_type"]
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    w = GGUFWriter(str(out), family)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(cfg.get("rms_norm_eps", 1e-6))
    rope = {"rope_theta": cfg.get("rope_theta", 10000.0), **(cfg.get("rope_parameters") or {})}
    if rope.get("rope_type", "default") != "default":
        raise ValueError("build the model with rope_parameters={'rope_type': 'default', ...} (LLAMA_ROPE)")
    w.add_rope_freq_base(rope["rope_theta"])
    if "head_dim" in cfg:
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    _tokenizer(w, model_dir)
    tensors = load_file(str(next(model_dir.glob("*.safetensors"))))
    for name, value in tensors.items():
        if name == "model.embed_tokens.weight":
            target, kind = "token_embd.weight", embedding
        elif name == "model.norm.weight":
            target, kind = "output_norm.weight", "F32"
        elif name == "lm_head.weight":
            target, kind = "output.weight", projections
        else:
            parts = name.split(".")  # model.layers.N.<module...>.weight|bias
            module = ".".join(parts[3:-1])
            target = f"blk.{parts[2]}.{ROLES[module]}.{parts[-1]}"
            kind = projections if module.endswith("_proj") and parts[-1] == "weight" else "F32"
            if kind != "F32":
                kind = (by_role or {}).get(ROLES[module], kind)
            if family in ("llama", "mistral") and module in ("self_attn.q_proj", "self_attn.k_proj"):
                value = _permute(value, heads if module == "self_attn.q_proj" else kv_heads)
        value = np.ascontiguousarray(value, dtype=np.float32)
        qtype = GGMLQuantizationType[kind]
        if kind == "F32":
            w.add_tensor(target, value)
        elif kind == "F16":
            w.add_tensor(target, value.astype(np.float16))
        else:
            w.add_tensor(target, quantize(value, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _tokenizer(w, model_dir: Path) -> None:
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    vocab = tok["model"]["vocab"]
    for added in tok["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in tok["added_tokens"] if a["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab[config["bos_token"]])
    w.add_eos_token_id(vocab[config["eos_token"]])
    w.add_add_bos_token(True)
    w.add_chat_template(config["chat_template"])


def gguf_rewritten(src_path: Path, dst_path: Path, tensors: dict | None = None,
                   floats: dict[str, float] | None = None, architecture: str | None = None) -> Path:
    """A copy of the GGUF file `src_path` at `dst_path` whose tensors named in `tensors` are
    replaced by raw blocks ({name: (kind, blocks)}), with the float32 metadata values `floats`
    added, and with `general.architecture` set to `architecture` where one is given."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

    src = GGUFReader(str(src_path))
    w = GGUFWriter(str(dst_path), architecture or src.fields["general.architecture"].contents())
    for field in src.fields.values():
        if not field.name.startswith(("GGUF.", "general.architecture")):
            w.add_key_value(field.name, field.contents(), field.types[0],
                            field.types[-1] if field.types[0].name == "ARRAY" else None)
    for key, value in (floats or {}).items():
        w.add_float32(key, value)
    for t in src.tensors:
        if t.name in (tensors or {}):
            kind, blocks = tensors[t.name]
            w.add_tensor(t.name, blocks, raw_dtype=GGMLQuantizationType[kind])
        else:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst_path
