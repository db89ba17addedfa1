"""pyserve: an LLM serving engine with a Rust scheduling core.

`from pyserve import LLM, SamplingParams` loads the engine (and torch) on first use, so that
`pyserve._core` alone stays light.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "LLM": "pyserve.engine.llm",
    "SamplingParams": "pyserve.step.sampling_params",
    "RequestOutput": "pyserve.engine.outputs",
    "CompletionOutput": "pyserve.engine.outputs",
    "LoRARequest": "pyserve.lora.request",
    "StructuredOutputsParams": "pyserve.structured.params",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name == "__version__":  # the installed distribution's: one number, written by the build
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("pyserve")
        except PackageNotFoundError:
            return "unknown"  # a source tree that was never installed
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pyserve' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
