"""Decode attention over a paged KV cache: one query token per sequence (flash-decoding).

Layouts:
  q:                  [num_seqs, num_q_heads, head_dim]      (last dim contiguous)
  k_cache, v_cache:   [num_blocks, block_size, num_kv_heads, head_dim], q's dtype; block 0 = null
  block_tables:       int32 [num_seqs, max_blocks], padded with 0
  seq_lens:           int32 [num_seqs], context length including this step's token
  out:                [num_seqs, num_q_heads, head_dim], q's dtype
  masks (optional):   int64 [num_seqs], uint64 bits: bit b clear hides key seq_lens[i]-1-b (a token
                      tree's row sees the keys before the tree and its own path only)
Query i attends to the keys at positions 0 .. seq_lens[i]-1 of its sequence; key position p lives
in block block_tables[i, p // block_size] at offset p % block_size. GQA: q head h reads kv head
h // (num_q_heads // num_kv_heads). A sequence with seq_lens[i] == 0 (batch padding) gets zeros.
Invariant: seq_lens[i] <= max_blocks * block_size (positions past the table are masked out).

Stage 1: one program per (sequence, kv head, split) takes a contiguous range of the sequence's
keys for all the q heads of its group and writes a normalised partial output and its
log-sum-exp (base 2). Stage 2: one program per (sequence, q head) merges the splits. With one
split, stage 1 writes the output itself and stage 2 does not run.

Compiled variants (see kernels._launch): the split count, the block table's width and the
workspace strides that follow them are runtime arguments, so the variants are fixed by the
model (dtype, head_dim, GQA group, block_size) and whether the step has one split or several:
two of stage 1, one of stage 2. The split count follows the device's multiprocessor count:
enough programs to fill it, none shorter than TOKENS_PER_SPLIT keys, at most MAX_SPLITS.
The partial results live in a DecodeWorkspace the caller keeps: allocated when it must grow,
reused by every layer and step after.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pyserve.kernels._checks import FLOAT_DTYPES, check_kv_cache, check_shape, check_tensor
from pyserve.kernels._gather import gather_pages
from pyserve.kernels._launch import launch
from pyserve.kernels._paged import load_kv_tile, online_softmax_update

BLOCK_N = 32            # keys per inner iteration (independent of the cache's block_size)
MIN_GROUP = 16          # tl.dot needs at least 16 rows: a GQA group is padded up to this
MAX_SPLITS = 128
TOKENS_PER_SPLIT = 256  # at most this many keys per split ...
PROGRAMS_PER_SM = 4     # ... but no more splits than needed for this many stage-1 programs an SM
BLOCK_S = 16            # splits per iteration of stage 2
CPU_SMS = 8             # the "multiprocessors" of the interpreter (CPU tensors)
LOG2E = 1.4426950408889634

# Per-step integers (see kernels._launch), and q's row stride (it follows how the projections are
# laid out): never specialised on.
STAGE1_RUNTIME = ("max_blocks", "num_splits", "stride_bt_seq", "stride_mo_seq", "stride_mo_head",
                  "stride_mo_split", "stride_ml_seq", "stride_ml_head", "stride_q_seq")
STAGE2_RUNTIME = ("num_splits", "stride_mo_seq", "stride_mo_head", "stride_mo_split", "stride_ml_seq",
                  "stride_ml_head")


@triton.jit(do_not_specialize=STAGE1_RUNTIME)
def _decode_stage1_kernel(
    # pointers
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, masks_ptr, mid_o_ptr, mid_lse_ptr, out_ptr,
    # sizes
    num_q_heads, head_dim, block_size, max_blocks, num_splits, scale_log2,
    # strides
    stride_q_seq, stride_q_head,
    stride_kc_block, stride_kc_off, stride_kc_head,
    stride_vc_block, stride_vc_off, stride_vc_head,
    stride_bt_seq,
    stride_mo_seq, stride_mo_head, stride_mo_split,
    stride_ml_seq, stride_ml_head,
    stride_out_seq, stride_out_head,
    # meta-parameters
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DIRECT: tl.constexpr, HAS_MASKS: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    if HAS_MASKS:
        hidden_bits = tl.load(masks_ptr + seq)
    # Each split covers a whole number of BLOCK_N tiles; short sequences leave late splits empty.
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
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
        if HAS_MASKS:  # key seq_len-1-b is seen where bit b is set (b >= 64: always)
            back = seq_len - 1 - pos
            n_mask = n_mask & ((back >= 64) | (((hidden_bits >> tl.minimum(back, 63)) & 1) != 0))
        s = tl.where(n_mask[None, :], s, float("-inf"))
        # A tile whose keys are all masked leaves the running sums as they were (see
        # online_softmax_update); a split whose keys all are has l_i == 0 (an empty split).
        m_i, l_i, acc = online_softmax_update(m_i, l_i, acc, s, v, DOT_PRECISION)

    # Empty split: l_i == 0 -> lse == -inf, o == 0; stage 2 gives it weight 0.
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    o = acc / l_safe[:, None]
    o_mask = g_mask[:, None] & d_mask[None, :]
    if DIRECT:  # the only split: o is the output (zeros for seq_len == 0)
        tl.store(out_ptr + seq * stride_out_seq + heads[:, None] * stride_out_head + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(mid_o_ptr + seq * stride_mo_seq + heads[:, None] * stride_mo_head
                 + split * stride_mo_split + d[None, :], o, mask=o_mask)
        tl.store(mid_lse_ptr + seq * stride_ml_seq + heads * stride_ml_head + split, lse, mask=g_mask)


@triton.jit(do_not_specialize=STAGE2_RUNTIME)
def _decode_stage2_kernel(
    # pointers
    mid_o_ptr, mid_lse_ptr, out_ptr,
    # sizes
    head_dim, num_splits,
    # strides
    stride_mo_seq, stride_mo_head, stride_mo_split,
    stride_ml_seq, stride_ml_head,
    stride_out_seq, stride_out_head,
    # meta-parameters
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    lse_row = mid_lse_ptr + seq * stride_ml_seq + head * stride_ml_head
    o_row = mid_o_ptr + seq * stride_mo_seq + head * stride_mo_head

    # Pass 1: the largest log-sum-exp over every split, BLOCK_S at a time.
    m_vec = tl.full([BLOCK_S], float("-inf"), tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        sp = s0 + tl.arange(0, BLOCK_S)
        m_vec = tl.maximum(m_vec, tl.load(lse_row + sp, mask=sp < num_splits, other=float("-inf")))
    m = tl.max(m_vec, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # seq_len == 0: every weight is 0, output 0
    # Pass 2: the splits' outputs weighted by exp2(lse - m).
    total = tl.zeros([BLOCK_S], tl.float32)
    acc = tl.zeros([BLOCK_S, BLOCK_D], tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        sp = s0 + tl.arange(0, BLOCK_S)
        s_mask = sp < num_splits
        w = tl.exp2(tl.load(lse_row + sp, mask=s_mask, other=float("-inf")) - m)
        o = tl.load(o_row + sp[:, None] * stride_mo_split + d[None, :], mask=s_mask[:, None] & d_mask[None, :],
                    other=0.0)
        total += w
        acc += w[:, None] * o
    denom = tl.sum(total, 0)
    out = tl.sum(acc, 0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(out_ptr + seq * stride_out_seq + head * stride_out_head + d,
             out.to(out_ptr.dtype.element_ty), mask=d_mask)


class DecodeWorkspace:
    """The partial outputs and log-sum-exps of stage 1, grown when a step needs more, else
    reused (every layer and step of an engine shares one). A workspace made with `fixed` is
    allocated once and never replaced (CUDA graphs replay on its addresses): a step that needs
    more than it holds is refused."""

    def __init__(self, fixed: tuple[int, int, torch.device] | None = None) -> None:
        """`fixed`: (elements of mid_lse, head_dim, device) to allocate now, for good."""
        self._o: torch.Tensor | None = None
        self._lse: torch.Tensor | None = None
        self.fixed = fixed is not None
        if fixed is not None:
            n, head_dim, device = fixed
            self._allocate(n, head_dim, device)

    def _allocate(self, n: int, head_dim: int, device) -> None:
        self._lse = torch.empty(max(n, 1), dtype=torch.float32, device=device)
        self._o = torch.empty(max(n * head_dim, 1), dtype=torch.float32, device=device)

    def views(self, num_seqs: int, num_q_heads: int, num_splits: int, head_dim: int, device) -> tuple:
        """(mid_o [num_seqs, num_q_heads, num_splits, head_dim], mid_lse [.., num_splits]) f32."""
        n = num_seqs * num_q_heads * num_splits
        if self._lse is None or self._lse.numel() < n or self._o.numel() < n * head_dim \
                or self._o.device != _indexed(torch.device(device)):
            if self.fixed:
                raise ValueError(f"a decode step of {num_seqs} rows x {num_q_heads} heads x {num_splits} splits "
                                 f"needs more than the fixed workspace holds")
            self._allocate(n, head_dim, device)
        return (self._o[:n * head_dim].view(num_seqs, num_q_heads, num_splits, head_dim),
                self._lse[:n].view(num_seqs, num_q_heads, num_splits))


def _indexed(device: torch.device) -> torch.device:
    """`device` with its index: "cuda" names the current GPU, which a tensor's device spells "cuda:N"."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def multiprocessor_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return CPU_SMS


def _check(q, k_cache, v_cache, block_tables, seq_lens, num_splits, masks=None):
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
    if masks is not None:
        check_tensor("masks", masks, 1, (torch.int64,), q.device)
        check_shape("masks", masks, (q.shape[0],))


def choose_num_splits(num_seqs, num_kv_heads, max_seq_len, num_sms):
    """Splits per sequence: enough stage-1 programs to fill `num_sms` multiprocessors, none
    shorter than TOKENS_PER_SPLIT keys, at most MAX_SPLITS."""
    by_len = triton.cdiv(max(max_seq_len, 1), TOKENS_PER_SPLIT)
    by_occupancy = triton.cdiv(PROGRAMS_PER_SM * num_sms, max(num_seqs * num_kv_heads, 1))
    return max(1, min(by_len, by_occupancy, MAX_SPLITS))


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits=None,
                           workspace: DecodeWorkspace | None = None, masks: torch.Tensor | None = None):
    """softmax(q K^T * scale) V per sequence and q head, keys read through block_tables.

    NOTE: with num_splits=None the split count comes from the block table's width
    (max_blocks * block_size bounds every seq_len), so the launch never syncs with the device.
    Without `workspace` the partial results are allocated for this call.
    """
    _check(q, k_cache, v_cache, block_tables, seq_lens, num_splits, masks)
    num_seqs, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    max_blocks = block_tables.shape[1]
    group = num_q_heads // num_kv_heads
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_blocks * block_size,
                                       multiprocessor_count(q.device))
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_seqs == 0:
        return out
    mid_o, mid_lse = (workspace or DecodeWorkspace()).views(num_seqs, num_q_heads, num_splits, head_dim, q.device)
    block_d = max(16, triton.next_power_of_2(head_dim))
    launch(
        _decode_stage1_kernel, (num_seqs, num_kv_heads, num_splits), STAGE1_RUNTIME,
        q_ptr=q, k_cache_ptr=k_cache, v_cache_ptr=v_cache, block_tables_ptr=block_tables, seq_lens_ptr=seq_lens,
        masks_ptr=masks if masks is not None else seq_lens, mid_o_ptr=mid_o, mid_lse_ptr=mid_lse, out_ptr=out,
        num_q_heads=num_q_heads, head_dim=head_dim, block_size=block_size, max_blocks=max_blocks,
        num_splits=num_splits, scale_log2=float(scale) * LOG2E,
        stride_q_seq=q.stride(0), stride_q_head=q.stride(1),
        stride_kc_block=k_cache.stride(0), stride_kc_off=k_cache.stride(1), stride_kc_head=k_cache.stride(2),
        stride_vc_block=v_cache.stride(0), stride_vc_off=v_cache.stride(1), stride_vc_head=v_cache.stride(2),
        stride_bt_seq=block_tables.stride(0),
        stride_mo_seq=mid_o.stride(0), stride_mo_head=mid_o.stride(1), stride_mo_split=mid_o.stride(2),
        stride_ml_seq=mid_lse.stride(0), stride_ml_head=mid_lse.stride(1),
        stride_out_seq=out.stride(0), stride_out_head=out.stride(1),
        GROUP=group, BLOCK_G=max(MIN_GROUP, triton.next_power_of_2(group)), BLOCK_N=BLOCK_N, BLOCK_D=block_d,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", DIRECT=num_splits == 1,
        HAS_MASKS=masks is not None,
    )
    if num_splits > 1:
        launch(
            _decode_stage2_kernel, (num_seqs, num_q_heads), STAGE2_RUNTIME,
            mid_o_ptr=mid_o, mid_lse_ptr=mid_lse, out_ptr=out,
            head_dim=head_dim, num_splits=num_splits,
            stride_mo_seq=mid_o.stride(0), stride_mo_head=mid_o.stride(1), stride_mo_split=mid_o.stride(2),
            stride_ml_seq=mid_lse.stride(0), stride_ml_head=mid_lse.stride(1),
            stride_out_seq=out.stride(0), stride_out_head=out.stride(1),
            BLOCK_S=BLOCK_S, BLOCK_D=block_d,
        )
    return out


def paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale,
                               num_splits=None, masks=None):
    """Torch reference and CPU backend: gather every sequence's keys, padded to the longest, with
    one index op, and run scaled_dot_product_attention (fp32) with the padding masked.
    `num_splits` is accepted and ignored."""
    _check(q, k_cache, v_cache, block_tables, seq_lens, num_splits, masks)
    layout = decode_layout(block_tables, seq_lens, k_cache.shape[1], masks=masks)
    return decode_attention_with_layout(q, k_cache, v_cache, layout, scale)


class DecodeLayout(NamedTuple):
    """What the reference derives from the block tables alone, the same for every layer of a step."""

    pages: torch.Tensor  # [num_seqs, num_pages] int64
    valid: torch.Tensor | None  # [num_seqs, max_len] bool; None when every sequence is max_len long
    max_len: int
    scratch: tuple[torch.Tensor, torch.Tensor] | None = None  # gather buffers for K and V, or None


def decode_layout(block_tables, seq_lens, block_size, cache=None, masks=None) -> DecodeLayout:
    """The step's layout; with `cache` (a layer's K cache), also the gather buffers every layer
    reuses; `masks` (int64 [num_seqs] or None) hide keys as the kernel's do."""
    max_len = int(seq_lens.max()) if seq_lens.numel() else 0
    num_pages = (max_len + block_size - 1) // block_size
    if num_pages > block_tables.shape[1]:
        raise ValueError(f"seq_lens has a length {max_len} beyond block_tables' "
                         f"{block_tables.shape[1]} blocks of {block_size}")
    pages = block_tables[:, :num_pages].long()
    valid = torch.arange(max_len, device=seq_lens.device) < seq_lens[:, None]
    if masks is not None:
        valid = valid & seen_keys(seq_lens, masks, max_len)
    if max_len and bool(valid.all()):
        valid = None  # as transformers: no mask when no key is padding (same result, less work)
    scratch = None
    if cache is not None:
        shape = (pages.numel(), *cache.shape[1:])
        scratch = (cache.new_empty(shape), cache.new_empty(shape))
    return DecodeLayout(pages, valid, max_len, scratch)


def seen_keys(seq_lens: torch.Tensor, masks: torch.Tensor, max_len: int) -> torch.Tensor:
    """bool [num_seqs, max_len]: the keys each sequence's mask leaves seen (bit b of masks[i] for
    key seq_lens[i] - 1 - b; keys 64 or more back are always seen)."""
    back = seq_lens.long()[:, None] - 1 - torch.arange(max_len, device=seq_lens.device)
    bits = (masks.long()[:, None] >> back.clamp(0, 63)) & 1
    return (back >= 64) | (back < 0) | (bits == 1)


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
