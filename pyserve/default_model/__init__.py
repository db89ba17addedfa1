"""The embedded default model family: a small Python-code model trained by this project from the
standard library's source, its draft model, its EAGLE-3 head and two LoRA adapters, shipped
inside the package.

`LLM()` and `pyserve serve` with no model use `TARGET_DIR`; see docs/embedded-model.md for the
model card and `python -m pyserve.default_model.training` for how the weights were made.
"""

from __future__ import annotations

from pathlib import Path

FAMILY_DIR = Path(__file__).resolve().parent / "weights"
TARGET_DIR = FAMILY_DIR / "target"
DRAFT_DIR = FAMILY_DIR / "draft"
HEAD_DIR = FAMILY_DIR / "eagle3"  # `pyserve train-eagle` on the target: its training.json says how
DEFAULT_MODEL_NAME = "pyserve-default"
ADAPTER_DIRS = {"docstrings": FAMILY_DIR / "adapters" / "docstrings", "tests": FAMILY_DIR / "adapters" / "tests"}


def resolve_model(model: str | Path | None) -> str:
    """The model directory to load: `model` itself, or the embedded target when it is None."""
    if model is not None:
        return str(model)
    if not (TARGET_DIR / "config.json").is_file():
        raise FileNotFoundError(f"model: no model given and the embedded default is missing ({TARGET_DIR})")
    return str(TARGET_DIR)


def served_name(model: str | Path | None) -> str:
    """The name clients use for `model`: its directory's (or file's) name, a hub id as given, or
    `pyserve-default`."""
    from pyserve.model.hub import is_hub_id

    if model is None:
        return DEFAULT_MODEL_NAME
    return str(model) if is_hub_id(str(model)) else Path(model).name
