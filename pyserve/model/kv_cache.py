"""The paged KV tensors: allocated once at start, one (K, V) pair per layer, each
[num_blocks, block_size, num_kv_heads, head_dim]. Block 0 is the scheduler's null block."""

from __future__ import annotations

import mmap

import numpy as np
import torch

from pyserve.model.config import ModelConfig

CPU_KV_CACHE_BYTES = 1 << 30
MAX_AUTO_BLOCKS = 1 << 16


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * elem


def auto_num_blocks(
    cfg: ModelConfig, block_size: int, dtype: torch.dtype, device: torch.device, memory_fraction: float,
    share: float = 1.0,
) -> int:
    """Blocks that fit in `share` of the budget: on CUDA, `memory_fraction` of the memory free
    after loading the weights; on CPU, a fixed 1 GiB."""
    per_block = bytes_per_block(cfg, block_size, dtype)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * memory_fraction)
    else:
        budget = CPU_KV_CACHE_BYTES
    budget = int(budget * share)
    return max(2, min(MAX_AUTO_BLOCKS, budget // per_block))


def allocate_kv_cache(
    cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    if device.type == "cpu":
        return [(_huge_page_zeros(shape, dtype), _huge_page_zeros(shape, dtype)) for _ in range(cfg.num_layers)]
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(cfg.num_layers)
    ]


def _huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor in anonymous memory the kernel is asked to back with huge pages. A
    step's blocks lie scattered over the whole cache; on 4 KiB pages each block read missed the
    TLB, and the decode attention kernel took 2x longer on torch's allocation than on the same
    rows in huge pages (measured with 256 sequences of 26-66 tokens). Where the system allows no
    transparent huge pages, the advice is ignored and the memory is plain pages."""
    count = torch.Size(shape).numel()
    if count == 0:
        return torch.zeros(shape, dtype=dtype)
    # Private: shared anonymous memory is shmem, which takes huge pages under another setting.
    buffer = mmap.mmap(-1, count * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buffer.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(buffer, dtype=dtype, count=count).view(shape)


def copy_blocks(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], pairs: torch.Tensor) -> None:
    """Copy-on-write: copies block `src` to block `dst` for each row of `pairs` ([m, 2]), in
    order: a block copied to may be copied from by a later row (a request's copy cached as it was
    dropped, then found by the next request in the same step)."""
    if pairs.numel() == 0:
        return
    src, dst = pairs[:, 0].long(), pairs[:, 1].long()
    chained = bool(torch.isin(src, dst).any())
    for k, v in kv_caches:
        if chained:
            for s, d in pairs.tolist():
                k[d] = k[s]
                v[d] = v[s]
        else:
            k[dst] = k[src]
            v[dst] = v[src]


def move_slots(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], src: np.ndarray, dst: np.ndarray) -> None:
    """Copies the keys and values of slot `src[i]` to slot `dst[i]` in every layer (a token
    tree's kept path to the slots after its last token); every source is read before any
    destination is written."""
    src_t, dst_t = torch.from_numpy(src.astype(np.int64)), torch.from_numpy(dst.astype(np.int64))
    for k, v in kv_caches:
        for cache in (k, v):
            rows = cache.view(-1, *cache.shape[2:])
            rows[dst_t.to(rows.device)] = rows[src_t.to(rows.device)]
