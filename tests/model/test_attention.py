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


def _paged_batch(seq_lens, q_lens, seed=0, num_blocks=None):
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
                                   qsl, torch.device("cpu"))
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
