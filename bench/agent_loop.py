"""An agent loop on a real model (issue 49): N steps of tool call, tool result, next step, then an
answer, served four ways side by side:

  responses-stored   /v1/responses, each step sending only its new items with previous_response_id
  responses-resent   /v1/responses, each step resending the whole conversation (store: false)
  chat               /v1/chat/completions, resending the whole conversation (prefix cache on)
  chat-no-cache      the same against a second server started with --no-prefix-caching

Each step but the last forces a call of the one tool (`lookup`, tool_choice required, one call a
turn); its result is a passage of random words (no model was trained on it), so the conversation
grows by the call and ~120 tokens a step; the last step answers in text (tool_choice none, at
most 48 tokens). The agent's instructions are --system-words words (default 600; agent
frameworks send hundreds to thousands of tokens of them). Every loop has a task of its own: no
loop reads another's cached prefix but the instructions', which a warm-up loop caches first, as
a server's steady state holds them. The four ways are interleaved loop by loop. Reported per
way: total time of a loop (median over loops), step TTFT p50 (the first streamed delta; an
empty answer's end), the share of each step's input tokens that were cached (steps after the
first), the least share of the previous step's prompt (its whole blocks of 16) that a step
found cached, and the least share of a step's prompt that the previous step's prompt makes up
(what a cache of earlier prompts could serve at most: the rest is new to the server), and the
same with the previous step's output added (`w/ out`: a bound where the chat template renders
the model's calls, as Qwen's does and SmolLM2's does not; the cache holds generated tokens too).
Ratios: each way's total time against chat's and against chat-no-cache's. --result-words sets a
tool result's length (85 words, ~120 tokens, by default; a calculator's answer is a few).

  python bench/agent_loop.py [--model smollm2-135m-instruct] [--steps 8] [--loops 3] [--result-words 85]
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx

import harness
from pyserve.testing import start_server, stop_server
from pyserve.testing.real_models import fetch

WORDS = ("river stone quiet market window paper engine garden signal orange thunder pocket ladder "
         "silver harbor meadow copper lantern violet canyon rocket pencil velvet island candle").split()
SYSTEM = "You are a research agent. Call lookup for each key you need, then answer."
LOOKUP = {"type": "object", "properties": {"key": {"type": "string", "maxLength": 24}}, "required": ["key"],
          "additionalProperties": False}
ANSWER_TOKENS, CALL_TOKENS = 48, 48
BLOCK = 16  # the server's default KV block: the prefix cache's unit
WAYS = ("responses-stored", "responses-resent", "chat", "chat-no-cache")


def _events(resp: httpx.Response):
    for line in resp.iter_lines():
        if line.startswith("data: {"):
            yield json.loads(line[6:])


def responses_step(client: httpx.Client, base: str, model: str, body: dict) -> dict:
    start, ttft, final = time.perf_counter(), None, None
    with client.stream("POST", base + "/v1/responses", json={"model": model, "stream": True, **body}) as resp:
        if resp.status_code != 200:
            raise RuntimeError(resp.read()[:300])
        for event in _events(resp):
            if ttft is None and event["type"] in ("response.output_text.delta", "response.function_call_arguments.delta"):
                ttft = time.perf_counter() - start
            if event["type"] in ("response.completed", "response.incomplete"):
                final = event["response"]
    usage = final["usage"]
    ttft = time.perf_counter() - start if ttft is None else ttft  # an empty answer: its end
    return {"ttft": ttft, "response": final, "input": usage["input_tokens"], "output": usage["output_tokens"],
            "cached": usage["input_tokens_details"]["cached_tokens"]}


def chat_step(client: httpx.Client, base: str, model: str, body: dict) -> dict:
    start, ttft, usage, text, calls = time.perf_counter(), None, None, "", {}
    with client.stream("POST", base + "/v1/chat/completions", json={
            "model": model, "stream": True, "stream_options": {"include_usage": True}, **body}) as resp:
        if resp.status_code != 200:
            raise RuntimeError(resp.read()[:300])
        for chunk in _events(resp):
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                if ttft is None and (delta.get("content") or delta.get("tool_calls")):
                    ttft = time.perf_counter() - start
                text += delta.get("content") or ""
                for c in delta.get("tool_calls") or []:
                    entry = calls.setdefault(c["index"], {"id": "", "name": "", "arguments": ""})
                    entry["id"] = c.get("id") or entry["id"]
                    entry["name"] = (c.get("function") or {}).get("name") or entry["name"]
                    entry["arguments"] += (c.get("function") or {}).get("arguments") or ""
    ttft = time.perf_counter() - start if ttft is None else ttft  # an empty answer: its end
    return {"ttft": ttft, "text": text, "calls": [calls[i] for i in sorted(calls)], "input": usage["prompt_tokens"],
            "output": usage["completion_tokens"], "cached": usage["prompt_tokens_details"]["cached_tokens"]}


def system_prompt(words: int) -> str:
    """The agent's instructions: SYSTEM, then numbered rules of random words up to `words` words
    (agent frameworks send hundreds to thousands of tokens of instructions and tool descriptions)."""
    rng = random.Random(1234)
    rules = [f"{i + 1}. " + " ".join(rng.choice(WORDS) for _ in range(12)) for i in range(words // 12)]
    return SYSTEM + ("\n\nRules:\n" + "\n".join(rules) if rules else "")


def passage(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def run_responses(base: str, model: str, system: str, task: str, steps: int, stored: bool, seed: int,
                  result_words: int) -> list[dict]:
    rng = random.Random(seed)
    tools = [{"type": "function", "name": "lookup", "description": "Looks up a key", "parameters": LOOKUP}]
    history: list[dict] = [{"role": "user", "content": task}]
    new: list[dict] = list(history)
    previous, out = None, []
    with httpx.Client(timeout=600) as client:
        for step in range(steps + 1):
            last = step == steps
            body = {"instructions": system, "tools": tools, "tool_choice": "none" if last else "required",
                    "parallel_tool_calls": False, "temperature": 0,
                    "max_output_tokens": ANSWER_TOKENS if last else CALL_TOKENS, "store": stored}
            if stored:
                body["input"] = new
                if previous is not None:
                    body["previous_response_id"] = previous
            else:
                body["input"] = history
            r = responses_step(client, base, model, body)
            out.append(r)
            previous = r["response"]["id"]
            if last:
                break
            output = [{k: v for k, v in item.items() if k != "status"} for item in r["response"]["output"]]
            results = [{"type": "function_call_output", "call_id": item["call_id"], "output": passage(rng, result_words)}
                       for item in output if item["type"] == "function_call"]
            history += output + results
            new = results
    return out


def run_chat(base: str, model: str, system: str, task: str, steps: int, seed: int, result_words: int) -> list[dict]:
    rng = random.Random(seed)
    tools = [{"type": "function", "function": {"name": "lookup", "description": "Looks up a key",
                                               "parameters": LOOKUP}}]
    messages: list[dict] = [{"role": "system", "content": system}, {"role": "user", "content": task}]
    out = []
    with httpx.Client(timeout=600) as client:
        for step in range(steps + 1):
            last = step == steps
            r = chat_step(client, base, model, {"messages": messages, "tools": tools,
                                                "tool_choice": "none" if last else "required",
                                                "parallel_tool_calls": False, "temperature": 0,
                                                "max_tokens": ANSWER_TOKENS if last else CALL_TOKENS})
            out.append(r)
            if last:
                break
            calls = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                     for c in r["calls"]]
            messages.append({"role": "assistant", "content": r["text"] or None, "tool_calls": calls})
            messages += [{"role": "tool", "tool_call_id": c["id"], "content": passage(rng, result_words)} for c in calls]
    return out


def summary(loops: list[tuple[float, list[dict]]]) -> dict:
    later = [s for _, steps in loops for s in steps[1:]]
    # A step's prompt starts with the previous step's (the history re-rendered the same way); the
    # cache can hold that prompt's whole blocks of 16 tokens: what it held of them.
    held = [s["cached"] / (p["input"] // BLOCK * BLOCK) for _, steps in loops for p, s in zip(steps, steps[1:])]
    # What any cache of earlier prompts could serve of a step: the previous step's prompt, all of it.
    ceiling = [p["input"] / s["input"] for _, steps in loops for p, s in zip(steps, steps[1:])]
    # Where the chat template renders the model's calls, its output too (a bound: as re-rendered).
    with_output = [min(1.0, (p["input"] + p["output"]) / s["input"]) for _, steps in loops
                   for p, s in zip(steps, steps[1:])]
    return {"total_s_p50": round(statistics.median(t for t, _ in loops), 3),
            "min_step_cached_of_previous_prompt": round(min(held), 4),
            "step_ttft_p50_s": round(statistics.median(s["ttft"] for _, steps in loops for s in steps), 4),
            "cached_share_after_first": round(sum(s["cached"] for s in later) / sum(s["input"] for s in later), 4),
            "min_step_cached_share_after_first": round(min(s["cached"] / s["input"] for s in later), 4),
            "min_step_previous_prompt_share": round(min(ceiling), 4),
            "min_step_previous_prompt_and_output_share": round(min(with_output), 4),
            "first_loop_steps": [{k: s[k] for k in ("input", "cached", "output")} for s in loops[0][1]],
            "input_tokens_last_step": statistics.median(steps[-1]["input"] for _, steps in loops)}


def main() -> None:
    ap = harness.parser(__doc__, "agent_loop")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--loops", type=int, default=3)
    ap.add_argument("--system-words", type=int, default=600, help="words of agent instructions (0: one line)")
    ap.add_argument("--result-words", type=int, default=85, help="words of each tool result")
    args = ap.parse_args()
    head = harness.header(__file__)
    harness.print_header(head)
    path = fetch(args.model)
    flags = ("--max-model-len", "4096", "--tool-call-parser", "hermes")
    results: dict[str, list[tuple[float, list[dict]]]] = {w: [] for w in WAYS}
    with tempfile.TemporaryDirectory() as work:
        cached_proc, cached = start_server(path, *flags, "--data-dir", str(Path(work) / "data"),
                                           workdir=Path(work))
        plain_proc, plain = start_server(path, *flags, "--no-prefix-caching", workdir=Path(work))
        try:
            model = httpx.get(cached + "/v1/models", timeout=30).json()["data"][0]["id"]
            system = system_prompt(args.system_words)
            for base in (cached, plain):  # a first loop each, not measured: the instructions are cached then
                run_chat(base, model, system, "Warm up.", 1, 0, args.result_words)
            run_responses(cached, model, system, "Warm up.", 1, True, 0, args.result_words)
            for loop in range(args.loops):
                for i, way in enumerate(WAYS):
                    task = f"Task {loop}-{i}: find the keys alpha{loop}{i} and beta{loop}{i} and summarize them."
                    start = time.perf_counter()
                    if way.startswith("responses"):
                        steps = run_responses(cached, model, system, task, args.steps, way == "responses-stored",
                                              loop, args.result_words)
                    else:
                        steps = run_chat(cached if way == "chat" else plain, model, system, task, args.steps, loop,
                                         args.result_words)
                    results[way].append((time.perf_counter() - start, steps))
                print(f"  loop {loop + 1}/{args.loops} done", flush=True)
        finally:
            stop_server(cached_proc)
            stop_server(plain_proc)
    report = {**head, "model": args.model, "steps": args.steps, "loops": args.loops,
              "system_words": args.system_words, "result_words": args.result_words, "ways": {}}
    print(f"{'way':>17} {'total p50':>9} {'step TTFT p50':>13} {'cached share':>12} {'min':>6} {'of prev':>7} "
          f"{'ceiling':>7} {'w/ out':>6} {'x chat':>7} {'x no-cache':>10}")
    summaries = {way: summary(results[way]) for way in WAYS}
    for way, s in summaries.items():
        s["total_vs_chat"] = round(s["total_s_p50"] / summaries["chat"]["total_s_p50"], 3)
        s["speedup_vs_chat_no_cache"] = round(summaries["chat-no-cache"]["total_s_p50"] / s["total_s_p50"], 3)
        report["ways"][way] = s
        print(f"{way:>17} {s['total_s_p50']:>9.3f} {s['step_ttft_p50_s']:>13.4f} "
              f"{s['cached_share_after_first']:>12.3f} {s['min_step_cached_share_after_first']:>6.3f} "
              f"{s['min_step_cached_of_previous_prompt']:>7.3f} {s['min_step_previous_prompt_share']:>7.3f} "
              f"{s['min_step_previous_prompt_and_output_share']:>6.3f} "
              f"{s['total_vs_chat']:>7.3f} {s['speedup_vs_chat_no_cache']:>10.3f}")
    harness.write_report(args.out, report)


if __name__ == "__main__":
    main()
