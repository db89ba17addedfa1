"""Fixtures shared by the reliability suites."""

from __future__ import annotations

import pytest

from pyserve.testing import make_adapter


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory, llama_dir):
    root = tmp_path_factory.mktemp("lifecycle-adapters")
    return [make_adapter(llama_dir, root / f"a{i}", 4, ["q_proj", "v_proj"], seed=i) for i in range(3)]
