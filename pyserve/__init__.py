"""pyserve: an LLM serving engine with a Rust scheduling core."""

from pyserve import _core

__all__ = ["_core"]
