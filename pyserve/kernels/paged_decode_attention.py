"""Decode attention over a paged KV cache: one query token per sequence (flash-decoding).

Layouts:
  q:                  [num_seqs, num_q_heads, head_dim]      (last dim contiguous)
  k_cache, v_cache:   [num_blocks, block_size, num_kv_heads, head_dim], q's dtype; block 0 = null
  block_tables:       int32 [num_seqs, max_blocks], padded with 0
  seq_lens:           int32 [num_seqs], context length including this step's token
  out:                [num_seqs, num_q_heads, head_dim], q's dtype
Query i attends to the keys at positions 0 .. seq_lens[i]-1 of its sequence; key position p lives
in block block_tables[i, p // block_size] at offset p % block_size. GQA: q head h reads kv head
h // (num_q_heads // num_kv_heads). A sequence with seq_lens[i] == 0 (batch padding) gets zeros.
Invariant: seq_lens[i] <= max_blocks * block_size (positions past the table are masked out).

Two launches. Stage 1: one program per (sequence, kv head, split) takes a contiguous range of the
sequence's keys for all the q heads of its group and writes a normalised partial output and its
log-sum-exp (base 2). Stage 2: one program per (sequence, q head) merges the splits.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pyserve.kernels._checks import FLOAT_DTYPES, check_kv_cache, check_shape, check_tensor
from pyserve.kernels._gather import gather_pages
from pyserve.kernels._paged import load_kv_tile, online_softmax_update

BLOCK_N = 32            # keys per inner iteration (independent of the cache's block_size)
MIN_GROUP = 16          # tl.dot needs at least 16 rows: a GQA group is padded up to this
MAX_SPLITS = 32
TOKENS_PER_SPLIT = 256  # auto split: at most this many keys per split ...
TARGET_PROGRAMS = 1024  # ... but no more splits than needed to launch this many stage-1 programs
LOG2E = 1.4426950408889634


@triton.jit
def _decode_stage1_kernel(
    # pointers
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, mid_o_ptr, mid_lse_ptr,
    # sizes
    num_q_heads, head_dim, block_size, max_blocks, scale_log2,
    # strides
    stride_q_seq, stride_q_head,
    stride_kc_block, stride_kc_off, stride_kc_head,
    stride_vc_block, stride_vc_off, stride_vc_head,
    stride_bt_seq,
    stride_mo_seq, stride_mo_head, stride_mo_split,
    stride_ml_seq, stride_ml_head,
    # meta-parameters
    GROUP: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    # Each split covers a whole number of BLOCK_N tiles; short sequences leave late splits empty.
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    g_mask = g < GROUP
    d_mask = d < head_dim
    q = tl.load(q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for tile in range(start, end, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)
        k, v, n_mask = load_kv_tile(
            k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, pos, pos < end, kv_head, d, d_mask,
            max_blocks, block_size, stride_bt_seq, stride_kc_block, stride_kc_off, stride_kc_head,
            stride_vc_block, stride_vc_off, stride_vc_head,
        )

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        s = tl.where(n_mask[None, :], s, float("-inf"))
        # Every tile holds at least one valid key (tile < end), so the running max stays finite.
        m_i, l_i, acc = online_softmax_update(m_i, l_i, acc, s, v, DOT_PRECISION)

    # Empty split: l_i == 0 -> lse == -inf, o == 0; stage 2 gives it weight 0.
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    o = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(l_safe))
    tl.store(mid_o_ptr + seq * stride_mo_seq + heads[:, None] * stride_mo_head
             + split * stride_mo_split + d[None, :], o, mask=g_mask[:, None] & d_mask[None, :])
    tl.store(mid_lse_ptr + seq * stride_ml_seq + heads * stride_ml_head + split, lse, mask=g_mask)


@triton.jit
def _decode_stage2_kernel(
    # pointers
    mid_o_ptr, mid_lse_ptr, out_ptr,
    # sizes
    head_dim,
    # strides
    stride_mo_seq, stride_mo_head, stride_mo_split,
    stride_ml_seq, stride_ml_head,
    stride_out_seq, stride_out_head,
    # meta-parameters
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = sp < NUM_SPLITS
    d_mask = d < head_dim

    lse = tl.load(mid_lse_ptr + seq * stride_ml_seq + head * stride_ml_head + sp,
                  mask=s_mask, other=float("-inf"))
    o = tl.load(mid_o_ptr + seq * stride_mo_seq + head * stride_mo_head
                + sp[:, None] * stride_mo_split + d[None, :],
                mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # seq_len == 0: every weight is 0, output 0
    w = tl.exp2(lse - m)
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + seq * stride_out_seq + head * stride_out_head + d,
             out.to(out_ptr.dtype.element_ty), mask=d_mask)


def _check(q, k_cache, v_cache, block_tables, seq_lens, num_splits):
    check_tensor("q", q, 3, FLOAT_DTYPES)
    check_kv_cache("q", q, k_cache, v_cache)
    check_tensor("block_tables", block_tables, 2, (torch.int32,), q.device)
    if block_tables.shape[0] != q.shape[0]:
        raise ValueError(
            f"block_tables has {block_tables.shape[0]} rows but q has {q.shape[0]} sequences")
    check_tensor("seq_lens", seq_lens, 1, (torch.int32,), q.device)
    check_shape("seq_lens", seq_lens, (q.shape[0],))
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits must be None or a positive int, got {num_splits!r}")


def choose_num_splits(num_seqs, num_kv_heads, max_seq_len):
    """Splits per sequence: enough to fill the device, none shorter than TOKENS_PER_SPLIT keys."""
    by_len = triton.cdiv(max(max_seq_len, 1), TOKENS_PER_SPLIT)
    by_occupancy = triton.cdiv(TARGET_PROGRAMS, max(num_seqs * num_kv_heads, 1))
    return max(1, min(by_len, by_occupancy, MAX_SPLITS))


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits=None):
    """softmax(q K^T * scale) V per sequence and q head, keys read through block_tables.

    NOTE: with num_splits=None the split count comes from the block table's width
    (max_blocks * block_size bounds every seq_len), so the launch never syncs with the device.
    """
    _check(q, k_cache, v_cache, block_tables, seq_lens, num_splits)
    num_seqs, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    max_blocks = block_tables.shape[1]
    group = num_q_heads // num_kv_heads
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_blocks * block_size)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_seqs == 0:
        return out
    mid_o = torch.empty(num_seqs, num_q_heads, num_splits, head_dim, dtype=torch.float32,
                        device=q.device)
    mid_lse = torch.empty(num_seqs, num_q_heads, num_splits, dtype=torch.float32, device=q.device)
    block_d = max(16, triton.next_power_of_2(head_dim))
    _decode_stage1_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, mid_o, mid_lse,
        num_q_heads, head_dim, block_size, max_blocks, float(scale) * LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        GROUP=group, NUM_SPLITS=num_splits,
        BLOCK_G=max(MIN_GROUP, triton.next_power_of_2(group)), BLOCK_N=BLOCK_N, BLOCK_D=block_d,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    _decode_stage2_kernel[(num_seqs, num_q_heads)](
        mid_o, mid_lse, out,
        head_dim,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
    )
    return out


def paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale,
                               num_splits=None):
    """Torch reference and CPU backend: gather every sequence's keys, padded to the longest, with
    one index op, and run scaled_dot_product_attention (fp32) with the padding masked.
    `num_splits` is accepted and ignored."""
    _check(q, k_cache, v_cache, block_tables, seq_lens, num_splits)
    layout = decode_layout(block_tables, seq_lens, k_cache.shape[1])
    return decode_attention_with_layout(q, k_cache, v_cache, layout, scale)


class DecodeLayout(NamedTuple):
    """What the reference derives from the block tables alone, the same for every layer of a step."""

    pages: torch.Tensor  # [num_seqs, num_pages] int64
    valid: torch.Tensor | None  # [num_seqs, max_len] bool; None when every sequence is max_len long
    max_len: int
    scratch: tuple[torch.Tensor, torch.Tensor] | None = None  # gather buffers for K and V, or None


def decode_layout(block_tables, seq_lens, block_size, cache=None) -> DecodeLayout:
    """The step's layout; with `cache` (a layer's K cache), also the gather buffers every layer
    reuses."""
    max_len = int(seq_lens.max()) if seq_lens.numel() else 0
    num_pages = (max_len + block_size - 1) // block_size
    if num_pages > block_tables.shape[1]:
        raise ValueError(f"seq_lens has a length {max_len} beyond block_tables' "
                         f"{block_tables.shape[1]} blocks of {block_size}")
    pages = block_tables[:, :num_pages].long()
    valid = torch.arange(max_len, device=seq_lens.device) < seq_lens[:, None]
    if max_len and bool(valid.all()):
        valid = None  # as transformers: no mask when no key is padding (same result, less work)
    scratch = None
    if cache is not None:
        shape = (pages.numel(), *cache.shape[1:])
        scratch = (cache.new_empty(shape), cache.new_empty(shape))
    return DecodeLayout(pages, valid, max_len, scratch)


def decode_attention_with_layout(q, k_cache, v_cache, layout: DecodeLayout, scale):
    """The reference's attention for one layer, given the step's `decode_layout` (unchecked)."""
    pages, valid, max_len, scratch = layout
    num_seqs, num_q_heads, head_dim = q.shape
    k_buf, v_buf = scratch if scratch is not None else (None, None)
    # [num_seqs, num_pages, block_size, H_kv, D] -> [num_seqs, H_kv, max_len, D]
    k = gather_pages(k_cache, pages, k_buf)[:, :max_len].transpose(1, 2)
    v = gather_pages(v_cache, pages, v_buf)[:, :max_len].transpose(1, 2)
    mask = None if valid is None else valid[:, None, None, :]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.float().unsqueeze(2), k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    if valid is not None:
        out = out.nan_to_num(0.0)                                            # seq_len 0 -> zeros
    return out.reshape(num_seqs, num_q_heads, head_dim).to(q.dtype)
