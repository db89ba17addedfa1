"""Structured outputs: what a JSON-schema constraint costs, on the embedded model (fp32 CPU unless
--device says otherwise), default settings, prompts and schemas written for the tests and this
bench (pyserve.testing.json_schemas; the model never saw them).

  all32     32 concurrent requests, each constrained by a schema of the corpus (sampled,
            seeded), against the same 32 prompts unconstrained with max_tokens set to each
            constrained output's length and EOS ignored (the same token counts): output tok/s
            ratio (goal >= 0.9x; vLLM measured about 0.68x)
  mixed     16 unconstrained requests (64 tokens each) beside 16 constrained ones, against the
            same 16 beside 16 unconstrained of the constrained ones' lengths: the unconstrained
            half's tok/s, to the moment its last request finished (goal >= 0.97x)
  forced    the tokens a grammar forces verified in one step (the default) against one step per
            token (--no-grammar-forced-tokens), same constrained requests, batch 1 (16 requests
            one at a time) and batch 32 (goal >= 1.1x); outputs checked equal
  compile   grammar compile time of every schema of the corpus with a cold cache, p50 / p99
            (goal p99 <= 50 ms)
  masks     mask time per step (all constrained rows of a step, on the mask thread), p50 / p99

Rounds are interleaved (--runs, after a first "cold" round whose grammars compile in the request
path; "warm" figures are the medians of the later rounds). Writes bench/results/structured_outputs.json.
"""

from __future__ import annotations

import statistics
import time

import harness
from pyserve import LLM, SamplingParams, StructuredOutputsParams
from pyserve.testing.json_schemas import SCHEMAS

# Written for this bench: requests for structured answers, in no corpus the model trained on.
ASKS = [
    "Extract the customer's name and order number from: 'Hi, this is Dana Reyes about order 4471.'",
    "Give the weather for Lisbon tomorrow as a record.",
    "Summarize this ticket: the printer on floor 3 jams on every duplex job.",
    "List three ingredients for a quick tomato soup.",
    "Classify the sentiment of: 'The update fixed my sync issue, finally!'",
    "Return the meeting time and room from: 'Standup moved to 9:45 in Birch.'",
    "Describe the shape: a circle with radius 4.",
    "Parse the version string 'v2.13.4-rc1' into its parts.",
]


def prompts(llm: LLM, n: int) -> list[list[int]]:
    tok = llm.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": ASKS[i % len(ASKS)]}]),
                       add_special_tokens=False) for i in range(n)]


def constrained(i: int, seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=200, temperature=0.8, seed=seed * 1000 + i,
                          structured_outputs=StructuredOutputsParams(json=SCHEMAS[i % len(SCHEMAS)]))


def sized(n: int, seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.8, seed=seed, ignore_eos=True)


def timed(llm: LLM, ps: list[list[int]], params: list[SamplingParams]) -> tuple[float, list[list[int]], list[float]]:
    """(seconds to the last output, each output's tokens, each request's finish time from the start)."""
    engine = llm.engine

    async def run():
        start = time.perf_counter()
        streams = [await engine.add_request(f"b{time.perf_counter_ns()}-{i}", p, sp, streaming=False)
                   for i, (p, sp) in enumerate(zip(ps, params))]
        finish = []
        for s in streams:
            await s.done.wait()
            finish.append(time.perf_counter() - start)
        await engine.wait_idle()
        return streams, finish

    streams, finish = llm._loop.run_until_complete(run())
    return max(finish), [s.output.outputs[0].token_ids for s in streams], finish


def main() -> None:
    ap = harness.parser(__doc__, "structured_outputs", runs=5, device=True)
    args = ap.parse_args()
    head = harness.header(__file__)
    harness.print_header(head)
    llm = LLM(device=args.device)
    noforce = LLM(device=args.device, grammar_forced_tokens=False)
    p32 = prompts(llm, 32)
    rounds: list[dict[str, float]] = []
    for r in range(args.runs + 1):
        row: dict[str, float] = {}
        c_params = [constrained(i, r) for i in range(32)]
        t_c, out_c, _ = timed(llm, p32, c_params)
        lens = [len(o) for o in out_c]
        t_u, _, _ = timed(llm, p32, [sized(n, r * 1000 + i) for i, n in enumerate(lens)])
        row["all32_ratio"] = t_u / t_c
        row["all32_constrained_tok_s"] = sum(lens) / t_c
        t_nf, out_nf, _ = timed(noforce, p32, c_params)
        assert out_nf == out_c, "forced tokens changed an output"
        row["forced32_ratio"] = t_nf / t_c
        # mixed: the first 16 unconstrained (64 tokens), the last 16 constrained or sized alike
        plain16 = [sized(64, r * 1000 + i) for i in range(16)]
        _, out_m, fin_m = timed(llm, p32, plain16 + c_params[16:])
        lens_m = [len(o) for o in out_m[16:]]
        _, _, fin_b = timed(llm, p32, plain16 + [sized(n, r * 1000 + 16 + i) for i, n in enumerate(lens_m)])
        row["mixed_unconstrained_ratio"] = max(fin_b[:16]) / max(fin_m[:16])
        # batch 1, one request at a time
        t1 = t1_nf = 0.0
        n1 = 0
        for i in range(16):
            t, o, _ = timed(llm, p32[i : i + 1], [c_params[i]])
            t_nf1, o_nf, _ = timed(noforce, p32[i : i + 1], [c_params[i]])
            assert o == o_nf
            t1, t1_nf, n1 = t1 + t, t1_nf + t_nf1, n1 + len(o[0])
        row["forced1_ratio"] = t1_nf / t1
        row["batch1_constrained_tok_s"] = n1 / t1
        rounds.append(row)
        print(f"round {r}{' (cold)' if r == 0 else ''}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()), flush=True)
    masks = sorted(llm.engine.grammar_matchers.mask_seconds)
    compiler = llm.engine.grammar_compiler  # its vocabulary is built once per engine, not per grammar
    compile_ms = []
    for schema in SCHEMAS:
        compiler.clear_cache()
        start = time.perf_counter()
        compiler.compile(StructuredOutputsParams(json=schema))
        compile_ms.append((time.perf_counter() - start) * 1e3)
    compile_ms.sort()
    warm = {k: statistics.median(row[k] for row in rounds[1:]) for k in rounds[0]}
    report = {
        **head, "rounds": rounds, "cold": rounds[0], "warm": warm,
        "compile_ms": {"p50": pct(compile_ms, 50), "p99": pct(compile_ms, 99), "max": compile_ms[-1],
                       "schemas": len(compile_ms)},
        "mask_ms_per_step": {"p50": pct(masks, 50) * 1e3, "p99": pct(masks, 99) * 1e3, "steps": len(masks)},
    }
    print(f"warm: all32 {warm['all32_ratio']:.2f}x (goal >= 0.9), mixed unconstrained half "
          f"{warm['mixed_unconstrained_ratio']:.2f}x (goal >= 0.97), forced tokens batch 1 {warm['forced1_ratio']:.2f}x / "
          f"batch 32 {warm['forced32_ratio']:.2f}x (goal >= 1.1)")
    print(f"cold: all32 {rounds[0]['all32_ratio']:.2f}x, forced batch 1 {rounds[0]['forced1_ratio']:.2f}x")
    print(f"compile ms over {len(compile_ms)} schemas: p50 {pct(compile_ms, 50):.2f}, p99 {pct(compile_ms, 99):.2f} "
          f"(goal <= 50); mask ms per step: p50 {pct(masks, 50) * 1e3:.3f}, p99 {pct(masks, 99) * 1e3:.3f} "
          f"over {len(masks)} steps")
    harness.write_report(args.out, report)
    llm.close()
    noforce.close()


def pct(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(round(q / 100 * (len(sorted_values) - 1))))]


if __name__ == "__main__":
    main()
