"""CPU KV caches: zeroed tensors of the paged layout in their own (huge-page advised) memory."""

from __future__ import annotations

import pytest
import torch

from pyserve.model.config import ModelConfig
from pyserve.model.kv_cache import allocate_kv_cache, copy_blocks


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


def test_block_copies_run_in_order_where_one_copies_from_a_block_copied_to():
    k, v = (torch.arange(4.0).reshape(4, 1) * s for s in (1, 10))
    copy_blocks([(k, v)], torch.tensor([[1, 2], [2, 3]]))  # 1 -> 2, then the new 2 -> 3
    assert k.flatten().tolist() == [0, 1, 1, 1] and v.flatten().tolist() == [0, 10, 10, 10]
    copy_blocks([(k, v)], torch.tensor([[0, 1], [3, 2]]))  # no chain: one gather
    assert k.flatten().tolist() == [0, 0, 1, 1]
