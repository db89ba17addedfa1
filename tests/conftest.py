"""Fixtures shared by several test folders: the tiny Hugging Face models (random weights, built
once per session by pyserve.testing). Helpers that are not fixtures live in pyserve.testing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pyserve.testing import ARCH_CONFIGS, build_model

if not os.environ.get("TRITON_INTERPRET"):
    try:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"  # Triton kernels run on the CPU interpreter
    except ImportError:
        pass


def pytest_configure(config) -> None:
    """The tests are of the installed wheel. `python -m pytest` puts the current directory first
    on sys.path, so from the repository root it would import the source folder, which has no
    compiled pyserve._core: say so instead of failing in every test module."""
    import pyserve

    try:
        import pyserve._core  # noqa: F401
    except ImportError as e:
        raise pytest.UsageError(
            f"pyserve was imported from {Path(pyserve.__file__).parent}, which has no pyserve._core ({e}). "
            "Install the wheel (pip install .) and run `pytest`, or `python -P -m pytest` from the repository "
            "root (-P keeps the current directory off sys.path).") from None


@pytest.fixture(scope="session", autouse=True)
def gguf_metadata_cache(tmp_path_factory) -> Path:
    """GGUF metadata cached in the session's temporary folder, not the user's (servers the tests
    start inherit it), unless the run names a folder of its own."""
    folder = Path(os.environ.get("PYSERVE_GGUF_CACHE") or tmp_path_factory.mktemp("gguf-metadata"))
    os.environ["PYSERVE_GGUF_CACHE"] = str(folder)
    return folder


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: build_model(root / arch, arch) for arch in ARCH_CONFIGS}


@pytest.fixture(scope="session")
def llama_dir(model_dirs) -> Path:
    return model_dirs["llama"]


def real_model(name: str) -> Path:
    """A real checkpoint from the cache (pyserve.testing.real_models). Missing, the test is skipped
    naming the command that fetches it; where PYSERVE_REAL_MODELS=required (CI), it fails."""
    from pyserve.testing.real_models import cached

    path = cached(name)
    if path is None:
        message = f"{name} is not fetched: python -m pyserve.testing.real_models {name}"
        if os.environ.get("PYSERVE_REAL_MODELS") == "required":
            pytest.fail(message)
        pytest.skip(message)
    return path


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct, llama.cpp's Q4_1 file (its embedding and head at Q8_0)."""
    return real_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def minilm() -> Path:
    """all-MiniLM-L6-v2 (sentence-transformers layout, the original safetensors)."""
    return real_model("all-minilm-l6-v2")
