"""How real small models write tool calls under tool_choice "auto" (issue 43), and what the bare
call object fallback (pyserve/tools/fallback.py) adds.

Each model answers, greedily and through its own chat template with four declared tools, 24
prompts that each want one call of a known tool and 8 that want no tool. Per model:

  tagged      prompts whose answer holds calls in the template's format (Hermes <tool_call>)
  fallback    prompts whose answer has none, but is only a call object (bare or in a ```json
              fence) naming a declared tool with arguments valid for it: read only thanks to it
  correct     of those calls (either form), the prompts whose first call names the expected
              tool and whose every call's arguments validate against its tool's schema
  wrong       calls of another tool, or (tagged form) arguments the schema rejects
  missed      call prompts with no call read in either form
  rejected    of the missed, answers that are a declared tool's call object whose arguments its
              schema rejects (the fallback's rule leaves them content)
  false       calls read on the 8 no-tool prompts (tagged + fallback)

Models: qwen2.5-coder-0.5b-instruct and qwen2.5-coder-1.5b-instruct (Q4_K_M GGUF, fetched with
pyserve.testing.real_models), or one model given with --model PATH (e.g. a tiny random one, to
check that the script runs; give --tool-format where its template shows none). Writes
bench/results/tool_call_forms.json, every answer included.
"""

from __future__ import annotations

import json

import harness
import jsonschema
from pyserve import LLM, SamplingParams
from pyserve.tools.fallback import JsonCallFallback
from pyserve.tools.formats import FORMATS, detect

MODELS = ["qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"]

SCHEMAS = {
    "get_weather": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name, e.g. Paris"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]},
    "calculator": {"type": "object", "properties": {
        "expression": {"type": "string", "description": "An arithmetic expression, e.g. 2 * (3 + 4)"}},
        "required": ["expression"]},
    "web_search": {"type": "object", "properties": {
        "query": {"type": "string"}, "max_results": {"type": "integer", "minimum": 1, "maximum": 20}},
        "required": ["query"]},
    "send_email": {"type": "object", "properties": {
        "to": {"type": "string", "description": "The recipient's email address"},
        "subject": {"type": "string"}, "body": {"type": "string"}}, "required": ["to", "subject", "body"]},
}
DESCRIPTIONS = {
    "get_weather": "Get the current weather in a city.",
    "calculator": "Evaluate an arithmetic expression exactly.",
    "web_search": "Search the web and return the top results.",
    "send_email": "Send an email.",
}
TOOLS = [{"type": "function", "function": {"name": n, "description": DESCRIPTIONS[n], "parameters": s}}
         for n, s in SCHEMAS.items()]

# (prompt, the tool it wants)
CALL_PROMPTS = [
    ("What's the weather in Paris?", "get_weather"),
    ("Is it raining in Seattle right now?", "get_weather"),
    ("Tell me the temperature in Tokyo in fahrenheit.", "get_weather"),
    ("How cold is it in Oslo today, in celsius?", "get_weather"),
    ("Should I bring an umbrella in London today? Check the weather.", "get_weather"),
    ("What's the current weather like in Buenos Aires?", "get_weather"),
    ("What is 1234 * 5678?", "calculator"),
    ("Compute (17 + 25) / 3.", "calculator"),
    ("What is 2 to the power of 20?", "calculator"),
    ("Calculate 15% of 240.", "calculator"),
    ("Use the calculator: 987654321 - 123456789.", "calculator"),
    ("How much is 3.75 * 12 + 8?", "calculator"),
    ("Search the web for the latest Python release.", "web_search"),
    ("Find recent news about the James Webb Space Telescope.", "web_search"),
    ("Look up who won the 2022 World Cup.", "web_search"),
    ("Search for the best hiking trails near Denver, 5 results.", "web_search"),
    ("Find reviews of the Framework 13 laptop online.", "web_search"),
    ("Search the internet for tutorials on Rust lifetimes.", "web_search"),
    ("Send an email to alice@example.com with subject 'Lunch' saying I'll be 10 minutes late.", "send_email"),
    ("Email bob@example.org: subject 'Report', body 'The Q3 report is attached.'", "send_email"),
    ("Let carol@example.com know by email that the meeting moved to 3pm; subject 'Meeting'.", "send_email"),
    ("Send dave@example.net an email titled 'Thanks' thanking him for the help.", "send_email"),
    ("Write to team@example.com with subject 'Deploy' that the deploy finished.", "send_email"),
    ("Email erin@example.com subject 'Invoice' and tell her the invoice is paid.", "send_email"),
]
NO_TOOL_PROMPTS = [
    "Write a Python function that reverses a string.",
    "What does the 'yield' keyword do in Python?",
    "Explain the difference between a list and a tuple.",
    "Hello! How are you?",
    "Write a haiku about autumn.",
    "What is a closure in JavaScript?",
    "Translate 'good morning' into French.",
    "Write a SQL query that counts the rows of a table named users.",
]


def valid(name: str, arguments: str) -> bool:
    try:
        return jsonschema.Draft202012Validator(SCHEMAS[name]).is_valid(json.loads(arguments))
    except (KeyError, ValueError):
        return False


# Any arguments object: tells a call object rejected for its arguments from other content.
ANY_ARGUMENTS = JsonCallFallback([{"name": n, "parameters": {"type": "object"}} for n in SCHEMAS], parallel=True)


def classify(text: str, fmt, fallback: JsonCallFallback, expected: str | None) -> dict:
    """One answer: the form its calls were read in (tagged, fallback or none), the calls, and
    (for a call prompt) whether they are the expected tool with valid arguments."""
    _, tagged = fmt.parser().parse(text)
    calls, form = (tagged, "tagged") if tagged else (fallback.calls(text), "fallback")
    if not calls:
        form = "rejected" if ANY_ARGUMENTS.calls(text) else "none"
    record = {"form": form, "calls": [{"name": c.name, "arguments": c.arguments} for c in calls], "text": text}
    if expected is not None and calls:
        record["correct"] = calls[0].name == expected and all(valid(c.name, c.arguments) for c in calls)
    return record


def run_model(label: str, model_path: str, args) -> dict:
    llm = LLM(model=model_path, device=args.device)
    try:
        fmt = FORMATS[args.tool_format] if args.tool_format != "auto" else detect(llm.tokenizer.chat_template)
        if fmt is None:
            raise SystemExit(f"{label}: its chat template shows no tool-call format; give --tool-format")
        fallback = JsonCallFallback([t["function"] for t in TOOLS], parallel=True)
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
        calls = CALL_PROMPTS[: args.limit]
        plain = NO_TOOL_PROMPTS[: args.limit]
        convs = [[{"role": "user", "content": p}] for p, _ in calls] + [[{"role": "user", "content": p}] for p in plain]
        outs = llm.chat(convs, params, tools=TOOLS, use_tqdm=False)
    finally:
        llm.close()
    texts = [o.outputs[0].text for o in outs]
    call_records = [{"prompt": p, "expected": t, **classify(x, fmt, fallback, t)} for (p, t), x in zip(calls, texts)]
    plain_records = [{"prompt": p, **classify(x, fmt, fallback, None)} for p, x in zip(plain, texts[len(calls) :])]
    summary = {
        "format": fmt.name, "call_prompts": len(calls), "no_tool_prompts": len(plain),
        "tagged": sum(r["form"] == "tagged" for r in call_records),
        "fallback": sum(r["form"] == "fallback" for r in call_records),
        "correct_tagged": sum(r["form"] == "tagged" and r["correct"] for r in call_records),
        "correct_fallback": sum(r["form"] == "fallback" and r["correct"] for r in call_records),
        "wrong": sum(r["form"] in ("tagged", "fallback") and not r["correct"] for r in call_records),
        "missed": sum(r["form"] in ("none", "rejected") for r in call_records),
        "rejected": sum(r["form"] == "rejected" for r in call_records),
        "false_tagged": sum(r["form"] == "tagged" for r in plain_records),
        "false_fallback": sum(r["form"] == "fallback" for r in plain_records),
    }
    return {"model": label, "path": model_path, "summary": summary, "call_answers": call_records,
            "no_tool_answers": plain_records}


def main() -> None:
    ap = harness.parser(__doc__, "tool_call_forms", device=True)
    ap.add_argument("--model", help="one model path instead of the two Qwen2.5-Coder GGUFs")
    ap.add_argument("--tool-format", default="auto", choices=["auto", *FORMATS],
                    help="the format calls are read in (default: read from the chat template)")
    ap.add_argument("--limit", type=int, default=None, help="only the first N prompts of each set")
    ap.add_argument("--max-tokens", type=int, default=256)
    args = ap.parse_args()
    head = harness.header(__file__)
    harness.print_header(head)
    if args.model:
        targets = [(args.model, args.model)]
    else:
        from pyserve.testing.real_models import fetch

        targets = [(name, str(fetch(name))) for name in MODELS]
    results = [run_model(label, path, args) for label, path in targets]
    print(f"{'model':<30} {'tagged':>7} {'fallback':>9} {'correct t/f':>12} {'wrong':>6} {'missed':>7} "
          f"{'rejected':>9} {'false calls t/f':>16}")
    for r in results:
        s = r["summary"]
        n, m = s["call_prompts"], s["no_tool_prompts"]
        print(f"{r['model'][-30:]:<30} {s['tagged']:>4}/{n:<2} {s['fallback']:>6}/{n:<2} "
              f"{s['correct_tagged']:>7}/{s['correct_fallback']:<4} {s['wrong']:>6} {s['missed']:>7} "
              f"{s['rejected']:>9} {s['false_tagged']:>10}/{s['false_fallback']}/{m}")
    harness.write_report(args.out, {**head, "tools": TOOLS, "max_tokens": args.max_tokens, "results": results})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
