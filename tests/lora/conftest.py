"""Fixtures shared by the LoRA tests."""

from __future__ import annotations

import pytest

from pyserve.testing import make_adapter


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, llama_dir):
    root = tmp_path_factory.mktemp("adapters")
    specs = {
        "all8": (8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False),
        "attn4": (4, ["q_proj", "v_proj"], False),
        "mlp16rs": (16, ["gate_proj", "down_proj", "o_proj"], True),
    }
    return {name: make_adapter(llama_dir, root / name, r, t, seed=i, rslora=rs)
            for i, (name, (r, t, rs)) in enumerate(specs.items())}
