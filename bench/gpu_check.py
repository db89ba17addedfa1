"""One script for a short GPU window: every Triton kernel checked against its torch reference at
production shapes, then timed against the device's copy bandwidth and SDPA, the compile count,
host time per launch, a CUDA-graph capture and replay, and batch-1 decode against the weight-read
roofline. Meant to run under `timeout 540`; each step is timed and a failing step is recorded
without stopping the others. Writes gpu_check.json and gpu_check.md under --out (default $OUT,
else bench/results/gpu_check/).

Steps:
  kernel_tests      pytest tests/kernels on the device
  correctness       decode and extend vs the references: bf16 at head dims 64-256 (GQA 4), GQA
                    1/2/8 at head dim 128, fp16 at 128; contexts 1 to 32k; block size 16
  large_kv_pool     a KV pool above 2**31 elements, a sequence in its last blocks
  decode_bandwidth  decode at batch 1, 8, 64 (4k context): GB/s of KV read vs the copy bandwidth
  extend_rows       verification rows (batch 64 x 5 queries) and a mixed step through the backend
  prefill           causal prefill TFLOP/s against torch's scaled_dot_product_attention
  lora              shrink + expand at ranks 16, 64, 256
  quantized_matmul  W8A16 (int8, fp8) and W4A16 (group 128) at 1, 8, 64 rows, 4096 -> 14336: error vs the
                    reference, GB/s of weight bytes vs the copy bandwidth, and time vs the bf16 matmul
  rejection         rejection sampling (noise drawn in the kernel), 64 requests x 4 drafts, half
                    of them coupled (seeded), vocabulary 152064
  compile_count     variants recorded over a serving-like sweep of batch sizes and table widths,
                    and (on CUDA) the kernels compiled by the sweep after a warm-up: must be 0
  launch_host_time  host microseconds per decode-attention call at batch 1
  cuda_graph        one decode layer (KV write + attention) captured and replayed: same output
  batch1_decode     a ~0.5B random Llama, bf16, batch 1 through the engine, replaying CUDA graphs
                    and eager (enforce_eager): the same tokens, tok/s and its share of the
                    weight-read roofline (weight bytes / copy bandwidth)
  speculative_graphs  draft-model speculation (the target as its own draft), the draft's steps
                    on CUDA graphs and eager: the same tokens, greedy and sampled; tok/s
  eagle_trees       token-tree verification: the decode kernel with tree masks (64 requests x 16
                    rows, 4k context) vs its reference and vs the same rows unmasked (time); the
                    embedded target with its EAGLE head verifying trees on the Triton backend:
                    greedy tokens equal plain decoding's, tok/s of both

`--dry-run` runs every step at tiny shapes on the CPU under the Triton interpreter (fp32 and
fp16), so CI keeps the script working; its timings mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from functools import partial
from pathlib import Path

HERE = Path(__file__).resolve().parent

FULL = {"device": "cuda", "dtypes": ["bfloat16", "float16"], "head_dims": [64, 80, 96, 128, 256],
        "groups": [1, 2, 8], "contexts": [1, 300, 4096, 32768], "block": 16, "kv_heads": 8, "q_heads": 32,
        "head_dim": 128, "bw_context": 4096, "bw_batches": [1, 8, 64], "prefill": (8, 2048), "lora": (256, 4096),
        "lora_ranks": [16, 64, 256], "vocab": 152064, "rej": (64, 4), "pool_elements": 2**31 + 2**20,
        "qmm": (4096, 14336), "qmm_rows": [1, 8, 64],
        "model": {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
                  "num_attention_heads": 16, "num_key_value_heads": 8, "vocab_size": 32000}, "tokens": 128}
DRY = {"device": "cpu", "dtypes": ["float32", "float16"], "head_dims": [16, 24], "groups": [1, 2],
       "contexts": [1, 7, 40], "block": 4, "kv_heads": 2, "q_heads": 4, "head_dim": 16, "bw_context": 40,
       "bw_batches": [1, 3], "prefill": (2, 20), "lora": (4, 32), "lora_ranks": [4, 8], "vocab": 37, "rej": (3, 2),
       "pool_elements": 4096, "qmm": (256, 96), "qmm_rows": [1, 3],
       "model": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300}, "tokens": 4}
TOL = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 3e-2}


class Check:
    """What every step shares: the shapes, the device, a timer and the copy bandwidth."""

    def __init__(self, shapes: dict, dry: bool):
        import torch

        self.torch = torch
        self.s = shapes
        self.dry = dry
        self.dev = torch.device(shapes["device"])
        self.gen = torch.Generator(device=self.dev).manual_seed(0)
        self.copy_gbs = self.gbs(2 * (1 << (10 if dry else 30)), self.ms(self._copy(1 << (10 if dry else 30))))

    def dtype(self, name: str):
        return getattr(self.torch, name)

    def ms(self, fn) -> float:
        """Milliseconds per call: triton's do_bench on CUDA, one timed call in a dry run."""
        if not self.dry:
            import triton.testing

            return triton.testing.do_bench(fn)
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    @staticmethod
    def gbs(nbytes: int, ms: float) -> float:
        return nbytes / ms / 1e6

    def _copy(self, n: int):
        x = self.torch.empty(n, dtype=self.torch.uint8, device=self.dev)
        y = self.torch.empty_like(x)
        return lambda: y.copy_(x)

    def randn(self, *shape, dtype, scale=1.0):
        return (self.torch.randn(*shape, device=self.dev, generator=self.gen) * scale).to(dtype)

    def paged(self, seq_lens, kv_heads, head_dim, dtype, extra_blocks=0):
        """Random K/V at shuffled block ids; (k_cache, v_cache, block_tables int32)."""
        torch, bs = self.torch, self.s["block"]
        pages = [(n + bs - 1) // bs for n in seq_lens]
        num_blocks = 1 + sum(pages) + extra_blocks
        k = self.randn(num_blocks, bs, kv_heads, head_dim, dtype=dtype)
        v = self.randn(num_blocks, bs, kv_heads, head_dim, dtype=dtype)
        ids = torch.randperm(num_blocks - 1, device=self.dev, generator=self.gen).int() + 1
        tables = torch.zeros(len(seq_lens), max(pages), dtype=torch.int32, device=self.dev)
        start = 0
        for i, p in enumerate(pages):
            tables[i, :p] = ids[start:start + p]
            start += p
        return k, v, tables

    def i32(self, values):
        return self.torch.tensor(values, dtype=self.torch.int32, device=self.dev)


def err(a, b) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def kernel_tests(c: Check) -> list[dict]:
    args = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", str(HERE.parent / "tests" / "kernels")]
    if c.dry:  # CI runs the whole file anyway; here only that the step itself works
        args += ["-k", "variants"]
    run = subprocess.run(args, capture_output=True, text=True, cwd=tempfile.gettempdir(), timeout=300)
    counts = [line for line in run.stdout.splitlines() if " passed" in line or " failed" in line or " error" in line]
    return [{"name": "pytest tests/kernels", "ok": run.returncode == 0,
             "summary": counts[-1].strip("= ") if counts else f"exit {run.returncode}"}]


def correctness(c: Check) -> list[dict]:
    from pyserve.kernels.extend_attention import extend_attention, extend_attention_ref
    from pyserve.kernels.paged_decode_attention import paged_decode_attention, paged_decode_attention_ref

    s, rows = c.s, []
    configs = [(s["dtypes"][0], d, 4 if not c.dry else 2) for d in s["head_dims"]]
    configs += [(s["dtypes"][0], s["head_dim"], g) for g in s["groups"]]
    configs += [(dt, s["head_dim"], s["groups"][-1]) for dt in s["dtypes"][1:]]
    for dtype_name, head_dim, group in configs:
        dtype = c.dtype(dtype_name)
        kv_heads = 2
        for ctx in s["contexts"]:
            lens = [ctx, max(1, ctx // 2), 1]
            k, v, tables = c.paged(lens, kv_heads, head_dim, dtype)
            q = c.randn(len(lens), kv_heads * group, head_dim, dtype=dtype)
            a = (q, k, v, tables, c.i32(lens), head_dim**-0.5)
            e_dec = err(paged_decode_attention(*a), paged_decode_attention_ref(*a))
            q_lens = [min(ctx, 17), 1, 1]
            qe = c.randn(sum(q_lens), kv_heads * group, head_dim, dtype=dtype)
            starts = c.i32([0, q_lens[0], q_lens[0] + 1, q_lens[0] + 2])
            b = (qe, k, v, tables, starts, c.i32(lens), head_dim**-0.5)
            e_ext = err(extend_attention(*b), extend_attention_ref(*b))
            worst = max(e_dec, e_ext)
            rows.append({"name": f"{dtype_name} d={head_dim} gqa={group} ctx={ctx}", "decode_err": e_dec,
                         "extend_err": e_ext, "ok": worst <= TOL[dtype_name]})
    return rows


def large_kv_pool(c: Check) -> list[dict]:
    """A pool of more than 2**31 elements: a sequence written into its last blocks (offsets past
    int32) through write_kv_cache, then decoded; the reference reads the same blocks."""
    from pyserve.kernels.kv_cache_write import write_kv_cache
    from pyserve.kernels.paged_decode_attention import paged_decode_attention, paged_decode_attention_ref

    torch, s = c.torch, c.s
    dtype = c.dtype(s["dtypes"][0])
    bs, hkv, d = s["block"], 2, s["head_dim"]
    num_blocks = -(-s["pool_elements"] // (bs * hkv * d)) + 1
    k_cache = torch.zeros(num_blocks, bs, hkv, d, dtype=dtype, device=c.dev)
    v_cache = torch.zeros_like(k_cache)
    n = 3 * bs
    blocks = torch.arange(num_blocks - 3, num_blocks, device=c.dev, dtype=torch.int32)
    slots = (blocks.long()[:, None] * bs + torch.arange(bs, device=c.dev)).reshape(-1)
    k, v = c.randn(n, hkv, d, dtype=dtype), c.randn(n, hkv, d, dtype=dtype)
    write_kv_cache(k, v, k_cache, v_cache, slots)
    ok_write = torch.equal(k_cache[num_blocks - 1, bs - 1], k[-1])
    q = c.randn(1, 2 * hkv, d, dtype=dtype)
    a = (q, k_cache, v_cache, blocks[None, :].contiguous(), c.i32([n]), d**-0.5)
    e = err(paged_decode_attention(*a), paged_decode_attention_ref(*a))
    return [{"name": f"pool of {k_cache.numel()} elements", "write_exact": ok_write, "decode_err": e,
             "ok": ok_write and e <= TOL[s["dtypes"][0]]}]


def decode_bandwidth(c: Check) -> list[dict]:
    from pyserve.kernels.paged_decode_attention import DecodeWorkspace, paged_decode_attention

    s, rows = c.s, []
    dtype = c.dtype(s["dtypes"][0])
    ws = DecodeWorkspace()
    for batch in s["bw_batches"]:
        lens = [s["bw_context"]] * batch
        k, v, tables = c.paged(lens, s["kv_heads"], s["head_dim"], dtype)
        q = c.randn(batch, s["q_heads"], s["head_dim"], dtype=dtype)
        fn = partial(paged_decode_attention, q, k, v, tables, c.i32(lens), s["head_dim"]**-0.5, workspace=ws)
        ms = c.ms(fn)
        nbytes = 2 * sum(lens) * s["kv_heads"] * s["head_dim"] * k.element_size()
        gbs = c.gbs(nbytes, ms)
        rows.append({"name": f"decode B={batch} ctx={s['bw_context']}", "ms": ms, "gb_s": gbs,
                     "of_copy": gbs / c.copy_gbs, "ok": True})
    return rows


def extend_rows(c: Check) -> list[dict]:
    import numpy as np

    from pyserve.kernels.extend_attention import extend_attention, extend_tiles
    from pyserve.model.attention import AttentionMetadata, TritonBackend

    torch, s, rows = c.torch, c.s, []
    dtype = c.dtype(s["dtypes"][0])
    hq, hkv, d = s["q_heads"], s["kv_heads"], s["head_dim"]
    batch, q_len, ctx = (64, 5, s["bw_context"]) if not c.dry else (3, 2, s["bw_context"])
    lens = [ctx] * batch
    k, v, tables = c.paged(lens, hkv, d, dtype)
    q = c.randn(batch * q_len, hq, d, dtype=dtype)
    starts = np.arange(0, batch * q_len + 1, q_len, dtype=np.int32)
    tiles = torch.from_numpy(extend_tiles(starts, hq // hkv)).to(c.dev)
    ms = c.ms(partial(extend_attention, q, k, v, tables, torch.from_numpy(starts).to(c.dev), c.i32(lens),
                      d**-0.5, tiles=tiles))
    rows.append({"name": f"verify rows B={batch} q={q_len} ctx={ctx}", "ms": ms,
                 "gb_s": c.gbs(2 * sum(lens) * hkv * d * k.element_size(), ms), "ok": True})
    # A mixed step: prompt chunks and decode rows, routed by the backend.
    chunks, decodes, chunk = (4, 60, 512) if not c.dry else (1, 2, 5)
    q_lens = [chunk] * chunks + [1] * decodes
    lens = [ctx] * len(q_lens)
    k, v, tables = c.paged(lens, hkv, d, dtype)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    bs = s["block"]
    t = tables.cpu().numpy()
    slots = np.concatenate([t[i, np.arange(n - m, n) // bs].astype(np.int64) * bs + np.arange(n - m, n) % bs
                            for i, (n, m) in enumerate(zip(lens, q_lens))])
    meta = AttentionMetadata.build(slots, t, np.array(lens, dtype=np.int32), qsl, c.dev)
    n = int(qsl[-1])
    q, kn, vn = c.randn(n, hq, d, dtype=dtype), c.randn(n, hkv, d, dtype=dtype), c.randn(n, hkv, d, dtype=dtype)
    backend = TritonBackend()
    ms = c.ms(lambda: backend.forward(q, kn, vn, k, v, meta, d**-0.5))
    rows.append({"name": f"mixed step {chunks}x{chunk} + {decodes} decodes ctx={ctx}", "ms": ms, "ok": True})
    return rows


def prefill(c: Check) -> list[dict]:
    from pyserve.kernels.extend_attention import extend_attention

    torch, s = c.torch, c.s
    dtype = c.dtype(s["dtypes"][0])
    batch, n = s["prefill"]
    hq, hkv, d = s["q_heads"], s["kv_heads"], s["head_dim"]
    k, v, tables = c.paged([n] * batch, hkv, d, dtype)
    q = c.randn(batch * n, hq, d, dtype=dtype)
    starts = c.i32(list(range(0, batch * n + 1, n)))
    ms = c.ms(partial(extend_attention, q, k, v, tables, starts, c.i32([n] * batch), d**-0.5))
    qd, kd, vd = (c.randn(batch, h, n, d, dtype=dtype) for h in (hq, hkv, hkv))
    sdpa = partial(torch.nn.functional.scaled_dot_product_attention, qd, kd, vd, is_causal=True, enable_gqa=True)
    ms_sdpa = c.ms(sdpa)
    flops = 4 * batch * hq * d * n * (n + 1) / 2
    return [{"name": f"prefill B={batch} L={n}", "ms": ms, "tflop_s": flops / ms / 1e9,
             "sdpa_tflop_s": flops / ms_sdpa / 1e9, "vs_sdpa": ms_sdpa / ms, "ok": True}]


def lora(c: Check) -> list[dict]:
    from pyserve.kernels.lora import add_lora, add_lora_ref

    torch, s, rows = c.torch, c.s, []
    dtype = c.dtype(s["dtypes"][0])
    tokens, dim = s["lora"]
    slots = 4
    for rank in s["lora_ranks"]:
        x = c.randn(tokens, dim, dtype=dtype)
        la = c.randn(slots, rank, dim, dtype=dtype, scale=0.05)
        lb = c.randn(slots, dim, rank, dtype=dtype, scale=0.05)
        scaling = torch.full((slots,), 2.0, device=c.dev)
        token_slots = torch.arange(tokens, device=c.dev) % (slots + 1) - 1  # -1: base model rows too
        y = c.randn(tokens, dim, dtype=dtype)
        e = err(add_lora(y.clone(), x, la, lb, scaling, token_slots), add_lora_ref(y.clone(), x, la, lb, scaling,
                                                                                   token_slots))
        ms = c.ms(partial(add_lora, y.clone(), x, la, lb, scaling, token_slots))
        rows.append({"name": f"lora T={tokens} r={rank} {dim}->{dim}", "ms": ms, "err": e,
                     "ok": e <= 10 * TOL[s["dtypes"][0]]})
    return rows


def quantized_matmul(c: Check) -> list[dict]:
    from pyserve.kernels.quantized_matmul import w4a16_matmul, w4a16_ref, w8a16_matmul, w8a16_ref
    from pyserve.model.quantized_linear import quantize_fp8, quantize_int4, quantize_int8

    torch, s, rows = c.torch, c.s, []
    dtype_name = s["dtypes"][0]
    dtype = c.dtype(dtype_name)
    k, n = s["qmm"]
    w = c.randn(n, k, dtype=torch.float32, scale=0.02)
    q8, s8 = quantize_int8(w)
    f8, sf8 = quantize_fp8(w)
    packed, s4, o4 = quantize_int4(w, 128)
    dense = w.to(dtype)
    for m in s["qmm_rows"]:
        x = c.randn(m, k, dtype=dtype)
        ms_dense = c.ms(partial(torch.nn.functional.linear, x, dense))
        for name, fn, ref, nbytes in [
            ("W8A16", partial(w8a16_matmul, x, q8, s8), partial(w8a16_ref, x, q8, s8), q8.numel() + 4 * n),
            ("W8A16 fp8", partial(w8a16_matmul, x, f8, sf8), partial(w8a16_ref, x, f8, sf8), f8.numel() + 4 * n),
            ("W4A16 g128", partial(w4a16_matmul, x, packed, s4, o4, 128), partial(w4a16_ref, x, packed, s4, o4, 128),
             packed.numel() + 8 * s4.numel()),
        ]:
            got, want = fn(), ref()
            e = err(got, want) / max(float(want.float().abs().max()), 1e-6)
            ms = c.ms(fn)
            rows.append({"name": f"{name} M={m} {k}->{n}", "ms": ms, "rel_err": e,
                         "weight_gb_s": c.gbs(nbytes, ms), "of_copy_bw": c.gbs(nbytes, ms) / c.copy_gbs,
                         f"vs_{dtype_name}_matmul": ms_dense / ms, "ok": e <= 10 * TOL[dtype_name]})
    return rows


def rejection(c: Check) -> list[dict]:
    from pyserve.kernels.rejection_sample import rejection_sample, rejection_sample_ref

    torch, s = c.torch, c.s
    b, k = s["rej"]
    vocab, r = s["vocab"], b * (k + 1)
    p = torch.rand(r, vocab, device=c.dev, generator=c.gen).pow_(8)
    p /= p.sum(1, keepdim=True)
    q = torch.rand(r, vocab, device=c.dev, generator=c.gen)
    q /= q.sum(1, keepdim=True)
    drafts = torch.where(torch.rand(r, device=c.dev, generator=c.gen) < 0.7, p.argmax(1),
                         torch.randint(0, vocab, (r,), device=c.dev, generator=c.gen))
    seeds = torch.randint(0, 2**62, (r,), device=c.dev, generator=c.gen)
    positions = torch.arange(r, device=c.dev)
    coupled = (torch.arange(b, device=c.dev) % 2).int()  # half the requests seeded (coupled)
    cu = torch.arange(0, r + 1, k + 1, dtype=torch.int32, device=c.dev)
    a = (p, q, drafts, seeds, positions, coupled, cu)
    (t1, n1), (t2, n2) = rejection_sample(*a), rejection_sample_ref(*a)
    mismatches = int((t1 != t2).sum()) + int((n1 != n2).sum())
    ms = c.ms(partial(rejection_sample, *a))
    return [{"name": f"rejection B={b} k={k} V={vocab}", "ms": ms, "mismatches": mismatches,
             "gb_s": c.gbs(2 * b * vocab * 4, ms), "ok": mismatches == 0}]


def compile_count(c: Check) -> list[dict]:
    """Warm-up (one split, several, a mixed step), then a sweep of batch sizes and table widths:
    the recorded variant keys, and on CUDA the kernels Triton compiled during the sweep."""
    import numpy as np

    from pyserve.kernels import extend_attention as ext
    from pyserve.kernels import paged_decode_attention as dec
    from pyserve.kernels._launch import recording

    s = c.s
    dtype = c.dtype(s["dtypes"][0])
    hkv, d = s["kv_heads"], s["head_dim"]
    kernels = [dec._decode_stage1_kernel, dec._decode_stage2_kernel, ext._extend_attention_kernel]

    def compiled() -> int:
        if c.dry:
            return 0
        return sum(len(cache[0]) for kern in kernels for cache in kern.device_caches.values())

    ws = dec.DecodeWorkspace()

    def step(batch: int, ctx: int, width: int, num_splits=None, q_len=1):
        lens = [ctx] * batch
        k, v, tables = c.paged(lens, hkv, d, dtype)
        tables = c.torch.nn.functional.pad(tables, (0, max(0, width - tables.shape[1])))
        if q_len == 1:
            q = c.randn(batch, s["q_heads"], d, dtype=dtype)
            dec.paged_decode_attention(q, k, v, tables, c.i32(lens), 0.1, num_splits=num_splits, workspace=ws)
        else:
            q = c.randn(batch * q_len, s["q_heads"], d, dtype=dtype)
            starts = np.arange(0, batch * q_len + 1, q_len, dtype=np.int32)
            ext.extend_attention(q, k, v, tables, c.torch.from_numpy(starts).to(c.dev), c.i32(lens), 0.1,
                                 tiles=c.torch.from_numpy(ext.extend_tiles(starts, s["q_heads"] // hkv)).to(c.dev))

    with recording() as seen:
        step(1, s["bw_context"], 1, num_splits=1)
        step(1, s["bw_context"], 1, num_splits=2)
        step(1, s["bw_context"], 1, q_len=3)
        before = compiled()
        sizes = [1, 2, 3, 5, 8, 13, 16, 31, 64] if not c.dry else [1, 2, 3]
        for i, batch in enumerate(sizes):
            width = (i * 37) % 300 + 1 if not c.dry else i + 1
            ctx = min(width * s["block"], s["bw_context"])
            step(batch, ctx, width)
            step(batch, ctx, width, q_len=1 + i % 4 + 1)
        new = compiled() - before
    counts = {name: len(keys) for name, keys in seen.items()}
    return [{"name": "variants recorded", **counts, "compiled_during_sweep": new,
             "ok": new == 0 and counts.get("_decode_stage1_kernel", 0) <= 2
             and counts.get("_decode_stage2_kernel", 0) <= 1 and counts.get("_extend_attention_kernel", 0) <= 1}]


def launch_host_time(c: Check) -> list[dict]:
    from pyserve.kernels.paged_decode_attention import DecodeWorkspace, paged_decode_attention

    s = c.s
    dtype = c.dtype(s["dtypes"][0])
    k, v, tables = c.paged([s["block"] * 4], s["kv_heads"], s["head_dim"], dtype)
    q = c.randn(1, s["q_heads"], s["head_dim"], dtype=dtype)
    ws, lens = DecodeWorkspace(), c.i32([s["block"] * 4])
    call = partial(paged_decode_attention, q, k, v, tables, lens, 0.1, workspace=ws)
    call()
    n = 200 if not c.dry else 2
    start = time.perf_counter()
    for _ in range(n):
        call()
    host_us = (time.perf_counter() - start) / n * 1e6
    if not c.dry:
        c.torch.cuda.synchronize()
    return [{"name": "decode attention, batch 1", "host_us_per_call": host_us, "ok": True}]


def cuda_graph(c: Check) -> list[dict]:
    import numpy as np

    from pyserve.model.attention import AttentionMetadata, TritonBackend

    if c.dry:
        return [{"name": "capture and replay", "ok": True, "skipped": "needs CUDA"}]
    torch, s = c.torch, c.s
    dtype = c.dtype(s["dtypes"][0])
    batch, ctx, bs = 8, s["bw_context"], s["block"]
    hq, hkv, d = s["q_heads"], s["kv_heads"], s["head_dim"]
    lens = [ctx] * batch
    k_cache, v_cache, tables = c.paged(lens, hkv, d, dtype)
    t = tables.cpu().numpy()
    slots = np.array([t[i, (n - 1) // bs] * bs + (n - 1) % bs for i, n in enumerate(lens)], dtype=np.int64)
    meta = AttentionMetadata.build(slots, t, np.array(lens, dtype=np.int32), np.arange(batch + 1, dtype=np.int32),
                                   c.dev)
    q, k, v = c.randn(batch, hq, d, dtype=dtype), c.randn(batch, hkv, d, dtype=dtype), c.randn(batch, hkv, d, dtype=dtype)
    backend = TritonBackend()
    eager = backend.forward(q, k, v, k_cache, v_cache, meta, d**-0.5)  # also compiles every kernel it needs
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = backend.forward(q, k, v, k_cache, v_cache, meta, d**-0.5)
    graph.replay()
    torch.cuda.synchronize()
    e = err(captured, eager)
    ms_eager = c.ms(lambda: backend.forward(q, k, v, k_cache, v_cache, meta, d**-0.5))
    ms_graph = c.ms(graph.replay)
    return [{"name": f"decode layer B={batch} ctx={ctx}", "err": e, "eager_ms": ms_eager, "graph_ms": ms_graph,
             "ok": e <= TOL[s["dtypes"][0]]}]


def batch1_decode(c: Check) -> list[dict]:
    """Replayed CUDA graphs (the default) and op-by-op decode (enforce_eager), the same tokens."""
    from pyserve import LLM, SamplingParams
    from pyserve.testing import build_model

    s = c.s
    params = SamplingParams(temperature=0.0, max_tokens=s["tokens"], ignore_eos=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        overrides = dict(s["model"], torch_dtype=s["dtypes"][0] if not c.dry else "float32")
        model_dir = build_model(Path(tmp) / "m", "llama", **overrides)
        for mode, eager in (("CUDA graphs", False), ("eager", True)):
            llm = LLM(str(model_dir), device=s["device"], attention_backend="triton", num_kv_blocks=64,
                      enable_prefix_caching=False, enforce_eager=eager)
            llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)  # warm-up: compiles and captures
            start = time.perf_counter()
            out = llm.generate([[9, 10, 11, 12]], params, use_tqdm=False)
            seconds = time.perf_counter() - start
            worker = llm.engine.worker
            nbytes = sum(p.numel() * p.element_size() for p in worker.model.parameters())
            graphs = worker.decode_graphs
            llm.close()
            tokens = out[0].outputs[0].token_ids
            tok_s = len(tokens) / seconds
            roofline = c.copy_gbs * 1e9 / 2 / nbytes  # copy bandwidth counts a read and a write
            rows.append({"name": f"batch-1 decode, {nbytes / 1e6:.0f} MB of weights ({mode})", "tok_s": tok_s,
                         "roofline_tok_s": roofline, "of_roofline": tok_s / roofline, "tokens": tokens,
                         "graphs": None if graphs is None else len(graphs.graphs),
                         "graphs_failed": None if graphs is None or graphs.failed is None else repr(graphs.failed),
                         "ok": True})
    graphed, eager = rows
    graphed["same_tokens_as_eager"] = graphed["tokens"] == eager["tokens"]
    graphed["speedup_vs_eager"] = graphed["tok_s"] / eager["tok_s"]
    graphed["ok"] = graphed["same_tokens_as_eager"] and (c.dry or (graphed["graphs"] and not graphed["graphs_failed"]))
    for row in rows:
        del row["tokens"]
    return rows


def speculative_graphs(c: Check) -> list[dict]:
    """Draft-model speculation with the target as its own draft (every guess is right at
    temperature 0), the draft's one-token steps on CUDA graphs and op by op: the same tokens,
    greedy and seeded-sampled, and the tok/s of each."""
    from pyserve import LLM, SamplingParams
    from pyserve.testing import build_model

    s = c.s
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        overrides = dict(s["model"], torch_dtype=s["dtypes"][0] if not c.dry else "float32")
        model_dir = build_model(Path(tmp) / "m", "llama", **overrides)
        spec = {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 4, "adaptive": False}
        outputs = {}
        for mode, eager in (("CUDA graphs", False), ("eager", True)):
            llm = LLM(str(model_dir), device=s["device"], attention_backend="triton", num_kv_blocks=64,
                      enable_prefix_caching=False, enforce_eager=eager, speculative_config=spec)
            runs = []
            for params in (SamplingParams(temperature=0.0, max_tokens=s["tokens"], ignore_eos=True),
                           SamplingParams(temperature=0.8, seed=7, max_tokens=s["tokens"], ignore_eos=True)):
                llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)  # warm-up: compiles and captures
                start = time.perf_counter()
                out = llm.generate([[9, 10, 11, 12]], params, use_tqdm=False)[0].outputs[0].token_ids
                runs.append((out, len(out) / (time.perf_counter() - start)))
            stats = llm.stats()
            graphs = llm.engine.worker.proposer.decode_graphs
            llm.close()
            outputs[mode] = runs
            rows.append({"name": f"draft = target, batch 1 ({mode})", "greedy_tok_s": runs[0][1],
                         "sampled_tok_s": runs[1][1],
                         "accepted_per_draft": stats.get("spec_decode_num_accepted_tokens", 0)
                         / max(stats.get("spec_decode_num_draft_tokens", 0), 1),
                         "draft_graphs": None if graphs is None else len(graphs.graphs), "ok": True})
    same = [a[0] == b[0] for a, b in zip(outputs["CUDA graphs"], outputs["eager"])]
    rows[0]["same_tokens_as_eager"] = all(same)
    rows[0]["ok"] = all(same) and (c.dry or bool(rows[0]["draft_graphs"]))
    return rows


def eagle_trees(c: Check) -> list[dict]:
    """Tree masks in the decode kernel against the reference, their cost against unmasked rows,
    and an EAGLE engine verifying trees: the same greedy tokens as plain decoding."""
    import numpy as np

    from pyserve import LLM, SamplingParams
    from pyserve.default_model import TARGET_DIR
    from pyserve.kernels.paged_decode_attention import (DecodeWorkspace, paged_decode_attention,
                                                        paged_decode_attention_ref)
    from pyserve.model.attention import tree_masks

    torch, s = c.torch, c.s
    dtype = c.dtype(s["dtypes"][0])
    requests, rows_per = (3, 5) if c.dry else (64, 16)
    context = s["bw_context"]
    parents = np.array([-1, 0, 0, 1, 2, 1, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12][:rows_per], dtype=np.int32)
    qsl = np.arange(requests + 1, dtype=np.int32) * rows_per
    masks = torch.from_numpy(tree_masks(np.tile(parents, requests), qsl)[0].view(np.int64)).to(c.dev)
    lens = [context - rows_per + 1 + j for _ in range(requests) for j in range(rows_per)]
    k, v, tables = c.paged([context] * requests, s["kv_heads"], s["head_dim"], dtype)
    tables = tables.repeat_interleave(rows_per, 0)
    q = c.randn(len(lens), s["q_heads"], s["head_dim"], dtype=dtype)
    args = (q, k, v, tables, c.i32(lens), s["head_dim"]**-0.5)
    ws = DecodeWorkspace()
    got = paged_decode_attention(*args, workspace=ws, masks=masks)
    want = paged_decode_attention_ref(*args, masks=masks)
    e = err(got, want)
    masked = c.ms(partial(paged_decode_attention, *args, workspace=ws, masks=masks))
    plain = c.ms(partial(paged_decode_attention, *args, workspace=ws))
    rows = [{"name": f"tree rows {requests}x{rows_per} ctx={context}", "max_err": e, "ms": masked,
             "of_unmasked": masked / plain, "ok": e <= TOL[s["dtypes"][0]]}]
    greedy = SamplingParams(temperature=0.0, max_tokens=s["tokens"] * 8, ignore_eos=True)
    prompts = ["def parse(text):\n", "class Stack:\n    def push(self, x):\n"]
    tokens, rates = {}, {}
    for name, spec in (("plain", None), ("eagle trees", {"method": "eagle3", "num_speculative_tokens": 4,
                                                        "adaptive": False, "tree_nodes": 16})):
        llm = LLM(str(TARGET_DIR), device=s["device"], attention_backend="triton", num_kv_blocks=256,
                  speculative_config=spec)
        llm.generate(prompts, greedy, use_tqdm=False)  # warm-up: compiles
        start = time.perf_counter()
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        rates[name] = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)
        tokens[name] = [o.outputs[0].token_ids for o in outs]
        stats = llm.stats()
        llm.close()
    same = tokens["plain"] == tokens["eagle trees"]
    rows.append({"name": "embedded target + head, trees, batch 2", "same_tokens_as_plain": same,
                 "tok_s": rates["eagle trees"], "plain_tok_s": rates["plain"],
                 "trees": stats["spec_decode_num_trees"],
                 "acceptance_length": stats["spec_decode_mean_acceptance_length"], "ok": same})
    return rows


STEPS = [kernel_tests, correctness, large_kv_pool, decode_bandwidth, extend_rows, prefill, lora, quantized_matmul,
         rejection, compile_count, launch_host_time, cuda_graph, batch1_decode, speculative_graphs, eagle_trees]


def markdown(report: dict) -> str:
    lines = [f"# gpu_check ({report['device']}{', dry run' if report['dry_run'] else ''})", "",
             f"copy bandwidth {report['copy_gb_s']:.4g} GB/s", "", "| step | case | ok | figures |", "|---|---|---|---|"]
    for step in report["steps"]:
        for r in step["rows"]:
            figures = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                for k, v in r.items() if k not in ("name", "ok"))
            lines.append(f"| {step['step']} ({step['seconds']:.1f} s) | {r['name']} | {'yes' if r['ok'] else 'NO'} "
                         f"| {figures} |")
    return "\n".join(lines) + "\n"


def write(out: Path, report: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "gpu_check.md").write_text(markdown(report))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU under the Triton interpreter")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or HERE / "results" / "gpu_check"))
    ap.add_argument("--steps", help="comma-separated subset of the steps")
    args = ap.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check needs a CUDA device (or --dry-run)", file=sys.stderr)
        return 2
    c = Check(DRY if args.dry_run else FULL, args.dry_run)
    device = torch.cuda.get_device_name() if c.dev.type == "cuda" else "cpu (interpreter)"
    steps: list[dict] = []
    report = {"device": device, "dry_run": args.dry_run, "copy_gb_s": c.copy_gbs, "steps": steps}
    wanted = set(args.steps.split(",")) if args.steps else None
    for fn in STEPS:
        if wanted is not None and fn.__name__ not in wanted:
            continue
        start = time.perf_counter()
        try:
            rows = fn(c)
        except Exception:  # noqa: BLE001 - recorded; the other steps still run
            rows = [{"name": "error", "ok": False, "traceback": traceback.format_exc(limit=3)}]
        steps.append({"step": fn.__name__, "seconds": time.perf_counter() - start, "rows": rows})
        print(f"{fn.__name__}: {'ok' if all(r['ok'] for r in rows) else 'FAILED'} "
              f"({steps[-1]['seconds']:.1f} s)", flush=True)
        write(args.out, report)  # after every step: a window cut short keeps what ran
    print(markdown(report))
    return 0 if all(r["ok"] for st in steps for r in st["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
