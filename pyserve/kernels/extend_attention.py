"""Causal attention for variable-length query chunks over a paged KV cache, in one launch.

Prefill of a new prompt, chunked prefill after a cached prefix, and decode are all the same case:
sequence i brings qlen_i = query_start_loc[i+1] - query_start_loc[i] new tokens (rows
query_start_loc[i] : query_start_loc[i+1] of q) at absolute positions
seq_lens[i] - qlen_i .. seq_lens[i] - 1, and the query at position p attends keys 0 .. p.

Layouts:
  q:                  [num_tokens, num_q_heads, head_dim]    (last dim contiguous)
  k_cache, v_cache:   [num_blocks, block_size, num_kv_heads, head_dim], q's dtype; block 0 = null
  block_tables:       int32 [num_seqs, max_blocks], padded with 0
  query_start_loc:    int32 [num_seqs + 1], cumulative query lengths, query_start_loc[0] == 0
  seq_lens:           int32 [num_seqs], context length including the new tokens
  out:                [num_tokens, num_q_heads, head_dim], q's dtype; rows past
                      query_start_loc[-1] (batch padding) are left unwritten
Invariants: the new tokens' K/V are already in the cache (write_kv_cache ran first), so every key
is read through block_tables; qlen_i <= seq_lens[i] <= max_blocks * block_size. GQA: q head h
reads kv head h // (num_q_heads // num_kv_heads).

One program per (query tile, KV head) over a flat list of tiles: (sequence, tile of its queries)
pairs built on the host from the query offsets (`extend_tiles`), so a mixed batch launches
programs only where there are queries, and the launcher can leave sequences out (the decode rows
the decode kernel takes). A tile packs its queries for every q head of the KV head's GQA group
into the rows of one tensor-core tile (BLOCK_M = 64 rows or more, BLOCK_N = 64 keys), so each
K/V tile is read once per group, not once per q head. The block table's width is a runtime argument: the
compiled variants are fixed by the model (see kernels._launch).
"""

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from pyserve.kernels._checks import FLOAT_DTYPES, check_kv_cache, check_shape, check_tensor
from pyserve.kernels._gather import gather_pages
from pyserve.kernels._launch import launch
from pyserve.kernels._paged import load_kv_tile, online_softmax_update

BLOCK_N = 64  # keys per inner iteration (independent of the cache's block_size)
LOG2E = 1.4426950408889634
RUNTIME = ("max_blocks", "stride_bt_seq", "stride_q_tok")  # per-step integers and q's row stride: never specialised on


@triton.jit(do_not_specialize=RUNTIME)
def _extend_attention_kernel(
    # pointers
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, tiles_ptr, out_ptr,
    # sizes
    head_dim, block_size, max_blocks, scale_log2,
    # strides
    stride_q_tok, stride_q_head,
    stride_kc_block, stride_kc_off, stride_kc_head,
    stride_vc_block, stride_vc_off, stride_vc_head,
    stride_bt_seq,
    stride_out_tok, stride_out_head,
    # meta-parameters
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    tile_id = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    seq = tl.load(tiles_ptr + 2 * tile_id).to(tl.int64)
    m_tile = tl.load(tiles_ptr + 2 * tile_id + 1)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - q_len

    # Row m of the tile is query m // GROUP of the tile for q head m % GROUP of the KV head's
    # group: every head of the group shares the K/V tiles, read once.
    m = tl.arange(0, BLOCK_M)
    qi = m // GROUP
    rows = m_tile * BLOCK_Q + qi                      # query index within the chunk
    heads = kv_head * GROUP + m % GROUP
    q_pos = prefix_len + rows                         # absolute position of each query
    d = tl.arange(0, BLOCK_D)
    m_mask = (qi < BLOCK_Q) & (rows < q_len)
    d_mask = d < head_dim
    q_rows = (q_start + rows).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_q_tok + heads[:, None] * stride_q_head + d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Causal: no query of this tile sees a key past its last query's position.
    kv_end = tl.minimum(seq_len, prefix_len + (m_tile + 1) * BLOCK_Q)
    for tile in range(0, kv_end, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)
        k, v, n_mask = load_kv_tile(
            k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, pos, pos < kv_end, kv_head, d, d_mask,
            max_blocks, block_size, stride_bt_seq, stride_kc_block, stride_kc_off, stride_kc_head,
            stride_vc_block, stride_vc_off, stride_vc_head,
        )

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        s = tl.where(n_mask[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        # Key 0 is visible to every row (q_pos >= 0), so after the first tile m_i is finite and
        # a fully masked row in a later tile only adds exp2(-inf) = 0.
        m_i, l_i, acc = online_softmax_update(m_i, l_i, acc, s, v, DOT_PRECISION)

    out = acc / l_i[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_out_tok + heads[:, None] * stride_out_head + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def tile_rows(group: int) -> tuple[int, int]:
    """(queries per tile, BLOCK_M rows = those queries x the GQA group): 64-row tiles for tensor
    cores, more rows when the group is larger."""
    block_m = max(64, triton.next_power_of_2(group))
    return block_m // group, block_m


def warps_and_stages(head_dim: int) -> tuple[int, int]:
    """num_warps and num_stages: wider warps for wide heads, fewer stages when a stage is big."""
    return 4 if head_dim <= 64 else 8, 3 if head_dim <= 128 else 2


def _check(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, tiles=None):
    check_tensor("q", q, 3, FLOAT_DTYPES)
    check_kv_cache("q", q, k_cache, v_cache)
    check_tensor("seq_lens", seq_lens, 1, (torch.int32,), q.device)
    num_seqs = seq_lens.shape[0]
    check_tensor("block_tables", block_tables, 2, (torch.int32,), q.device)
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows but seq_lens has "
                         f"{num_seqs} sequences")
    check_tensor("query_start_loc", query_start_loc, 1, (torch.int32,), q.device)
    check_shape("query_start_loc", query_start_loc, (num_seqs + 1,))
    if tiles is not None:
        check_tensor("tiles", tiles, 2, (torch.int32,), q.device)
        if tiles.shape[1] != 2 or not tiles.is_contiguous():
            raise ValueError(f"tiles must be a contiguous [num_tiles, 2] tensor, got shape {tuple(tiles.shape)}")


def extend_tiles(query_start_loc: np.ndarray, group: int, seqs: np.ndarray | None = None) -> np.ndarray:
    """int32 [num_tiles, 2]: (sequence, query tile) over the queries of sequences `seqs` (default:
    all), tiles as the kernel cuts them for GQA `group` (tile_rows), from the host copy of
    query_start_loc."""
    queries_per_tile = tile_rows(group)[0]
    q_lens = np.diff(np.asarray(query_start_loc, dtype=np.int64))
    if seqs is None:
        seqs = np.arange(len(q_lens))
    per_seq = -(-q_lens[seqs] // queries_per_tile)
    tiles = np.empty((int(per_seq.sum()), 2), dtype=np.int32)
    tiles[:, 0] = np.repeat(seqs, per_seq)
    tiles[:, 1] = np.arange(len(tiles)) - np.repeat(np.cumsum(per_seq) - per_seq, per_seq)
    return tiles


def extend_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, tiles=None):
    """Causal softmax(q K^T * scale) V for every new token of the sequences `tiles` covers (rows
    of other sequences are left unwritten), in one launch.

    NOTE: pass `tiles` (extend_tiles of the host's query offsets, on q's device); None builds
    them for every sequence from query_start_loc, which syncs with the device.
    """
    _check(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, tiles)
    num_tokens, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    block_q, block_m = tile_rows(group)
    num_warps, num_stages = warps_and_stages(head_dim)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if tiles is None:
        tiles = torch.from_numpy(extend_tiles(query_start_loc.cpu().numpy(), group)).to(q.device)
    if num_tokens == 0 or tiles.shape[0] == 0:
        return out
    launch(
        _extend_attention_kernel, (tiles.shape[0], num_kv_heads), RUNTIME,
        q_ptr=q, k_cache_ptr=k_cache, v_cache_ptr=v_cache, block_tables_ptr=block_tables,
        query_start_loc_ptr=query_start_loc, seq_lens_ptr=seq_lens, tiles_ptr=tiles, out_ptr=out,
        head_dim=head_dim, block_size=block_size, max_blocks=block_tables.shape[1], scale_log2=float(scale) * LOG2E,
        stride_q_tok=q.stride(0), stride_q_head=q.stride(1),
        stride_kc_block=k_cache.stride(0), stride_kc_off=k_cache.stride(1), stride_kc_head=k_cache.stride(2),
        stride_vc_block=v_cache.stride(0), stride_vc_off=v_cache.stride(1), stride_vc_head=v_cache.stride(2),
        stride_bt_seq=block_tables.stride(0),
        stride_out_tok=out.stride(0), stride_out_head=out.stride(1),
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=BLOCK_N,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=num_warps, num_stages=num_stages,
    )
    return out


SHORT_QUERY = 16  # the reference batches sequences with at most this many query tokens


def extend_attention_ref(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale):
    """Torch reference and CPU backend: scaled_dot_product_attention (fp32) over each sequence's
    keys gathered through its block table, with a causal mask offset by the cached prefix.
    Sequences with short queries (speculative verification, small chunks) go through one
    padded batch; longer ones one by one."""
    _check(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens)
    layout = extend_layout(block_tables, query_start_loc, seq_lens, k_cache.shape[1])
    return extend_attention_with_layout(q, k_cache, v_cache, layout, scale)


@dataclass(slots=True)
class ShortQueries:
    """Sequences with at most SHORT_QUERY queries, attended as one padded batch [S, max_q]."""

    pages: torch.Tensor   # int64 [S, num_pages]
    mask: torch.Tensor    # bool [S, max_q, max_len], causal and within the sequence
    # When the sequences' rows are one run of q with max_q rows each (speculative verification
    # with the same depth everywhere), its first row; the batch is then a view of q.
    first_row: int | None
    tokens: torch.Tensor  # int64 [S, max_q], q rows (padding points at row 0)
    padded: torch.Tensor  # int64 [real rows], their places in the flattened [S * max_q] batch
    rows: torch.Tensor    # int64 [real rows], their q rows


@dataclass(slots=True)
class ExtendLayout:
    """What the reference derives from the block tables alone, the same for every layer of a step."""

    long: list[tuple[int, int, torch.Tensor, torch.Tensor]]  # (q_lo, q_hi, pages, causal mask) each
    short: ShortQueries | None


def extend_layout(block_tables, query_start_loc, seq_lens, block_size) -> ExtendLayout:
    dev = block_tables.device
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    long, short = [], []
    for i, seq_len in enumerate(lens):
        q_lo, q_hi = starts[i], starts[i + 1]
        q_len = q_hi - q_lo
        if q_len == 0:
            continue
        if not q_len <= seq_len <= block_tables.shape[1] * block_size:
            raise ValueError(f"sequence {i}: query length {q_len}, seq_lens {seq_len} and "
                             f"{block_tables.shape[1]} blocks of {block_size} are inconsistent")
        if q_len <= SHORT_QUERY:
            short.append((i, q_lo, q_len, seq_len))
            continue
        pages = block_tables[i, :(seq_len + block_size - 1) // block_size].long()
        q_pos = torch.arange(seq_len - q_len, seq_len, device=dev)
        causal = torch.arange(seq_len, device=dev)[None, :] <= q_pos[:, None]
        long.append((q_lo, q_hi, pages, causal))
    return ExtendLayout(long, _short_layout(block_tables, short, block_size) if short else None)


def _short_layout(block_tables, seqs: list[tuple[int, int, int, int]], block_size: int) -> ShortQueries:
    """`seqs`: (sequence index, first q row, query length, seq_len) of each short sequence."""
    dev = block_tables.device
    rows, first, q_lens, lens = (torch.tensor(col, dtype=torch.int64, device=dev) for col in zip(*seqs))
    max_q, max_len = max(s[2] for s in seqs), max(s[3] for s in seqs)
    pages = block_tables[rows, : (max_len + block_size - 1) // block_size].long()
    j = torch.arange(max_q, device=dev)
    real = j[None, :] < q_lens[:, None]                                      # [S, max_q]
    tokens = torch.where(real, first[:, None] + j[None, :], 0)
    q_pos = lens[:, None] - q_lens[:, None] + j[None, :]
    key_pos = torch.arange(max_len, device=dev)
    mask = (key_pos[None, None, :] <= q_pos[:, :, None]) & (key_pos[None, None, :] < lens[:, None, None])
    run = all(s[2] == max_q and s[1] == seqs[0][1] + i * max_q for i, s in enumerate(seqs))
    return ShortQueries(pages, mask, seqs[0][1] if run else None, tokens, real.flatten().nonzero().squeeze(1),
                        tokens[real])


def extend_attention_with_layout(q, k_cache, v_cache, layout: ExtendLayout, scale):
    """The reference's attention for one layer, given the step's `extend_layout` (unchecked)."""
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    for q_lo, q_hi, pages, causal in layout.long:
        seq_len = causal.shape[1]
        k = gather_pages(k_cache, pages)[:seq_len].transpose(0, 1)  # [H_kv, seq_len, D]
        v = gather_pages(v_cache, pages)[:seq_len].transpose(0, 1)
        qi = q[q_lo:q_hi].transpose(0, 1).float()                            # [H_q, q_len, D]
        o = torch.nn.functional.scaled_dot_product_attention(
            qi, k, v, attn_mask=causal, scale=scale, enable_gqa=True)
        out[q_lo:q_hi] = o.transpose(0, 1).to(q.dtype)
    if layout.short is not None:
        sq = layout.short
        num_seqs, max_q, max_len = sq.mask.shape
        k = gather_pages(k_cache, sq.pages)[:, :max_len].transpose(1, 2)     # [S, H_kv, max_len, D]
        v = gather_pages(v_cache, sq.pages)[:, :max_len].transpose(1, 2)
        if sq.first_row is not None:
            lo, hi = sq.first_row, sq.first_row + num_seqs * max_q
            qs = q[lo:hi].view(num_seqs, max_q, *q.shape[1:])
        else:
            qs = q[sq.tokens]
        o = torch.nn.functional.scaled_dot_product_attention(
            qs.float().transpose(1, 2), k, v, attn_mask=sq.mask[:, None], scale=scale, enable_gqa=True)
        o = o.transpose(1, 2).reshape(num_seqs * max_q, *q.shape[1:]).to(q.dtype)
        if sq.first_row is not None:
            out[lo:hi] = o
        else:
            out[sq.rows] = o.index_select(0, sq.padded)
    return out
