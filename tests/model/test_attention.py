"""The CPU attention path against the plain references: the Rust decode kernel (pages read in
place) in decode and mixed batches, its argument checks and thread-count invariance, and decode
rows split into groups of similar length on the reference path; and the Triton backend's routing
of a mixed step (under the interpreter on a machine without CUDA)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pyserve import _core
from pyserve.kernels._launch import recording
from pyserve.kernels.paged_decode_attention import paged_decode_attention_ref
from pyserve.model.attention import AttentionMetadata, InPlaceDecode, TorchBackend, TritonBackend

BLOCK, HKV, HQ, D = 4, 2, 4, 8


def _paged_batch(seq_lens, q_lens, seed=0, num_blocks=None, tree_parents=None):
    """A random paged cache (of `num_blocks`, default just enough) holding every sequence's
    context, and the step's layout: each sequence's last `q_lens[i]` positions are this step's
    queries."""
    g = torch.Generator().manual_seed(seed)
    pages = [(n + BLOCK - 1) // BLOCK for n in seq_lens]
    num_blocks = num_blocks or 1 + sum(pages)
    k_cache = torch.randn(num_blocks, BLOCK, HKV, D, generator=g)
    v_cache = torch.randn(num_blocks, BLOCK, HKV, D, generator=g)
    ids = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    tables = np.zeros((len(seq_lens), max(pages)), dtype=np.int32)
    slots = []
    for i, (n, q) in enumerate(zip(seq_lens, q_lens)):
        tables[i, : pages[i]] = [ids.pop() for _ in range(pages[i])]
        slots += [tables[i, p // BLOCK] * BLOCK + p % BLOCK for p in range(n - q, n)]
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    meta = AttentionMetadata.build(np.array(slots, dtype=np.int64), tables, np.array(seq_lens, dtype=np.int32),
                                   qsl, torch.device("cpu"), tree_parents)
    n = int(qsl[-1])
    q, k, v = (torch.randn(n, h, D, generator=g) for h in (HQ, HKV, HKV))
    return q, k, v, k_cache, v_cache, meta, torch.from_numpy(tables)


def test_grouped_decode_equals_one_padded_call():
    seq_lens = [3, 300, 5, 290, 7, 310, 2, 280, 150]
    q, k, v, kc, vc, meta, tables = _paged_batch(seq_lens, [1] * len(seq_lens))
    out = TorchBackend(cpu_kernel=False).forward(q, k, v, kc, vc, meta, 0.3)
    assert len(meta.torch_plan.decode) > 1  # the split happened
    want = paged_decode_attention_ref(q, kc, vc, tables, torch.tensor(seq_lens, dtype=torch.int32), 0.3)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-5)


def test_grouped_decode_rows_of_a_mixed_batch_land_in_place():
    seq_lens, q_lens = [3, 900, 40, 890, 2, 910, 4], [1, 1, 12, 1, 1, 1, 1]
    q, k, v, kc, vc, meta, tables = _paged_batch(seq_lens, q_lens, seed=1)
    out = TorchBackend(cpu_kernel=False).forward(q, k, v, kc, vc, meta, 0.3)
    assert len(meta.torch_plan.decode) > 1
    decode = [i for i, n in enumerate(q_lens) if n == 1]
    rows = torch.tensor(np.cumsum([0] + q_lens)[decode])  # each decode sequence's one q row
    want = paged_decode_attention_ref(q[rows], kc, vc, tables[decode],
                                      torch.tensor([seq_lens[i] for i in decode], dtype=torch.int32), 0.3)
    torch.testing.assert_close(out[rows], want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("q_lens,kernel_rows", [
    ([1] * 9, 9),  # decode
    ([1, 1, 12, 1, 5, 1, 1, 1, 1], 24),  # verification-sized queries: causal row by row in the kernel
    ([1, 1, 40, 1, 5, 1, 1, 1, 17], 11),  # longer queries (40, 17) go to the extend reference
])
def test_cpu_kernel_matches_the_reference_in_decode_and_mixed_batches(q_lens, kernel_rows):
    seq_lens = [3, 300, 40, 290, 7, 310, 1, 64, 17]
    q, k, v, kc, vc, meta, tables = _paged_batch(seq_lens, q_lens, seed=2)
    kernel_caches = kc.clone(), vc.clone()
    want = TorchBackend(cpu_kernel=False).forward(q, k, v, kc, vc, meta, 0.3)
    meta.torch_plan = None
    got = TorchBackend().forward(q, k, v, *kernel_caches, meta, 0.3)
    assert isinstance(meta.torch_plan.decode, InPlaceDecode)
    assert len(meta.torch_plan.decode.seq_lens) == kernel_rows
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert torch.equal(kernel_caches[0], kc)  # both wrote the step's keys to the same slots


# Sequence 1 verifies a token tree of 11 rows (its last token, then drafts: rows 1 and 2 follow
# row 0, 3 follows 1, 4 follows 3, 5 follows 2, 6..10 follow 1): longer than a short query, it
# still attends as decode rows. The others: a decode, a chain of drafts, a prefill chunk.
TREE = [-1, 0, 0, 1, 3, 2, 1, 1, 1, 1, 1]
STEP_Q_LENS = [1, len(TREE), 4, 30]
STEP_SEQ_LENS = [9, 40, 17, 45]


def _tree_step(seed=4):
    parents = np.concatenate([[-1], TREE, np.arange(4) - 1, np.arange(30) - 1]).astype(np.int32)
    return _paged_batch(STEP_SEQ_LENS, STEP_Q_LENS, seed=seed, tree_parents=parents)


def test_tree_masks_see_the_keys_before_the_tree_and_the_own_path():
    *_, meta, _ = _tree_step()
    masks = meta.tree_masks[1:12]
    assert meta.tree_seqs.tolist() == [False, True, False, False]
    bits = lambda m, n: [(int(m) >> b) & 1 for b in range(n)]  # noqa: E731
    assert bits(masks[0], 4) == [1, 1, 1, 1]  # the tree's root: everything before it
    assert bits(masks[4], 6) == [1, 1, 0, 1, 1, 1]  # row 4: itself, 3, (2 hidden), 1, root, before
    assert bits(masks[5], 7) == [1, 0, 0, 1, 0, 1, 1]  # row 5: itself, 2, root
    assert bits(masks[10], 12) == [1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1]  # row 10: itself, 1, root, before
    assert (meta.tree_masks[12:] == np.uint64(2**64 - 1)).all()  # chains see all


def _dense_tree_rows(q, kc, vc, tables, seq, rows, scale):
    """Float64 attention of the tree's rows over the keys before the tree and their own path."""
    n, first_row = STEP_SEQ_LENS[seq], sum(STEP_Q_LENS[:seq])
    tree_start = n - len(TREE)
    keys = lambda cache, p: cache[tables[seq, p // BLOCK], p % BLOCK].double()  # noqa: E731
    out = []
    for j in rows:
        path, r = [], j
        while r >= 0:
            path.append(tree_start + r)
            r = TREE[r]
        seen = list(range(tree_start)) + sorted(path)
        k = torch.stack([keys(kc, p) for p in seen]).repeat_interleave(HQ // HKV, 1)
        v = torch.stack([keys(vc, p) for p in seen]).repeat_interleave(HQ // HKV, 1)
        w = torch.softmax(torch.einsum("hd,khd->hk", q[first_row + j].double(), k) * scale, -1)
        out.append(torch.einsum("hk,khd->hd", w, v))
    return torch.stack(out)


@pytest.mark.parametrize("backend", ["cpu_kernel", "reference", "triton"])
def test_a_token_tree_attends_over_its_own_paths_on_every_backend(backend):
    q, k, v, kc, vc, meta, tables = _tree_step()
    attend = {"cpu_kernel": TorchBackend(), "reference": TorchBackend(cpu_kernel=False),
              "triton": TritonBackend()}[backend]
    out = attend.forward(q, k, v, kc, vc, meta, 0.3)
    want = _dense_tree_rows(q, kc, vc, tables, 1, range(len(TREE)), 0.3)
    torch.testing.assert_close(out[1:12].double(), want, atol=1e-5, rtol=1e-5)
    q2, k2, v2, kc2, vc2, plain, _ = _paged_batch(STEP_SEQ_LENS, STEP_Q_LENS, seed=4)
    rest = np.r_[0, 12:len(q)]
    reference = TorchBackend(cpu_kernel=False).forward(q2, k2, v2, kc2, vc2, plain, 0.3)
    torch.testing.assert_close(out[rest], reference[rest], atol=1e-5, rtol=1e-5)  # the other rows as before
    assert not torch.allclose(out[5], reference[5], atol=1e-3), "the tree's mask hid nothing"


def test_cpu_kernel_refuses_bad_arguments_naming_them():
    q, _, _, kc, vc, meta, tables = _paged_batch([5, 9], [1, 1])
    lens, out = np.array([5, 9], dtype=np.int32), np.empty(q.shape, dtype=np.float32)
    args = dict(q=q.numpy(), k_cache=kc.numpy(), v_cache=vc.numpy(), block_tables=tables.numpy(), seq_lens=lens,
                scale=1.0, out=out)
    _core.paged_decode_attention(**args)
    bad_tables = tables.numpy().copy()
    bad_tables[1, 0] = 10_000
    for field, value, words in [
        ("block_tables", bad_tables, "block id 10000"),
        ("seq_lens", np.array([5, 900], dtype=np.int32), "length 900"),
        ("v_cache", vc.numpy()[:, :2].copy(), "v_cache"),
        ("q", q.numpy()[:, :, :4].copy(), "q and out"),
        ("k_cache", np.asfortranarray(kc.numpy()), "k_cache must be C-contiguous"),
    ]:
        with pytest.raises(ValueError, match=words):
            _core.paged_decode_attention(**{**args, field: value})


def test_cpu_kernel_on_torchs_threads_gives_the_bits_of_one_thread():
    # 64 sequences of 2-317 keys: enough work that, with threads=2, the kernel splits the batch
    # over the calling thread's OpenMP team (torch's libgomp)
    seq_lens = [2 + i * 61 % 316 for i in range(64)]
    q, _, _, kc, vc, _, tables = _paged_batch(seq_lens, [1] * 64, seed=5)
    lens = np.array(seq_lens, dtype=np.int32)
    outs = []
    for threads in (1, 2):
        out = np.full(q.shape, np.nan, dtype=np.float32)
        _core.paged_decode_attention(q.numpy(), kc.numpy(), vc.numpy(), tables.numpy(), lens, 0.3, out, threads=threads)
        outs.append(out)
    np.testing.assert_array_equal(outs[0], outs[1])
    want = paged_decode_attention_ref(q, kc, vc, tables, torch.from_numpy(lens), 0.3)
    torch.testing.assert_close(torch.from_numpy(outs[1]), want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("q_lens", [[1, 5, 1, 17, 1], [3, 9, 2, 17, 4], [9, 12, 3, 17, 10], [2, 8, 3, 4, 1]])
def test_the_triton_backend_sends_short_queries_to_decode_rows_and_the_rest_to_extend_tiles(q_lens):
    seq_lens = [9, 30, 3, 40, 22]
    q, k, v, kc, vc, meta, _ = _paged_batch(seq_lens, q_lens, seed=2)
    ref_meta = AttentionMetadata.build(meta.slot_mapping.numpy(), meta.block_tables.numpy(), meta.seq_lens_host,
                                       meta.query_start_loc_host, torch.device("cpu"))
    want = TorchBackend(cpu_kernel=False).forward(q, k, v, kc.clone(), vc.clone(), ref_meta, 0.3)
    backend = TritonBackend()
    with recording() as seen:
        out = backend.forward(q, k, v, kc, vc, meta, 0.3)
        out_again = backend.forward(q, k, v, kc, vc, meta, 0.3)  # the next layer: the step's plan is reused
    plan = meta.triton_plan
    starts = np.cumsum([0] + q_lens)
    decode_rows = [r for s, n in zip(starts, q_lens) if n <= 8 for r in range(s, s + n)]
    assert (plan.decode_tokens.tolist() if plan.decode_tokens is not None else []) == decode_rows
    if decode_rows:  # each token of a short query sees its own causal prefix
        assert plan.decode_seq_lens.tolist() == [seq_lens[i] - n + j + 1 for i, n in enumerate(q_lens) if n <= 8
                                                 for j in range(n)]
    per_tile = 64 // (HQ // HKV)  # queries of a tile: its 64 rows hold them for each head of a group
    assert plan.extend_tiles.tolist() == [[i, t] for i, n in enumerate(q_lens) if n > 8
                                          for t in range(-(-n // per_tile))]
    assert ("_decode_stage1_kernel" in seen) == bool(decode_rows)
    assert ("_extend_attention_kernel" in seen) == any(n > 8 for n in q_lens)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(out_again, out)


def test_the_triton_warm_up_launches_every_variant_later_steps_use():
    """After warm_up, decode steps of several sizes and mixed steps (q, k, v as views of one fused
    projection, as the model passes them) launch no variant the warm-up did not."""
    backend = TritonBackend()
    pool = 100  # blocks: the engine's pool is one size for its life
    _, _, _, kc, vc, _, _ = _paged_batch([5], [1], num_blocks=pool)
    with recording() as warm:
        backend.warm_up(kc, vc, HQ)
    warm_keys = {name: set(keys) for name, keys in warm.items()}
    assert set(warm_keys) == {"_write_kv_cache_kernel", "_decode_stage1_kernel", "_decode_stage2_kernel",
                              "_extend_attention_kernel"}
    with recording() as later:
        for seq_lens, q_lens in [([9], [1]), ([9, 30, 3], [1, 1, 1]), ([40, 7, 12, 3, 8], [1, 6, 1, 3, 1]),
                                 ([33] * 9, [1] * 9)]:
            q, k, v, kc, vc, meta, _ = _paged_batch(seq_lens, q_lens, seed=3, num_blocks=pool)
            fused = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], 1)  # one row per token
            q, k, v = (t.view(len(fused), -1, D) for t in fused.split([HQ * D, HKV * D, HKV * D], 1))
            backend.forward(q, k, v, kc, vc, meta, 0.3)
    for name, keys in later.items():
        assert keys <= warm_keys[name], name
