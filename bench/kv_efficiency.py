"""KV memory efficiency of the paged allocator under a mixed workload, scheduler only (no model:
a fake one samples random tokens, so the figure is the allocator's alone).

300 requests (prompts 20-1500 tokens, outputs 10-400) stream into a Scheduler with 64 sequences
at most and a pool that preemption must manage (block_size 16). After every schedule() it counts
the tokens the running sequences hold in KV (their computed tokens) against the slots of the
blocks referenced (blocks x block_size): waste = 1 - held / allocated, at the step with the most
blocks in use (the peak) and averaged over steps. Prompts share no prefix, so no block is counted
for two sequences. Goal: under 4% at the peak. Writes bench/results/kv_efficiency.json.
"""

from __future__ import annotations

import random
import statistics

import numpy as np

import harness
from pyserve import _core


def main() -> None:
    ap = harness.parser(__doc__, "kv_efficiency")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=3000)
    args = ap.parse_args()
    head = harness.header(__file__)
    harness.print_header(head)
    rng = random.Random(0)
    bs = args.block_size
    sched = _core.Scheduler(num_blocks=args.num_blocks, block_size=bs, max_num_seqs=64,
                            max_num_batched_tokens=2048, max_model_len=2048)
    for i in range(args.requests):
        prompt = [rng.randrange(10, 30000) for _ in range(rng.randint(20, 1500))]
        sched.add_request(i, prompt, max_tokens=rng.randint(10, 400), ignore_eos=True)
    samples = []  # (blocks in use, tokens held)
    while sched.has_unfinished_requests():
        out = sched.schedule()
        ids = out.req_ids.tolist()
        blocks = round(sched.stats()["kv_cache_usage_perc"] * (args.num_blocks - 1))  # referenced blocks (block 0 is null)
        held = sum(sched.request_state(rid)["num_computed_tokens"] for rid in ids)
        if ids:
            samples.append((blocks, held))
        n = out.num_logits
        sched.update(np.array([rng.randrange(10, 30000) for _ in range(int(n.sum()))], dtype=np.int64), n)
    peak_blocks, peak_held = max(samples)
    waste = [1 - held / (blocks * bs) for blocks, held in samples if blocks]
    report = {**head, "requests": args.requests, "block_size": bs, "num_blocks": args.num_blocks,
              "steps": len(samples),
              "preemptions": sched.stats()["num_preemptions"], "peak_blocks": peak_blocks, "peak_tokens": peak_held,
              "peak_waste": round(1 - peak_held / (peak_blocks * bs), 4), "mean_waste": round(statistics.fmean(waste), 4)}
    harness.write_report(args.out, report)
    print(f"peak: {peak_held} tokens in {peak_blocks} blocks of {bs} = {100 * report['peak_waste']:.2f}% waste "
          f"(goal < 4%); mean over {len(samples)} steps {100 * report['mean_waste']:.2f}%; "
          f"{report['preemptions']} preemptions")


if __name__ == "__main__":
    main()
