"""A GGUF file's metadata as the Hugging Face `config.json` pyserve reads (ModelConfig.from_dict),
so both kinds of checkpoint are checked by the same rules."""

from __future__ import annotations

from typing import Any

from pyserve.model.config import UnsupportedModelError
from pyserve.model.gguf.file import ARCHITECTURES, GgufFile


def config_dict(f: GgufFile) -> dict[str, Any]:
    heads = int(f.arch("attention.head_count"))
    hidden = int(f.arch("embedding_length"))
    if "rope_freqs.weight" in f.tensors:
        raise UnsupportedModelError("GGUF tensor rope_freqs.weight (per-frequency RoPE factors, e.g. Llama 3.1's "
                                    "scaling) is not supported")
    raw: dict[str, Any] = {
        "architectures": [ARCHITECTURES[f.architecture]],
        "model_type": f.architecture,
        "hidden_act": "silu",
        "vocab_size": f.rows("token_embd.weight"),
        "hidden_size": hidden,
        "intermediate_size": int(f.arch("feed_forward_length")),
        "num_hidden_layers": int(f.arch("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(f.arch("attention.head_count_kv", heads)),
        "head_dim": int(f.arch("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(f.arch("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(f.arch("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(f.arch("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in f.tensors and not f.head_from_quantized_embedding,
        "attention_bias": "blk.0.attn_output.bias" in f.tensors,
        "torch_dtype": "float16" if f.type_of("token_embd.weight") == "F16" else "bfloat16",
        "bos_token_id": f.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos_ids(f),
    }
    scaling = f.arch("rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise UnsupportedModelError(f"GGUF {f.architecture}.rope.scaling.type {scaling!r} is not supported "
                                        "(only linear)")
        raw["rope_scaling"] = {"rope_type": "linear", "factor": float(f.arch("rope.scaling.factor", 1.0))}
    window = f.arch("attention.sliding_window")
    if window:
        raw["sliding_window"] = int(window)
        raw["use_sliding_window"] = True
    return raw


def eos_ids(f: GgufFile) -> list[int]:
    """The tokens that end a turn: the file's eos, end-of-turn and end-of-message tokens."""
    ids = [f.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))
