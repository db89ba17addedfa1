"""Tiny Hugging Face models with random weights, built on the spot so that no test downloads
anything: one of each supported architecture (hidden 64, 2 layers, 4 query and 2 KV heads), the
byte-level BPE tokenizer they share (vocabulary 300, trained here on CORPUS, with the chat
special tokens and CHAT_TEMPLATE), and random PEFT LoRA adapters for them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n    print(i * i)\n",
    "import os\nimport sys\n\nif __name__ == '__main__':\n    main()\n",
    "The quick brown fox jumps over the lazy dog. Ünïcödé ✓ 日本語 text.\n",
]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL = ["<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]

ARCH_CONFIGS = {
    "llama": dict(
        architectures=["LlamaForCausalLM"], model_type="llama",
        rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64, "rope_theta": 500000.0},
    ),
    "mistral": dict(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=None),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", tie_word_embeddings=True),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=32),
}
# A raw config.json of the tiny llama's shape, without RoPE scaling: for ModelConfig.from_dict.
LLAMA_CONFIG = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=300, hidden_size=64,
    intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=512,
)


def build_tokenizer(out: Path, added_tokens: tuple[str, ...] = ()) -> None:
    """Trains the tiny tokenizer on CORPUS and saves tokenizer.json and tokenizer_config.json
    (BOS `<s>`, EOS `</s>`, CHAT_TEMPLATE) to `out`; the post-processor adds BOS. `added_tokens`
    join the vocabulary after it as added, non-special tokens (as Qwen's `<tool_call>`)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added_tokens])
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE,
    }))


def build_model(out: Path, arch: str, seed: int = 0, added_tokens: tuple[str, ...] = (), **overrides) -> Path:
    """Saves a tiny random model of `arch` with the test tokenizer (and its `added_tokens`) to `out`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out, added_tokens)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    fields = dict(ARCH_CONFIGS[arch])
    model_type = fields.pop("model_type")
    params = dict(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=tok.token_to_id("<s>"), eos_token_id=tok.token_to_id("</s>"),
        initializer_range=0.3, tie_word_embeddings=False,
    )
    params.update(fields)
    params.update(overrides)
    config = AutoConfig.for_model(model_type, **params)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    return out


def copy_model(src: Path, dst: Path) -> Path:
    """A copy of the model directory `src` at `dst`, to edit."""
    shutil.copytree(src, dst)
    return dst


def edit_config(model_dir: Path, **changes) -> None:
    """Updates fields of `model_dir`/config.json."""
    path = model_dir / "config.json"
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw))


def make_adapter(base_dir, out, rank, targets, seed, alpha=None, rslora=False):
    """Saves a PEFT LoRA adapter for the model in `base_dir` to `out`: rank `rank` on the
    `targets` projections, lora_alpha `alpha` (default 2 * rank), A and B random (scaled so that
    the adapter changes greedy outputs)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    cfg = LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, target_modules=targets, init_lora_weights=False,
                     use_rslora=rslora)
    peft_model = get_peft_model(model, cfg)
    with torch.no_grad():  # random A and B, scaled so the adapters change greedy outputs
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.3)
    peft_model.save_pretrained(out, safe_serialization=True)
    return out
