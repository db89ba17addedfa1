"""Speculation on real GGUF files: Qwen2.5-Coder-0.5B-Instruct drafting for the 1.5B (both
Q4_K_M, one tokenizer) and n-gram lookup in the 1.5B's own prompt and output, each on pyserve's
native 4-bit / int8 layers, against the 1.5B alone in the same run: batch 1, greedy, code prompts
through the chat template, --tokens tokens each (EOS ignored), one request at a time. Default
speculation settings (4 tokens, the adaptive depth on); each method's outputs are checked equal
to plain decoding's. Plain decoding runs first and last (its rate is the mean of the two, so a
drift of the machine's speed during the run does not favour either method). Reports tok/s, the
ratio to plain, the drafts' acceptance and the depth the adaptive rule settled on, per method.
`--humaneval N`: the first N HumanEval problems as `pyserve eval --data humaneval` asks them,
instead of the three prompts below. Writes bench/results/gguf_speculation.json.
"""

from __future__ import annotations

import time

import harness
from pyserve import LLM, SamplingParams
from pyserve.testing.real_models import fetch

PROMPTS = ["Write a Python function that merges overlapping intervals.",
           "Write a Python class for an LRU cache with get and put methods.",
           "Write a Python function that parses a duration like '1h30m' into seconds."]


def run(target: str, tokens: int, questions: list[str], **kwargs) -> tuple[list[list[int]], float, dict]:
    llm = LLM(model=target, max_model_len=2048, **kwargs)
    tok = llm.get_tokenizer()
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in questions]
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)  # warm-up
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    start, outs = time.perf_counter(), []
    for prompt in prompts:
        outs.append(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
    tok_s = sum(map(len, outs)) / (time.perf_counter() - start)
    stats = {k: v for k, v in llm.stats().items() if k.startswith("spec_decode")}
    llm.close()
    return outs, tok_s, stats


def method_configs(draft: str, fixed_depth: int) -> dict[str, dict]:
    depth = {"num_speculative_tokens": fixed_depth or 4, "adaptive": not fixed_depth}
    return {"draft_model": {"method": "draft_model", "model": draft, **depth}, "ngram": {"method": "ngram", **depth}}


def main() -> None:
    ap = harness.parser(__doc__, "gguf_speculation")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--humaneval", type=int, default=0, metavar="N", help="the first N HumanEval problems as prompts")
    ap.add_argument("--fixed-depth", type=int, default=0, metavar="K",
                    help="draft K tokens every step, the adaptive depth off (default: 4, adaptive)")
    ap.add_argument("--methods", default="draft_model,ngram", help="comma-separated: draft_model, ngram")
    args = ap.parse_args()
    questions = PROMPTS
    if args.humaneval:
        from pyserve.eval.humaneval import humaneval_items

        questions = [item.messages[0]["content"] for item in humaneval_items()[: args.humaneval]]
    head = harness.header(__file__)
    harness.print_header(head)
    target, draft = str(fetch("qwen2.5-coder-1.5b-instruct")), str(fetch("qwen2.5-coder-0.5b-instruct"))
    configs = method_configs(draft, args.fixed_depth)
    unknown = set(args.methods.split(",")) - set(configs)
    if unknown:
        ap.error(f"--methods: unknown {sorted(unknown)}; known: {sorted(configs)}")
    plain, first_tok_s, _ = run(target, args.tokens, questions)
    methods = {}
    for name in args.methods.split(","):
        outs, tok_s, stats = run(target, args.tokens, questions, speculative_config=configs[name])
        accepted = stats["spec_decode_num_accepted_tokens"] / max(stats["spec_decode_num_draft_tokens"], 1)
        methods[name] = {"tok_s": round(tok_s, 2), "same_tokens": outs == plain,
                         "draft_tokens_accepted": round(accepted, 3), **stats}
    _, last_tok_s, _ = run(target, args.tokens, questions)
    plain_tok_s = (first_tok_s + last_tok_s) / 2
    for name, m in methods.items():
        m["ratio"] = round(m["tok_s"] / plain_tok_s, 3)
        print(f"{name}: {m['tok_s']:.2f} tok/s against plain {plain_tok_s:.2f} ({m['ratio']:.2f}x), "
              f"same tokens: {m['same_tokens']}; {100 * m['draft_tokens_accepted']:.0f}% of "
              f"{m['spec_decode_num_draft_tokens']} draft tokens accepted (mean accepted length "
              f"{m['spec_decode_mean_acceptance_length']:.2f}), adaptive depth at the end {m['spec_decode_depth']}")
    report = {**head, "tokens": args.tokens, "fixed_depth": args.fixed_depth or None,
              "prompts": f"humaneval[:{args.humaneval}]" if args.humaneval else "three",
              "plain_tok_s": round(plain_tok_s, 2), "plain_tok_s_first_last": [round(first_tok_s, 2), round(last_tok_s, 2)],
              "methods": methods}
    harness.write_report(args.out, report)


if __name__ == "__main__":
    main()
