"""Scheduler step latency: pyserve._core.Scheduler (Rust) against the plain-Python baseline.

Measures `out = sched.schedule(); sched.update(tokens, counts)` per step, flat numpy arrays
included, with N requests all in decode (128-token prompts, nothing finishes). Targets: at most
50 us per step at N=256 and 200 us at N=1024 for Rust, and Rust at least 10x faster than the
Python baseline (bench/python_scheduler.py) measured in the same process.

Usage: python bench/scheduler.py [--quick] [--out PATH]
(run it from a directory where a local pyserve/ source folder does not shadow the installed
package; from the repository root `python bench/scheduler.py` is fine.)
"""

import gc
import os
import time

import numpy as np

import harness
from pyserve._core import Scheduler
from python_scheduler import PyScheduler

SIZES = (256, 1024)
TARGET_US = {256: 50.0, 1024: 200.0}
MIN_RATIO = 10.0
PROMPT_LEN = 128
BLOCK_SIZE = 16
MAX_BATCHED = 8192
MAX_MODEL_LEN = 8192
FIELDS = ("req_ids", "num_scheduled_tokens", "num_logits", "logits_indices", "query_start_loc",
          "seq_lens", "input_ids", "positions", "slot_mapping", "block_tables",
          "preempted_req_ids", "finished_req_ids")


def make_pair(**config):
    return Scheduler(**config), PyScheduler(**config)


def sample_tokens(out, step):
    """One deterministic token per sampled position (num_logits is 0 or 1 without drafts)."""
    counts = np.asarray(out.num_logits, dtype=np.int64)
    ids = np.asarray(out.req_ids, dtype=np.int64)[counts > 0]
    return (ids * 31 + step * 7) % 50 + 1, counts


def assert_same(a, b, where):
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype, f"{where}: {name} dtype {x.dtype} vs {y.dtype}"
        assert x.shape == y.shape and np.array_equal(x, y), f"{where}: {name}\nrust {x}\npython {y}"


def check_equivalence(case, requests, max_steps, **config):
    """Runs both schedulers in lockstep and asserts identical outputs at every step."""
    rust, py = make_pair(**config)
    for rid, prompt, max_tokens in requests:
        rust.add_request(rid, prompt, max_tokens=max_tokens)
        py.add_request(rid, prompt, max_tokens=max_tokens)
    steps = preemptions = decode_steps = 0
    while rust.has_unfinished_requests() and steps < max_steps:
        a, b = rust.schedule(), py.schedule()
        assert_same(a, b, f"{case} step {steps}")
        preemptions += len(a.preempted_req_ids)
        decode_steps += bool(len(a)) and bool(np.all(a.num_scheduled_tokens == 1))
        tokens, counts = sample_tokens(a, steps)
        done_r = rust.update(tokens, counts).finished_req_ids
        done_p = py.update(tokens, counts)
        assert sorted(done_r.tolist()) == sorted(done_p), f"{case} step {steps}: finished differ"
        assert py.has_unfinished_requests() == rust.has_unfinished_requests()
        rust.check_invariants()
        steps += 1
    hits = rust.stats()["prefix_cache_hits"]
    return {"steps": steps, "decode_steps": decode_steps, "preemptions": preemptions, "prefix_cache_hits": hits}


def run_checks():
    rng = np.random.default_rng(0)
    # Like the benchmark, small: chunked prefill, then decode steps crossing block boundaries.
    reqs = [(i, rng.integers(0, 32000, PROMPT_LEN).tolist(), 4000) for i in range(16)]
    s1 = check_equivalence("decode", reqs, 60, num_blocks=1000, block_size=BLOCK_SIZE,
                           max_num_batched_tokens=512, max_num_seqs=16, max_model_len=MAX_MODEL_LEN)
    # Tight pool: shared prefixes (cache hits), preemption by recompute, requests finishing.
    shared = rng.integers(0, 32000, 40).tolist()
    reqs = [(100 + i, shared[: rng.integers(1, 41)] + rng.integers(0, 32000, rng.integers(1, 30)).tolist(),
             int(rng.integers(1, 40))) for i in range(24)]
    s2 = check_equivalence("pressure", reqs, 2000, num_blocks=24, block_size=BLOCK_SIZE,
                           max_num_batched_tokens=64, max_num_seqs=8, max_model_len=256)
    assert s1["decode_steps"] >= 20 and s2["preemptions"] > 0 and s2["prefix_cache_hits"] > 0, (s1, s2)
    return {"decode": s1, "pressure": s2}


def decode_ready(sched, n):
    """Adds n requests with distinct 128-token prompts and steps until all are in decode."""
    rng = np.random.default_rng(n)
    prompts = rng.integers(0, 32000, (n, PROMPT_LEN), dtype=np.int64)
    for i in range(n):
        sched.add_request(i, prompts[i])
    sampled = set()
    while len(sampled) < n:
        out = sched.schedule()
        counts = np.asarray(out.num_logits, dtype=np.int64)
        sched.update(np.full(int(counts.sum()), 5, dtype=np.int64), counts)
        sampled.update(np.asarray(out.req_ids)[counts > 0].tolist())
    return sched


def time_steps(cls, n, steps, num_blocks):
    """Microseconds per decode step over `steps` steps of a fresh scheduler at n requests."""
    sched = decode_ready(cls(num_blocks=num_blocks, block_size=BLOCK_SIZE, max_num_batched_tokens=MAX_BATCHED,
                             max_num_seqs=n, max_model_len=MAX_MODEL_LEN), n)
    tokens = np.full(n, 5, dtype=np.int64)
    counts = np.ones(n, dtype=np.int64)
    gc.collect()
    t0 = time.perf_counter_ns()
    for _ in range(steps):
        out = sched.schedule()
        sched.update(tokens, counts)
    elapsed = time.perf_counter_ns() - t0
    assert len(out) == n and out.total_num_tokens == n and len(out.preempted_req_ids) == 0
    return elapsed / steps / 1000


def main():
    ap = harness.parser(__doc__, "scheduler")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions and steps")
    args = ap.parse_args()
    head = harness.header(__file__)
    harness.print_header(head)
    # Requests decode in lockstep, so all cross a block boundary in the same step: runs cover
    # whole multiples of block_size steps to weigh those steps fairly.
    repeats, rust_steps, py_steps = (3, 96, 16) if args.quick else (7, 192, 48)
    start = time.perf_counter()
    load_at_start = os.getloadavg() if hasattr(os, "getloadavg") else None

    checks = run_checks()
    print(f"equivalence check passed (identical outputs at every step): {checks}")

    results = []
    for n in SIZES:
        num_blocks = max(100_000, n * -(-(PROMPT_LEN + rust_steps + 64) // BLOCK_SIZE) + 1)
        time_steps(Scheduler, n, 10, num_blocks)  # warm-up
        us = harness.interleaved({"rust": lambda: time_steps(Scheduler, n, rust_steps, num_blocks),
                                  "python": lambda: time_steps(PyScheduler, n, py_steps, num_blocks)}, repeats)
        rust_us, py_us = us["rust"], us["python"]
        r, p = harness.median(rust_us), harness.median(py_us)
        results.append({
            "num_requests": n, "num_blocks": num_blocks,
            "rust_us_per_step": r, "python_us_per_step": p, "ratio_python_over_rust": p / r,
            "rust_runs_us": rust_us, "python_runs_us": py_us,
            "rust_steps_per_run": rust_steps, "python_steps_per_run": py_steps,
            "target_us": TARGET_US[n], "min_ratio": MIN_RATIO,
            "pass_latency": r <= TARGET_US[n], "pass_ratio": p / r >= MIN_RATIO,
        })

    print(f"\n{'N':>6} {'rust us/step':>13} {'python us/step':>15} {'python/rust':>12}  "
          f"{'latency target':>15} {'ratio >= 10':>12}")
    for row in results:
        lat = f"{'PASS' if row['pass_latency'] else 'FAIL'} (<= {row['target_us']:.0f})"
        print(f"{row['num_requests']:>6} {row['rust_us_per_step']:>13.1f} {row['python_us_per_step']:>15.1f} "
              f"{row['ratio_python_over_rust']:>11.1f}x  {lat:>15} {'PASS' if row['pass_ratio'] else 'FAIL':>12}")
    all_pass = all(row["pass_latency"] and row["pass_ratio"] for row in results)
    elapsed = time.perf_counter() - start
    print(f"\nall targets met: {all_pass}  (median of {repeats} runs; {elapsed:.1f} s)")

    report = {
        "benchmark": "scheduler", **head, "numpy": np.__version__, "load_average_at_start": load_at_start,
        "config": {"block_size": BLOCK_SIZE, "max_num_batched_tokens": MAX_BATCHED, "prompt_len": PROMPT_LEN,
                   "max_model_len": MAX_MODEL_LEN, "enable_prefix_caching": True, "repeats": repeats,
                   "quick": args.quick, "statistic": "median us per step"},
        "equivalence_checks": checks,
        "results": results,
        "all_pass": all_pass,
    }
    harness.write_report(args.out, report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
