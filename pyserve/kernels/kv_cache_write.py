"""Write one step's new keys and values into a layer's paged KV cache.

Layouts:
  k, v:               [num_tokens, num_kv_heads, head_dim]  (last dim contiguous; views are fine)
  k_cache, v_cache:   [num_blocks, block_size, num_kv_heads, head_dim], the dtype of k and v
  slot_mapping:       int64 [num_tokens]; token t goes to slot s = slot_mapping[t], i.e. block
                      s // block_size, offset s % block_size. A negative slot means "padding, skip".
Invariants: valid slots are < num_blocks * block_size (the kernel masks out-of-range slots rather
than write out of bounds; the reference raises IndexError), and no two tokens share a slot.
"""

import torch
import triton
import triton.language as tl

from pyserve.kernels._checks import FLOAT_DTYPES, check_shape, check_tensor
from pyserve.kernels._launch import launch


# The row strides of k and v follow how the step's projections were laid out (fused or not);
# never specialised on, so a warm-up with its own tensors compiles the variant steps use.
RUNTIME = ("stride_k_tok", "stride_v_tok")


@triton.jit(do_not_specialize=RUNTIME)
def _write_kv_cache_kernel(
    # pointers
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    # sizes
    num_kv_heads, head_dim, block_size, num_slots,
    # strides
    stride_k_tok, stride_k_head,
    stride_v_tok, stride_v_head,
    stride_kc_block, stride_kc_off, stride_kc_head,
    stride_vc_block, stride_vc_off, stride_vc_head,
    # meta-parameters
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program per token: copies its [num_kv_heads, head_dim] K and V rows into its slot."""
    tok = tl.program_id(0).to(tl.int64)  # tok * stride may pass 2**31
    slot = tl.load(slot_mapping_ptr + tok)
    if (slot < 0) | (slot >= num_slots):
        return
    block = slot // block_size
    off = slot % block_size
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < num_kv_heads) & (d < head_dim)

    k = tl.load(k_ptr + tok * stride_k_tok + h * stride_k_head + d, mask=mask)
    v = tl.load(v_ptr + tok * stride_v_tok + h * stride_v_head + d, mask=mask)
    kc = k_cache_ptr + block * stride_kc_block + off * stride_kc_off + h * stride_kc_head + d
    vc = v_cache_ptr + block * stride_vc_block + off * stride_vc_off + h * stride_vc_head + d
    tl.store(kc, k, mask=mask)
    tl.store(vc, v, mask=mask)


def _check(k, v, k_cache, v_cache, slot_mapping):
    check_tensor("k", k, 3, FLOAT_DTYPES)
    check_tensor("v", v, 3, (k.dtype,), k.device)
    check_shape("v", v, k.shape)
    check_tensor("k_cache", k_cache, 4, (k.dtype,), k.device)
    check_tensor("v_cache", v_cache, 4, (k.dtype,), k.device)
    check_shape("v_cache", v_cache, k_cache.shape)
    if tuple(k.shape[1:]) != tuple(k_cache.shape[2:]):
        raise ValueError(
            f"k [num_tokens, num_kv_heads, head_dim] has heads/dim {tuple(k.shape[1:])} but "
            f"k_cache has {tuple(k_cache.shape[2:])}")
    check_tensor("slot_mapping", slot_mapping, 1, (torch.int64,), k.device)
    check_shape("slot_mapping", slot_mapping, (k.shape[0],))


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping):
    """Scatter k/v rows into k_cache/v_cache in place at `slot_mapping` (negative slots skipped)."""
    _check(k, v, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = k.shape
    num_blocks, block_size = k_cache.shape[:2]
    if num_tokens == 0:
        return
    launch(
        _write_kv_cache_kernel, (num_tokens,), RUNTIME,
        k_ptr=k, v_ptr=v, k_cache_ptr=k_cache, v_cache_ptr=v_cache, slot_mapping_ptr=slot_mapping,
        num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size, num_slots=num_blocks * block_size,
        stride_k_tok=k.stride(0), stride_k_head=k.stride(1),
        stride_v_tok=v.stride(0), stride_v_head=v.stride(1),
        stride_kc_block=k_cache.stride(0), stride_kc_off=k_cache.stride(1), stride_kc_head=k_cache.stride(2),
        stride_vc_block=v_cache.stride(0), stride_vc_off=v_cache.stride(1), stride_vc_head=v_cache.stride(2),
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


def write_kv_cache_ref(k, v, k_cache, v_cache, slot_mapping):
    """Torch reference (and CPU backend) of write_kv_cache: one index_copy_ per cache into its
    [num_blocks * block_size, H, D] view."""
    _check(k, v, k_cache, v_cache, slot_mapping)
    keep = slot_mapping >= 0
    write_kv_rows(k, v, k_cache, v_cache, slot_mapping, None if bool(keep.all()) else keep)


def write_kv_rows(k, v, k_cache, v_cache, slot_mapping, keep=None):
    """The reference's write, unchecked; `keep` (bool per row, None = all rows) skips padding."""
    if keep is not None:
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)
