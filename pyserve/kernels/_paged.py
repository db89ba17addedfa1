"""Triton helpers both attention kernels share: one tile of keys and values read through a
sequence's block table, and the streaming-softmax update."""

import triton
import triton.language as tl


@triton.jit
def load_kv_tile(
    k_cache_ptr, v_cache_ptr, block_tables_ptr,
    seq, pos, valid, kv_head, d, d_mask,
    max_blocks, block_size,
    stride_bt_seq, stride_kc_block, stride_kc_off, stride_kc_head,
    stride_vc_block, stride_vc_off, stride_vc_head,
):
    """K and V ([BLOCK_N, BLOCK_D]) at token positions `pos` of sequence `seq`, zero where
    `valid` is false or the position is past the block table; also returns the key mask."""
    page = pos // block_size
    n_mask = valid & (page < max_blocks)
    block = tl.load(block_tables_ptr + seq * stride_bt_seq + page, mask=n_mask, other=0).to(tl.int64)
    off = pos % block_size
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(k_cache_ptr + block[:, None] * stride_kc_block + off[:, None] * stride_kc_off
                + kv_head * stride_kc_head + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + block[:, None] * stride_vc_block + off[:, None] * stride_vc_off
                + kv_head * stride_vc_head + d[None, :], mask=kv_mask, other=0.0)
    return k, v, n_mask


@triton.jit
def online_softmax_update(m_i, l_i, acc, s, v, DOT_PRECISION: tl.constexpr):
    """Folds one tile of scores `s` (log2 domain, [rows, BLOCK_N]) and values `v` into the running
    row max `m_i`, exp-sum `l_i` and output accumulator `acc` of a streaming softmax. A row
    whose scores so far are all -inf (masked) keeps l_i and acc at zero."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc
