"""vLLM's `LLM(...)` keywords (its EngineArgs), read as pyserve's.

Most are EngineConfig's own fields with vLLM's meaning and pass as they are (tensor_parallel_size,
dtype, seed, max_model_len, max_num_seqs, max_num_batched_tokens, block_size, enforce_eager,
quantization, revision, enable_prefix_caching, enable_lora, max_loras, max_lora_rank,
speculative_config). The rest are listed here, each once: renamed, ignored (it cannot change what
pyserve does), or unserved: accepted only at the values that ask for what pyserve does anyway,
refused otherwise with a ValueError that names pyserve's equivalent or says why there is none.
A keyword in none of these is a TypeError listing EngineConfig's fields.
"""

from __future__ import annotations

from typing import Any

RENAMED = {"num_gpu_blocks_override": "num_kv_blocks"}

# Values vLLM accepts for a field under another spelling.
VALUE_ALIASES = {"dtype": {"half": "float16", "float": "float32"}}

# pyserve runs no code from a model's repository (an architecture it does not implement is refused,
# naming it), and the offline LLM logs no stats (llm.stats() reads them): either value means the same.
IGNORED = frozenset({"trust_remote_code", "disable_log_stats"})

# keyword -> (the values that ask for what pyserve does anyway, why no other value is served)
UNSERVED: dict[str, tuple[tuple[Any, ...], str]] = {
    "gpu_memory_utilization": ((), "pyserve's is gpu_memory_fraction, the share of the device memory free once "
                               "the weights are loaded that the KV cache takes (default 0.85), not a share of all "
                               "device memory; or set num_kv_blocks"),
    "swap_space": ((0,), "pyserve preempts by recomputing, so it keeps no CPU swap space"),
    "cpu_offload_gb": ((0,), "pyserve keeps every weight on the device"),
    "tokenizer": ((None,), "pyserve reads the tokenizer from the model (tokenizer.json beside the weights, or "
                  "the GGUF file's metadata)"),
    "tokenizer_mode": (("auto",), "pyserve always uses the tokenizers library's (fast) tokenizer"),
    "tokenizer_revision": ((None,), "the tokenizer comes with the model's revision"),
    "skip_tokenizer_init": ((False,), "pyserve needs the tokenizer (stop tokens, chat templates); for ids "
                            "only, pass token-id prompts with SamplingParams(detokenize=False)"),
    "kv_cache_dtype": (("auto",), "the KV cache is kept in the serving dtype (dtype)"),
    "pipeline_parallel_size": ((1,), "pipeline parallelism is designed, not built (docs/pipeline_parallel.md); "
                               "use tensor_parallel_size"),
    "data_parallel_size": ((1,), "an LLM is one engine; `pyserve serve --data-parallel-size N` serves N "
                           "replicas behind a router"),
    "enable_chunked_prefill": ((True, None), "pyserve always computes a prompt in chunks of at most "
                               "max_num_batched_tokens; raise that to compute long prompts in one step"),
    "max_cpu_loras": ((None,), "adapters beyond max_loras wait on the CPU, with no bound"),
    "hf_token": ((None,), "set HF_TOKEN in the environment (huggingface_hub reads it)"),
    "download_dir": ((None,), "hub downloads go to huggingface_hub's cache: set HF_HUB_CACHE"),
    "load_format": (("auto", "safetensors", "gguf"), "pyserve loads safetensors and GGUF files only"),
    "task": (("auto", "generate"), "an LLM generates text; embeddings are the server's /v1/embeddings "
             "(--embedding-model)"),
}

# vLLM's quantization names for a checkpoint quantized before it is served.
CHECKPOINT_METHODS = frozenset({"awq", "awq_marlin", "gptq", "gptq_marlin", "compressed-tensors"})


def engine_keywords(given: dict[str, Any], fields: tuple[str, ...]) -> dict[str, Any]:
    """`given` (vLLM's keywords or pyserve's) as keywords of EngineConfig, whose field names are
    `fields`."""
    out: dict[str, Any] = {}
    for name, value in given.items():
        if name in IGNORED:
            continue
        if name in UNSERVED:
            accepted, reason = UNSERVED[name]
            if value not in accepted:
                raise ValueError(f"{name}: not served by pyserve ({reason})")
            continue
        if name in RENAMED:
            if RENAMED[name] in given:
                raise TypeError(f"{name} and {RENAMED[name]} are the same setting: give one")
            name = RENAMED[name]
        if name not in fields:
            raise TypeError(f"LLM() got an unexpected keyword argument {name!r} (pyserve takes EngineConfig's "
                            f"fields: {', '.join(fields)})")
        out[name] = _value(name, value)
    return out


def _value(name: str, value: Any) -> Any:
    if name == "dtype" and not isinstance(value, str):  # a torch.dtype, named as vLLM accepts it
        value = str(value).removeprefix("torch.")
    if name == "quantization" and value in CHECKPOINT_METHODS:
        raise ValueError(f"quantization: {value!r} names a pre-quantized checkpoint's method, which pyserve reads "
                         "from its config.json (quantization_config): leave quantization unset")
    if name in VALUE_ALIASES and isinstance(value, str):
        return VALUE_ALIASES[name].get(value, value)
    return value
