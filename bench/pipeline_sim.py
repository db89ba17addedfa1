"""Pipeline parallelism on paper: a simulation of decode steps split over N ranks by layers
(pipeline, M micro-batches) against the same N ranks splitting every layer (tensor parallel, as
pyserve does), for a link of given latency and bandwidth. The design is docs/pipeline_parallel.md.

Cost model (per decode step of a batch of b sequences, fp32, one token each):
- a rank computes a share of the model at the roofline: max(weight bytes read / memory
  bandwidth, 2 * parameters * tokens / FLOP rate), plus a fixed cost per layer call (kernel
  launches, Python) measured on this machine;
- tensor parallel: each rank holds 1/N of every layer and the step does two all-reduces per layer
  of b x hidden fp32 values (ring: 2 (N - 1) messages of 1/N of the payload each) plus the step's
  broadcast and the logits all-gather;
- pipeline: each rank holds L/N whole layers; the batch goes through in M micro-batches whose
  hidden states (b/M x hidden fp32) cross the N - 1 stage boundaries; in the decode steady state
  a micro-batch starts its next token when it leaves the last stage, so a sequence's time per
  token is the longer of one micro-batch's trip through the N stages and one stage's work for
  all M micro-batches (pipeline/PP columns).
- `--shared-cores`: the N ranks run on one machine's cores (as here: 2 vCPUs), so memory bandwidth
  and FLOPs are split between them instead of multiplied.

Machine figures default to this machine's, measured with --measure (memory bandwidth by a 1 GB
sum, FLOPs by a 1024^3 matmul, one thread per rank); the link's latency defaults to the gloo
collective time per call measured by bench/tensor_parallel.py on loopback here.
Prints a table per link and writes bench/results/pipeline_sim.json.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import harness

MODELS = {  # the 95M Llama of bench/batch1_decode.py, and a 7B-shaped one (28 GB in fp32: two machines' worth)
    "95m": dict(layers=8, hidden=1024, intermediate=2816, vocab=512),
    "7b": dict(layers=32, hidden=4096, intermediate=11008, vocab=32000),
}
LINKS = {  # name: (seconds per message, bytes per second)
    "loopback gloo (measured here)": (1.8e-3, 3e9),
    "10 GbE": (50e-6, 1.25e9),
    "NVLink-class": (5e-6, 400e9),
}


@dataclass(frozen=True)
class Model:
    layers: int
    hidden: int
    intermediate: int
    vocab: int

    @property
    def layer_params(self) -> int:
        return 4 * self.hidden * self.hidden + 3 * self.hidden * self.intermediate

    @property
    def head_params(self) -> int:
        return self.vocab * self.hidden


@dataclass(frozen=True)
class Machine:
    mem_bw: float  # bytes/s of one device (or the whole shared machine)
    flops: float
    layer_overhead: float  # seconds per layer call regardless of size


def compute(params: float, tokens: int, m: Machine, share: float) -> float:
    """Seconds to run `params` fp32 parameters over `tokens` on `share` of the machine."""
    return max(4 * params / (m.mem_bw * share), 2 * params * tokens / (m.flops * share))


def tensor_parallel_step(model: Model, m: Machine, n: int, b: int, link, shared: bool) -> float:
    share = 1 / n if shared else 1.0
    alpha, beta = link
    per_layer = compute(model.layer_params / n, b, m, share) + 2 * m.layer_overhead
    allreduce = 0.0 if n == 1 else 2 * (n - 1) * (alpha + (4 * b * model.hidden / n) / beta)
    head = compute(model.head_params / n, b, m, share)
    step_comm = 0.0 if n == 1 else 3 * alpha + 4 * b * model.vocab / beta  # inputs broadcast, logits gather
    return model.layers * (per_layer + 2 * allreduce) + head + step_comm


def pipeline_step(model: Model, m: Machine, n: int, b: int, micro: int, link, shared: bool) -> float:
    """Seconds between two tokens of a sequence in the decode steady state: each of `micro`
    micro-batches cycles through the n stages and starts its next token when it leaves the last;
    a stage serves every micro-batch in turn, so the cycle is the longer of one micro-batch's trip
    and one stage's work for all of them."""
    share = 1 / n if shared else 1.0
    alpha, beta = link
    micro = max(1, min(micro, b))
    mb = math.ceil(b / micro)
    stage = (model.layers / n) * (compute(model.layer_params, mb, m, share) + 2 * m.layer_overhead)
    stage += compute(model.head_params / n, mb, m, share)  # the head, on the last stage: spread as its share
    hop = 0.0 if n == 1 else alpha + 4 * mb * model.hidden / beta
    return max(n * (stage + hop), micro * stage)


def measure() -> Machine:
    import time

    import torch

    torch.set_num_threads(1)
    buf = torch.ones(1 << 28)
    buf.sum()
    t = min(_timed(buf.sum, time) for _ in range(5))
    a = torch.randn(1024, 1024)
    f = min(_timed(lambda: a @ a, time) for _ in range(5))
    return Machine(mem_bw=buf.numel() * 4 / t, flops=2 * 1024**3 / f, layer_overhead=60e-6)


def _timed(fn, time) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    ap = harness.parser(__doc__, "pipeline_sim")
    ap.add_argument("--model", choices=sorted(MODELS), nargs="+", default=["95m", "7b"])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--micro-batches", type=int, default=2, help="M (default: as many as ranks)")
    ap.add_argument("--measure", action="store_true", help="measure this machine (one thread) instead of the "
                    "defaults (16 GB/s, 60 GFLOP/s per rank, this machine's single-thread figures)")
    ap.add_argument("--shared-cores", action="store_true", help="the ranks share one machine's bandwidth and cores")
    args = ap.parse_args()
    machine = measure() if args.measure else Machine(mem_bw=16e9, flops=60e9, layer_overhead=60e-6)
    head = harness.header(__file__)
    harness.print_header(head)
    n = args.ranks
    report = {**head, "machine": machine.__dict__, "ranks": n, "micro_batches": args.micro_batches,
              "shared_cores": args.shared_cores, "models": {}}
    for model_name in args.model:
        model = Model(**MODELS[model_name])
        report["models"][model_name] = links = {}
        print(f"\n## {model_name}: {n} ranks, {machine.mem_bw / 1e9:.1f} GB/s and {machine.flops / 1e9:.0f} GFLOP/s "
              f"per rank{' (shared)' if args.shared_cores else ''}; decode tokens/s at batch b")
        for name, link in LINKS.items():
            rows = []
            for b in args.batches:
                one = tensor_parallel_step(model, machine, 1, b, link, False)
                tp = tensor_parallel_step(model, machine, n, b, link, args.shared_cores)
                pp = pipeline_step(model, machine, n, b, args.micro_batches, link, args.shared_cores)
                rows.append({"batch": b, "one_rank_tok_s": b / one, "tp_tok_s": b / tp, "pp_tok_s": b / pp,
                             "one_rank_token_ms": 1000 * one, "tp_token_ms": 1000 * tp,
                             "pp_token_ms": 1000 * pp})
            links[name] = rows
            print(f"\n{name} (latency {link[0] * 1e6:.0f} us, {link[1] / 1e9:.2f} GB/s)")
            print("  batch | 1 rank tok/s | TP tok/s | PP tok/s | token latency ms: 1 rank / TP / PP")
            for r in rows:
                print(f"  {r['batch']:5d} | {r['one_rank_tok_s']:12.1f} | {r['tp_tok_s']:8.1f} | {r['pp_tok_s']:8.1f} | "
                      f"{r['one_rank_token_ms']:.2f} / {r['tp_token_ms']:.2f} / {r['pp_token_ms']:.2f}")
    harness.write_report(args.out, report)


if __name__ == "__main__":
    main()
