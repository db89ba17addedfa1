"""CPU KV caches: zeroed tensors of the paged layout in their own (huge-page advised) memory."""

from __future__ import annotations

import pytest
import torch

from pyserve.model.config import ModelConfig
from pyserve.model.kv_cache import allocate_kv_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_caches_are_zeroed_separate_and_writable(llama_dir, dtype):
    cfg = ModelConfig.from_dir(llama_dir)
    caches = allocate_kv_cache(cfg, 6, 4, dtype, torch.device("cpu"))
    assert len(caches) == cfg.num_layers
    shape = (6, 4, cfg.num_kv_heads, cfg.head_dim)
    tensors = [t for pair in caches for t in pair]
    assert all(t.shape == shape and t.dtype == dtype and t.is_contiguous() for t in tensors)
    assert all(int(t.count_nonzero()) == 0 for t in tensors)
    tensors[0][2, 1] = 1.5
    assert float(tensors[0].sum()) == 1.5 * cfg.num_kv_heads * cfg.head_dim
    assert all(int(t.count_nonzero()) == 0 for t in tensors[1:])  # no two tensors share memory
