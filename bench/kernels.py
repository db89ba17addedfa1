"""Paged KV cache kernels on a CUDA device: correctness against the torch references, then time.

For each kernel and shape: max |triton - ref|, milliseconds (triton.testing.do_bench), achieved
bandwidth (unique bytes of KV read or written + q/out) and its fraction of the device copy bandwidth
(a large torch copy, read + write, timed the same way); extend also reports TFLOP/s. Shapes are
Llama-3-8B-like: 32 q heads, 8 kv heads, head_dim 128, block_size 16, bf16.

Usage: python bench/kernels.py [--quick] [--out PATH]   (needs CUDA; exits with a message otherwise)
"""

import argparse
import json
import sys
from functools import partial

import torch

HQ, HKV, D, BS, DTYPE = 32, 8, 128, 16, torch.bfloat16
MAX_ERR = 3e-2  # bf16 outputs of magnitude < 1: a few bf16 ulps


def paged_cache(seq_lens, gen):
    """Random K/V cache with shuffled block ids; returns k_cache, v_cache, block_tables (int32)."""
    pages = [(n + BS - 1) // BS for n in seq_lens]
    num_blocks = 1 + sum(pages)
    k = torch.randn(num_blocks, BS, HKV, D, device="cuda", dtype=DTYPE, generator=gen)
    v = torch.randn_like(k)
    ids = torch.randperm(num_blocks - 1, device="cuda", generator=gen).int() + 1
    tables = torch.zeros(len(seq_lens), max(pages), dtype=torch.int32, device="cuda")
    start = 0
    for i, p in enumerate(pages):
        tables[i, :p] = ids[start:start + p]
        start += p
    return k, v, tables


def copy_bandwidth_gbs(do_bench):
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x))
    return 2 * x.numel() / ms / 1e6


def row(kernel, shape, ms, nbytes, err, copy_gbs, flops=None):
    gbs = nbytes / ms / 1e6
    r = {"kernel": kernel, "shape": shape, "ms": round(ms, 4), "gb_s": round(gbs, 1),
         "frac_of_copy": round(gbs / copy_gbs, 3), "max_abs_err": float(err)}
    if flops is not None:
        r["tflop_s"] = round(flops / ms / 1e9, 1)
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one context length per kernel")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/kernels.py needs a CUDA device: the Triton kernels are timed natively "
                 "(the CPU interpreter is for tests only). No CUDA device found.")

    import triton.testing

    from pyserve.kernels.extend_attention import extend_attention, extend_attention_ref
    from pyserve.kernels.kv_cache_write import write_kv_cache, write_kv_cache_ref
    from pyserve.kernels.paged_decode_attention import (
        paged_decode_attention,
        paged_decode_attention_ref,
    )

    do_bench = triton.testing.do_bench
    gen = torch.Generator(device="cuda").manual_seed(0)
    elt = torch.finfo(DTYPE).bits // 8
    scale = D**-0.5
    copy_gbs = copy_bandwidth_gbs(do_bench)
    contexts = [4096] if args.quick else [1024, 4096, 8192]
    rows = []

    for num_tokens in ([64] if args.quick else [64, 4096]):
        k_cache, v_cache, _ = paged_cache([num_tokens * 2], gen)
        k = torch.randn(num_tokens, HKV, D, device="cuda", dtype=DTYPE, generator=gen)
        v = torch.randn_like(k)
        free = k_cache.shape[0] * BS - BS  # every slot outside the null block
        slots = torch.randperm(free, device="cuda", generator=gen)[:num_tokens] + BS
        kc, vc = k_cache.clone(), v_cache.clone()
        write_kv_cache(k, v, k_cache, v_cache, slots)
        write_kv_cache_ref(k, v, kc, vc, slots)
        err = max((k_cache - kc).abs().max().item(), (v_cache - vc).abs().max().item())
        ms = do_bench(partial(write_kv_cache, k, v, k_cache, v_cache, slots))
        nbytes = 4 * k.numel() * elt  # read k, v; write them into the caches
        rows.append(row("write_kv_cache", f"T={num_tokens}", ms, nbytes, err, copy_gbs))

    batch = 64
    for ctx in contexts:
        seq_lens = [ctx] * batch
        k_cache, v_cache, tables = paged_cache(seq_lens, gen)
        q = torch.randn(batch, HQ, D, device="cuda", dtype=DTYPE, generator=gen)
        lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
        a = (q, k_cache, v_cache, tables, lens, scale)
        err = (paged_decode_attention(*a).float()
               - paged_decode_attention_ref(*a).float()).abs().max()
        ms = do_bench(partial(paged_decode_attention, *a))
        nbytes = (2 * sum(seq_lens) * HKV * D + 2 * q.numel()) * elt
        rows.append(row("paged_decode_attention", f"B={batch} ctx={ctx}", ms, nbytes, err.item(),
                        copy_gbs))

    batch, q_len = 8, 512
    for ctx in contexts:
        seq_lens = [ctx] * batch
        k_cache, v_cache, tables = paged_cache(seq_lens, gen)
        q = torch.randn(batch * q_len, HQ, D, device="cuda", dtype=DTYPE, generator=gen)
        lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
        starts = torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32, device="cuda")
        a = (q, k_cache, v_cache, tables, starts, lens, scale)
        err = (extend_attention(*a, max_query_len=q_len).float()
               - extend_attention_ref(*a).float()).abs().max()
        ms = do_bench(partial(extend_attention, *a, max_query_len=q_len))
        nbytes = (2 * sum(seq_lens) * HKV * D + 2 * q.numel()) * elt
        visible = sum(q_len * (n - q_len) + q_len * (q_len + 1) // 2 for n in seq_lens)
        flops = 4 * visible * HQ * D
        rows.append(row("extend_attention", f"B={batch} q={q_len} ctx={ctx}", ms, nbytes,
                        err.item(), copy_gbs, flops))

    print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy_gbs:.0f} GB/s, dtype {DTYPE}")
    print(f"{'kernel':24} {'shape':22} {'ms':>9} {'GB/s':>8} {'of copy':>8} {'TFLOP/s':>8} "
          f"{'max err':>9}")
    for r in rows:
        print(f"{r['kernel']:24} {r['shape']:22} {r['ms']:9.4f} {r['gb_s']:8.1f} "
              f"{r['frac_of_copy']:8.3f} {r.get('tflop_s', ''):>8} {r['max_abs_err']:9.2e}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "dtype": str(DTYPE),
                       "copy_gb_s": round(copy_gbs, 1), "rows": rows}, f, indent=2)
    bad = [r for r in rows if not r["max_abs_err"] <= MAX_ERR]
    if bad:
        sys.exit(f"max |triton - ref| above {MAX_ERR}: {[(r['kernel'], r['shape']) for r in bad]}")


if __name__ == "__main__":
    main()
