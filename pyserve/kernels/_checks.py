"""Argument checks of the kernel launchers: each error names the argument.

A wrong shape, dtype, device or stride raises ValueError; a non-tensor raises TypeError.
"""

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_tensor(name, t, ndim, dtypes, device=None):
    """`t` is a torch.Tensor of rank `ndim`, one of `dtypes`, on `device`, with a unit last stride.

    NOTE: only the last dimension must be contiguous; launchers pass every other stride to the
    kernel, so views (q sliced out of a fused qkv projection) need no copy.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} must have dtype in ({names}), got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but the other tensors are on {device}")
    if t.numel() > 0 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides "
                         f"{t.stride()}")


def check_shape(name, t, expected):
    """`t.shape` equals `expected` (a tuple of ints)."""
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)}, got {tuple(t.shape)}")


def check_kv_cache(q_name, q, k_cache, v_cache):
    """k_cache/v_cache: [num_blocks, block_size, num_kv_heads, head_dim], q's dtype and device;
    q: [..., num_q_heads, head_dim] with num_q_heads a multiple of num_kv_heads."""
    check_tensor("k_cache", k_cache, 4, (q.dtype,), q.device)
    check_tensor("v_cache", v_cache, 4, (q.dtype,), q.device)
    check_shape("v_cache", v_cache, k_cache.shape)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if q.shape[-1] != head_dim:
        raise ValueError(f"{q_name} head_dim {q.shape[-1]} != k_cache head_dim {head_dim}")
    if num_kv_heads == 0 or q.shape[-2] % num_kv_heads != 0:
        raise ValueError(
            f"{q_name} num_q_heads {q.shape[-2]} must be a multiple of k_cache num_kv_heads "
            f"{num_kv_heads}")
