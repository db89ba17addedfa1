"""The torch references' one way to read a paged KV cache: whole pages gathered by block id."""

import torch


def gather_pages(cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """cache [num_blocks, block_size, H, D] and block ids `pages` [..., P] -> [..., P * block_size,
    H, D] in fp32. index_select on the flattened ids is about 3x faster on CPUs than indexing
    with a 2-D tensor."""
    out = cache.index_select(0, pages.reshape(-1).long())
    return out.view(*pages.shape[:-1], pages.shape[-1] * cache.shape[1], *cache.shape[2:]).float()
