"""pyserve: an LLM serving engine with a Rust scheduling core.

`from pyserve import LLM, SamplingParams` loads the engine (and torch) on first use, so that
`pyserve._core` alone stays light.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "LLM": "pyserve.engine.llm",
    "SamplingParams": "pyserve.engine.sampling_params",
    "RequestOutput": "pyserve.engine.outputs",
    "CompletionOutput": "pyserve.engine.outputs",
    "LoRARequest": "pyserve.lora.request",
    "StructuredOutputsParams": "pyserve.structured.params",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pyserve' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
