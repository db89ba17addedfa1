"""Paged KV cache kernels: Triton launchers against their torch references, and the references
against dense attention computed from the unpaged K/V.

On a machine without CUDA the Triton kernels run under the interpreter (TRITON_INTERPRET=1, set
here before triton is imported), so shapes stay tiny. Tolerances: fp32 atol 2e-5 / rtol 1e-4
(kernels use IEEE fp32 dots); fp16 atol/rtol 5e-3 (inputs, P and the output are rounded to fp16);
refs against the float64 dense oracle atol 1e-5. bf16 runs only on CUDA: the interpreter
mis-handles bf16 (numpy has no bf16).
"""

import os

import numpy as np
import pytest

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
import triton  # noqa: E402,F401  (a hard dependency: these tests must not skip silently)

from pyserve.kernels.extend_attention import extend_attention, extend_attention_ref, extend_tiles
from pyserve.kernels._launch import recording
from pyserve.kernels.kv_cache_write import write_kv_cache, write_kv_cache_ref
from pyserve.kernels.paged_decode_attention import (
    DecodeWorkspace,
    choose_num_splits,
    paged_decode_attention,
    paged_decode_attention_ref,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOL = {torch.float32: {"atol": 2e-5, "rtol": 1e-4}, torch.float16: {"atol": 5e-3, "rtol": 5e-3},
       torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2}}
HEADS = [(4, 2), (2, 2)]  # (num_q_heads, num_kv_heads): GQA and MHA
HEAD_DIM = 16
BLOCK_SIZE = 4
# 1: a single token; 7: not a multiple of BLOCK_SIZE; 40: spans two BLOCK_N=32 key tiles and
# several decode splits; 0 never appears here (see the zero-length test).
SEQ_LENS = [7, 1, 40, 16]


def make_paged_kv(seq_lens, num_kv_heads, dtype, seed=0, spare_blocks=3):
    """Random dense K/V per sequence, scattered into a paged cache at shuffled block ids.

    Returns (k_cache, v_cache, block_tables, [(k, v) per sequence]); block 0 stays null (zeros)
    and tables are padded with 0 up to the widest sequence plus one column.
    """
    g = torch.Generator().manual_seed(seed)
    pages = [(n + BLOCK_SIZE - 1) // BLOCK_SIZE for n in seq_lens]
    num_blocks = 1 + sum(pages) + spare_blocks
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
    k_cache = torch.zeros(shape, dtype=dtype)
    v_cache = torch.zeros(shape, dtype=dtype)
    ids = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    block_tables = torch.zeros(len(seq_lens), max(pages) + 1, dtype=torch.int32)
    dense = []
    for i, n in enumerate(seq_lens):
        k = torch.randn(n, num_kv_heads, HEAD_DIM, generator=g).to(dtype)
        v = torch.randn(n, num_kv_heads, HEAD_DIM, generator=g).to(dtype)
        for p in range(pages[i]):
            block = ids.pop()
            block_tables[i, p] = block
            rows = slice(p * BLOCK_SIZE, min((p + 1) * BLOCK_SIZE, n))
            k_cache[block, : rows.stop - rows.start] = k[rows]
            v_cache[block, : rows.stop - rows.start] = v[rows]
        dense.append((k, v))
    return k_cache.to(DEVICE), v_cache.to(DEVICE), block_tables.to(DEVICE), dense


def dense_attention(q, k, v, q_pos, scale):
    """Float64 oracle. q: [n, Hq, D] at absolute positions q_pos; k, v: [L, Hkv, D] unpaged."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    visible = torch.arange(k.shape[0])[None, :] <= torch.as_tensor(q_pos)[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)


def randn(*shape, dtype, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


def i32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


# --- write_kv_cache -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_cache_matches_ref_and_skips_negative_slots(dtype):
    num_blocks, num_kv_heads, num_tokens = 6, 2, 9
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
    k_cache, v_cache = randn(*shape, dtype=dtype, seed=2), randn(*shape, dtype=dtype, seed=3)
    # k and v are views into a fused [num_tokens, 2 * heads, D] projection: strided, not copies.
    kv = randn(num_tokens, 2 * num_kv_heads, HEAD_DIM, dtype=dtype, seed=4)
    k, v = kv[:, :num_kv_heads], kv[:, num_kv_heads:]
    slots = torch.tensor([5, 22, -1, 4, 13, 23, -1, 8, 1], dtype=torch.int64, device=DEVICE)

    before = k_cache.clone()
    kc_ref, vc_ref = k_cache.clone(), v_cache.clone()
    write_kv_cache_ref(k, v, kc_ref, vc_ref, slots)
    write_kv_cache(k, v, k_cache, v_cache, slots)

    assert torch.equal(k_cache, kc_ref) and torch.equal(v_cache, vc_ref)
    assert torch.equal(k_cache[22 // BLOCK_SIZE, 22 % BLOCK_SIZE], k[1])
    assert torch.equal(v_cache[1 // BLOCK_SIZE, 1 % BLOCK_SIZE], v[8])
    untouched = torch.ones(num_blocks * BLOCK_SIZE, dtype=torch.bool, device=DEVICE)
    untouched[slots[slots >= 0]] = False
    assert torch.equal(k_cache.flatten(0, 1)[untouched], before.flatten(0, 1)[untouched])


# --- references against dense attention -----------------------------------------------------

@pytest.mark.parametrize("num_q_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("seq_lens", [SEQ_LENS, [9, 9, 9]])  # equal lengths: the unmasked path
def test_decode_ref_matches_dense_attention(num_q_heads, num_kv_heads, seq_lens):
    k_cache, v_cache, tables, dense = make_paged_kv(seq_lens, num_kv_heads, torch.float32)
    q = randn(len(seq_lens), num_q_heads, HEAD_DIM, dtype=torch.float32)
    out = paged_decode_attention_ref(q, k_cache, v_cache, tables, i32(seq_lens), 0.25)
    for i, (k, v) in enumerate(dense):
        want = dense_attention(q[i:i + 1].cpu(), k, v, [len(k) - 1], 0.25)
        torch.testing.assert_close(out[i:i + 1].cpu().double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_q_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("seq_lens,q_lens", [
    ([23, 17, 37, 1], [5, 17, 1, 1]),  # cached prefix, fresh prefill, decodes
    ([23, 17, 37, 9], [4, 4, 4, 4]),  # verification at one depth: the short batch is a view of q
    ([23, 17, 37, 9], [17, 3, 3, 3]),  # a long query, then a run of short ones
])
def test_extend_ref_matches_dense_causal_attention(num_q_heads, num_kv_heads, seq_lens, q_lens):
    k_cache, v_cache, tables, dense = make_paged_kv(seq_lens, num_kv_heads, torch.float32)
    q = randn(sum(q_lens), num_q_heads, HEAD_DIM, dtype=torch.float32)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    out = extend_attention_ref(q, k_cache, v_cache, tables, i32(starts), i32(seq_lens), 0.3)
    for i, (k, v) in enumerate(dense):
        rows = slice(starts[i], starts[i + 1])
        q_pos = list(range(seq_lens[i] - q_lens[i], seq_lens[i]))
        want = dense_attention(q[rows].cpu(), k, v, q_pos, 0.3)
        torch.testing.assert_close(out[rows].cpu().double(), want, atol=1e-5, rtol=1e-5)


def tree_masks_for(seq_lens):
    """Masks as a token tree's rows carry them: sequence i hides some of its last keys (bit b
    for key len-1-b), never its own; the last sequence sees all."""
    masks = [~0b0110 & ~(1 << 9), ~0b1, ~(0b1011 << 1), -1]
    return torch.tensor(masks[: len(seq_lens)], dtype=torch.int64, device=DEVICE)


def test_decode_ref_with_masks_matches_dense_attention_over_the_seen_keys():
    k_cache, v_cache, tables, dense = make_paged_kv(SEQ_LENS, 2, torch.float32)
    q = randn(len(SEQ_LENS), 4, HEAD_DIM, dtype=torch.float32)
    masks = tree_masks_for(SEQ_LENS)
    out = paged_decode_attention_ref(q, k_cache, v_cache, tables, i32(SEQ_LENS), 0.25, masks=masks)
    for i, (k, v) in enumerate(dense):
        n = len(k)
        seen = [t for t in range(n) if n - 1 - t >= 64 or (int(masks[i]) >> (n - 1 - t)) & 1]
        want = dense_attention(q[i:i + 1].cpu(), k[seen], v[seen], [len(seen) - 1], 0.25)
        torch.testing.assert_close(out[i:i + 1].cpu().double(), want, atol=1e-5, rtol=1e-5)
    plain = paged_decode_attention_ref(q, k_cache, v_cache, tables, i32(SEQ_LENS), 0.25)
    assert not torch.allclose(out[0], plain[0]), "the mask hid nothing"


# --- Triton launchers against the references ------------------------------------------------

@pytest.mark.parametrize("num_splits", [None, 1, 3, 20])  # 20: stage 2 merges two chunks of 16
@pytest.mark.parametrize("num_q_heads,num_kv_heads", HEADS)
def test_paged_decode_attention_matches_ref(num_q_heads, num_kv_heads, num_splits):
    k_cache, v_cache, tables, _ = make_paged_kv(SEQ_LENS, num_kv_heads, torch.float32)
    q = randn(len(SEQ_LENS), num_q_heads, HEAD_DIM, dtype=torch.float32)
    args = (q, k_cache, v_cache, tables, i32(SEQ_LENS), HEAD_DIM**-0.5)
    out = paged_decode_attention(*args, num_splits=num_splits)
    torch.testing.assert_close(out, paged_decode_attention_ref(*args), **TOL[torch.float32])


@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_decode_attention_with_masks_matches_ref(num_splits):
    # 40 keys in splits of 32 (num_splits=3 leaves the middle split's keys 32..39 with some
    # hidden), and a mask hiding a whole tile's worth of keys in one sequence.
    lens = [40, 7, 64, 16]
    k_cache, v_cache, tables, _ = make_paged_kv(lens, 2, torch.float32)
    q = randn(len(lens), 4, HEAD_DIM, dtype=torch.float32)
    masks = torch.tensor([~(0xFFFF_FFFF << 1), ~0b110, 1, -1], dtype=torch.int64, device=DEVICE)
    args = (q, k_cache, v_cache, tables, i32(lens), HEAD_DIM**-0.5)
    out = paged_decode_attention(*args, num_splits=num_splits, masks=masks)
    torch.testing.assert_close(out, paged_decode_attention_ref(*args, masks=masks), **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != torch.float32])
def test_paged_decode_attention_half_precision_matches_ref(dtype):
    k_cache, v_cache, tables, _ = make_paged_kv(SEQ_LENS, 2, dtype)
    q = randn(len(SEQ_LENS), 4, HEAD_DIM, dtype=dtype)
    args = (q, k_cache, v_cache, tables, i32(SEQ_LENS), HEAD_DIM**-0.5)
    out = paged_decode_attention(*args, num_splits=2)
    assert out.dtype == dtype
    torch.testing.assert_close(out, paged_decode_attention_ref(*args), **TOL[dtype])


def test_paged_decode_attention_zero_length_sequence_gives_zeros():
    k_cache, v_cache, tables, _ = make_paged_kv([5, 3], 2, torch.float32)
    q = randn(2, 4, HEAD_DIM, dtype=torch.float32)
    args = (q, k_cache, v_cache, tables, i32([5, 0]), 0.25)
    out = paged_decode_attention(*args, num_splits=2)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    torch.testing.assert_close(out, paged_decode_attention_ref(*args), **TOL[torch.float32])


def test_a_shared_workspace_keeps_its_storage_and_the_results():
    workspace = DecodeWorkspace()
    k_cache, v_cache, tables, _ = make_paged_kv(SEQ_LENS, 2, torch.float32)
    q = randn(len(SEQ_LENS), 4, HEAD_DIM, dtype=torch.float32)
    args = (q, k_cache, v_cache, tables, i32(SEQ_LENS), HEAD_DIM**-0.5)
    # NOTE: the views are asked for on q.device, as the launcher asks: torch.device("cuda") is not
    # equal to a tensor's torch.device("cuda:0"), and the workspace reallocates on a device change.
    first = paged_decode_attention(*args, num_splits=3, workspace=workspace)
    mid_o, mid_lse = workspace.views(len(SEQ_LENS), 4, 3, HEAD_DIM, q.device)
    storage = (mid_o.untyped_storage().data_ptr(), mid_lse.untyped_storage().data_ptr())
    second = paged_decode_attention(*args, num_splits=2, workspace=workspace)  # fewer splits: same buffer
    mid_o, mid_lse = workspace.views(len(SEQ_LENS), 4, 2, HEAD_DIM, q.device)
    assert (mid_o.untyped_storage().data_ptr(), mid_lse.untyped_storage().data_ptr()) == storage
    assert mid_o.storage_offset() == 0 and mid_lse.storage_offset() == 0  # views of the buffers' starts
    torch.testing.assert_close(first, paged_decode_attention_ref(*args), **TOL[torch.float32])
    torch.testing.assert_close(second, first, **TOL[torch.float32])


def test_decode_compiles_a_fixed_set_of_variants_whatever_the_batch_and_table_width():
    """Batch sizes 1-17, table widths 1-16, split counts 1-6: one stage-1 variant with a single
    split, one with several, one stage 2 (the per-step integers are runtime arguments)."""
    workspace = DecodeWorkspace()
    with recording() as seen:
        for num_seqs, width, num_splits in [(1, 1, None), (2, 3, 2), (3, 5, 1), (5, 16, 6), (8, 4, None),
                                            (16, 7, 3), (17, 9, 5)]:
            lens = [(i % 4) + 1 for i in range(num_seqs)]  # one page each: any width >= 1 holds them
            k_cache, v_cache, tables, _ = make_paged_kv(lens, 2, torch.float32)
            tables = torch.nn.functional.pad(tables, (0, width - tables.shape[1]))  # crops to width 1
            q = randn(num_seqs, 4, HEAD_DIM, dtype=torch.float32)
            paged_decode_attention(q, k_cache, v_cache, tables, i32(lens), 0.25, num_splits=num_splits,
                                   workspace=workspace)
    assert {name: len(keys) for name, keys in seen.items()} == {"_decode_stage1_kernel": 2,
                                                               "_decode_stage2_kernel": 1}


def test_auto_num_splits_fills_the_device_with_long_contexts_only():
    assert choose_num_splits(num_seqs=64, num_kv_heads=8, max_seq_len=200, num_sms=132) == 1
    # batch 1, 2 KV heads, 32k context on 132 SMs: 4 programs an SM -> 264 splits, capped at 128
    assert choose_num_splits(num_seqs=1, num_kv_heads=2, max_seq_len=32768, num_sms=132) == 128
    assert choose_num_splits(num_seqs=1, num_kv_heads=8, max_seq_len=8192, num_sms=132) == 32  # by length
    assert choose_num_splits(num_seqs=8, num_kv_heads=8, max_seq_len=8192, num_sms=132) == 9  # by occupancy
    assert choose_num_splits(num_seqs=8, num_kv_heads=8, max_seq_len=8192, num_sms=16) == 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_q_heads,num_kv_heads", HEADS)
def test_extend_attention_mixed_batch_matches_ref(num_q_heads, num_kv_heads, dtype):
    # One launch: chunk after a cached prefix (q_len < seq_len, crossing a query tile of 16),
    # a fresh prefill spanning two query tiles, a long decode, and a length-1 prompt.
    seq_lens, q_lens = [38, 20, 40, 1], [18, 20, 1, 1]
    k_cache, v_cache, tables, _ = make_paged_kv(seq_lens, num_kv_heads, dtype)
    q = randn(sum(q_lens), num_q_heads, HEAD_DIM, dtype=dtype)
    starts = i32([0, 18, 38, 39, 40])
    args = (q, k_cache, v_cache, tables, starts, i32(seq_lens), HEAD_DIM**-0.5)
    group = num_q_heads // num_kv_heads
    tiles = extend_tiles(starts.cpu().numpy(), group)
    per_tile = 64 // group  # queries x group heads fill 64 rows
    assert tiles.tolist() == [[s, t] for s, n in enumerate([18, 20, 1, 1]) for t in range(-(-n // per_tile))]
    out = extend_attention(*args, tiles=torch.from_numpy(tiles).to(DEVICE))
    torch.testing.assert_close(out, extend_attention_ref(*args), **TOL[dtype])
    torch.testing.assert_close(extend_attention(*args), out)  # tiles built from starts


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(2, 2), (6, 2)])  # 64 queries a tile; 21 (a group of 3)
def test_extend_attention_tiles_cross_query_tiles_for_any_group(num_q_heads, num_kv_heads):
    seq_lens, q_lens = [90, 30], [70, 30]  # 70 queries after a 20-token prefix: two or four tiles
    k_cache, v_cache, tables, _ = make_paged_kv(seq_lens, num_kv_heads, torch.float32)
    q = randn(sum(q_lens), num_q_heads, HEAD_DIM, dtype=torch.float32)
    args = (q, k_cache, v_cache, tables, i32([0, 70, 100]), i32(seq_lens), HEAD_DIM**-0.5)
    tiles = extend_tiles(np.array([0, 70, 100]), num_q_heads // num_kv_heads)
    assert len(tiles) == (3 if num_q_heads == 2 else 6)
    out = extend_attention(*args, tiles=torch.from_numpy(tiles).to(DEVICE))
    torch.testing.assert_close(out, extend_attention_ref(*args), **TOL[torch.float32])


def test_extend_attention_computes_only_the_sequences_its_tiles_name():
    seq_lens, q_lens = [38, 20, 40, 1], [18, 20, 1, 1]
    k_cache, v_cache, tables, _ = make_paged_kv(seq_lens, 2, torch.float32)
    q = randn(sum(q_lens), 4, HEAD_DIM, dtype=torch.float32)
    starts = i32([0, 18, 38, 39, 40])
    args = (q, k_cache, v_cache, tables, starts, i32(seq_lens), HEAD_DIM**-0.5)
    tiles = extend_tiles(starts.cpu().numpy(), 2, np.array([1, 3]))
    assert tiles.tolist() == [[1, 0], [3, 0]]
    out = extend_attention(*args, tiles=torch.from_numpy(tiles).to(DEVICE))
    want = extend_attention_ref(*args)
    rows = [*range(18, 38), 39]
    torch.testing.assert_close(out[rows], want[rows], **TOL[torch.float32])


def test_write_then_extend_then_decode_follow_one_sequence():
    """A prompt's K/V written through write_kv_cache, prefilled, then decoded one more token:
    each stage agrees with dense causal attention over the unpaged K/V."""
    num_q_heads, num_kv_heads, n = 4, 2, 11
    k_cache = torch.zeros(8, BLOCK_SIZE, num_kv_heads, HEAD_DIM, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    table = i32([[6, 2, 5, 0]])
    slots = torch.tensor([int(table[0, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
                          for p in range(n + 1)], dtype=torch.int64, device=DEVICE)
    k = randn(n + 1, num_kv_heads, HEAD_DIM, dtype=torch.float32, seed=5)
    v = randn(n + 1, num_kv_heads, HEAD_DIM, dtype=torch.float32, seed=6)
    q = randn(n + 1, num_q_heads, HEAD_DIM, dtype=torch.float32, seed=7)

    write_kv_cache(k[:n], v[:n], k_cache, v_cache, slots[:n])
    prefill = extend_attention(q[:n], k_cache, v_cache, table, i32([0, n]), i32([n]), 0.25)
    write_kv_cache(k[n:], v[n:], k_cache, v_cache, slots[n:])
    decode = paged_decode_attention(q[n:], k_cache, v_cache, table, i32([n + 1]), 0.25)

    want = dense_attention(q.cpu(), k.cpu(), v.cpu(), list(range(n + 1)), 0.25)
    torch.testing.assert_close(prefill.cpu().double(), want[:n], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(decode.cpu().double(), want[n:], atol=2e-5, rtol=1e-4)


# --- argument checks ------------------------------------------------------------------------

def _decode_args():
    k_cache, v_cache, tables, _ = make_paged_kv([5, 3], 2, torch.float32)
    return {"q": randn(2, 4, HEAD_DIM, dtype=torch.float32), "k_cache": k_cache,
            "v_cache": v_cache, "block_tables": tables, "seq_lens": i32([5, 3]), "scale": 0.25}


@pytest.mark.parametrize("name,bad", [
    ("q", lambda a: a["q"].to(torch.int32)),
    ("q", lambda a: a["q"][:, :3]),                                   # 3 q heads, 2 kv heads
    ("k_cache", lambda a: a["k_cache"].half()),
    ("v_cache", lambda a: a["v_cache"][:, :, :1]),
    ("block_tables", lambda a: a["block_tables"].long()),
    ("block_tables", lambda a: a["block_tables"][:1]),
    ("seq_lens", lambda a: a["seq_lens"][:1]),
    ("q", lambda a: a["q"].transpose(1, 2).contiguous().transpose(1, 2)),  # strided last dim
])
def test_launchers_reject_bad_arguments_naming_them(name, bad):
    decode = _decode_args()
    decode[name] = bad(decode)
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        paged_decode_attention(**decode)
    extend = _decode_args()
    extend[name] = bad(extend)
    extend["query_start_loc"] = i32([0, 1, 2])
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        extend_attention(**extend)


def test_extend_attention_rejects_bad_query_start_loc():
    args = _decode_args()
    with pytest.raises(ValueError, match="query_start_loc"):
        extend_attention(**args, query_start_loc=i32([0, 2]))


def test_paged_decode_attention_rejects_bad_num_splits():
    with pytest.raises(ValueError, match="num_splits"):
        paged_decode_attention(**_decode_args(), num_splits=0)


def test_write_kv_cache_rejects_bad_arguments_naming_them():
    k_cache = torch.zeros(4, BLOCK_SIZE, 2, HEAD_DIM, device=DEVICE)
    k = torch.zeros(3, 2, HEAD_DIM, device=DEVICE)
    slots = torch.arange(3, device=DEVICE)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_cache(k, k, k_cache, k_cache.clone(), slots.int())
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_cache(k, k, k_cache, k_cache.clone(), slots[:2])
    with pytest.raises(ValueError, match="k_cache"):
        write_kv_cache(k, k, k_cache.half(), k_cache.clone(), slots)
    with pytest.raises(ValueError, match=r"^v\b"):
        write_kv_cache(k, k[:, :1], k_cache, k_cache.clone(), slots)
