"""Triton kernels on a CUDA device (paged KV cache, speculative rejection sampling, batched LoRA):
correctness against the torch references, then time.

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


def speculative_and_lora_rows(do_bench, gen, copy_gbs, elt):
    """Rejection sampling (B=64 requests, 4 drafts each, a 128k vocabulary; error = tokens that
    differ from the reference) and batched LoRA (64 tokens over 8 rank-16 slots, 4096 -> 4096;
    bytes = each token's A and B rows, an upper bound)."""
    from pyserve.kernels.lora import add_lora, add_lora_ref
    from pyserve.kernels.rejection_sample import rejection_sample, rejection_sample_ref

    rows = []
    b, k, vocab = 64, 4, 128256
    r = b * (k + 1)
    p = torch.rand(r, vocab, device="cuda", generator=gen).pow_(8)
    p /= p.sum(1, keepdim=True)
    q = torch.rand(r, vocab, device="cuda", generator=gen)
    q /= q.sum(1, keepdim=True)
    drafts = torch.where(torch.rand(r, device="cuda", generator=gen) < 0.7, p.argmax(1),
                         torch.randint(0, vocab, (r,), device="cuda", generator=gen))
    u = torch.rand(r, device="cuda", generator=gen)
    noise = torch.empty(r, vocab, device="cuda").exponential_(generator=gen).clamp_min_(1e-30)
    cu = torch.arange(0, r + 1, k + 1, dtype=torch.int32, device="cuda")
    a = (p, q, drafts, u, noise, cu)
    (t1, n1), (t2, n2) = rejection_sample(*a), rejection_sample_ref(*a)
    err = int((t1 != t2).sum()) + int((n1 != n2).sum())
    ms = do_bench(partial(rejection_sample, *a))
    nbytes = 3 * b * vocab * 4  # p, q and noise of each request's final row
    rows.append(row("rejection_sample", f"B={b} k={k} V={vocab}", ms, nbytes, err, copy_gbs))

    t, slots, rank, dim = 64, 8, 16, 4096
    x = torch.randn(t, dim, device="cuda", dtype=DTYPE, generator=gen)
    la = torch.randn(slots, rank, dim, device="cuda", dtype=DTYPE, generator=gen) * 0.05
    lb = torch.randn(slots, dim, rank, device="cuda", dtype=DTYPE, generator=gen) * 0.05
    scaling = torch.full((slots,), 2.0, device="cuda")
    token_slots = torch.arange(t, device="cuda") % slots
    y = torch.randn(t, dim, device="cuda", dtype=DTYPE, generator=gen)
    err = (add_lora(y.clone(), x, la, lb, scaling, token_slots).float()
           - add_lora_ref(y.clone(), x, la, lb, scaling, token_slots).float()).abs().max().item()
    ms = do_bench(partial(add_lora, y.clone(), x, la, lb, scaling, token_slots))
    nbytes = t * rank * 2 * dim * elt + 3 * t * dim * elt
    rows.append(row("lora_shrink_expand", f"T={t} S={slots} r={rank} {dim}->{dim}", ms, nbytes, err, copy_gbs))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one context length per kernel")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/kernels.py needs a CUDA device: the Triton kernels are timed natively "
                 "(the CPU interpreter is for tests only). No CUDA device found.")

    import triton.testing

    from pyserve.kernels.extend_attention import extend_attention, extend_attention_ref, extend_tiles
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
        tiles = torch.from_numpy(extend_tiles(starts.cpu().numpy())).cuda()
        err = (extend_attention(*a, tiles=tiles).float()
               - extend_attention_ref(*a).float()).abs().max()
        ms = do_bench(partial(extend_attention, *a, tiles=tiles))
        nbytes = (2 * sum(seq_lens) * HKV * D + 2 * q.numel()) * elt
        visible = sum(q_len * (n - q_len) + q_len * (q_len + 1) // 2 for n in seq_lens)
        flops = 4 * visible * HQ * D
        rows.append(row("extend_attention", f"B={batch} q={q_len} ctx={ctx}", ms, nbytes,
                        err.item(), copy_gbs, flops))

    rows += speculative_and_lora_rows(do_bench, gen, copy_gbs, elt)

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
