"""The prompt budget on a multi-turn chat workload (issue 48): TTFT, prefill tokens and the
prefix-cache hit rate of conversations of 8-20 turns, at prompt budgets against none.

One `pyserve serve` on a real model with default settings (the prefix cache on; off with
--no-prefix-caching). Each
conversation is replayed under every budget in turn (interleaved, conversation by conversation),
each under a cache_salt of its own so that no budget reads another's cached prefix; a budget is
the request's `max_prompt_tokens` (policy `turns`). A turn streams its answer (`ignore_eos`, a
fixed output length), which is appended to the history the next turn sends, as a chat client
does. User messages follow bench/serving.py's chat mix (60% 32 tokens with 128 out, 30% 256
with 128 out, 10% long with 64 out), with the long ones 384 tokens instead of 1024, so that a
newest turn always fits the smallest budget; the text is random words (no model was trained on
it). Reported per budget: TTFT p50 / p99 (and of first turns alone: cold), tokens prefilled
(prompt less cached), the hit rate (cached / prompt tokens), tokens removed, and the p50 TTFT
ratio against no budget; and what no budget policy can beat on this workload: each budget's
hit-rate ceiling (every turn's tokens that no cache held in the unbudgeted run, its new message
and template, must be prefilled under any budget, in a prompt of at most min(history, budget)
tokens), the tighter one of policies that drop whole older turns ("by turns": a moved cut
recomputes the kept turns), and the TTFT floor (each turn's new message alone after the cached
system prompt: a budgeted turn prefills at least that). With --together the conversations are
users taking turns, their histories sharing the KV pool (--num-kv-blocks sizes it: a server under load holds a small share
of each history), one budget after another.

  python bench/prompt_budget.py [--model smollm2-135m-instruct] [--conversations 4]
"""

from __future__ import annotations

import asyncio
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

MIX = ((0.6, 32, 128), (0.3, 256, 128), (0.1, 384, 64))  # (share, user tokens, answer tokens)
WORDS = ("river stone quiet market window paper engine garden signal orange thunder pocket ladder "
         "silver harbor meadow copper lantern violet canyon rocket pencil velvet island candle "
         "marble falcon tunnel cotton planet saddle dragon frozen ribbon basket summit jungle").split()
TOKENS_PER_WORD = 1.4  # about, for these words under a BPE tokenizer: sizes only follow the mix


def conversations(n: int, seed: int, min_turns: int, max_turns: int) -> list[list[tuple[str, int]]]:
    """Each conversation's user messages, with the answer length each asks for."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        turns = []
        for _ in range(rng.randint(min_turns, max_turns)):
            x, acc = rng.random(), 0.0
            for share, size, answer in MIX:
                acc += share
                if x <= acc:
                    break
            words = " ".join(rng.choice(WORDS) for _ in range(round(size / TOKENS_PER_WORD)))
            turns.append((f"Summarize in your own words: {words}", answer))
        out.append(turns)
    return out


async def turn(client: httpx.AsyncClient, base: str, model: str, messages: list, answer: int,
               budget: int | None, salt: str) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": answer, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "cache_salt": salt}
    if budget is not None:
        body["max_prompt_tokens"] = budget
    start, ttft, text, usage = time.perf_counter(), None, [], None
    async with client.stream("POST", base + "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            return {"error": (await resp.aread()).decode()[:300]}
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    text.append(piece)
    details = usage["prompt_tokens_details"]
    return {"ttft": ttft, "text": "".join(text), "prompt": usage["prompt_tokens"], "cached": details["cached_tokens"],
            "removed": details.get("removed_tokens", 0)}


async def replay(base: str, model: str, conv: list[tuple[str, int]], budget: int | None, salt: str) -> list[dict]:
    messages = [{"role": "system", "content": "You are a helpful assistant."}]
    results = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0)) as client:
        for question, answer in conv:
            messages.append({"role": "user", "content": question})
            r = await turn(client, base, model, messages, answer, budget, salt)
            results.append(r)
            if "error" in r:  # the conversation cannot go on without its answer
                break
            messages.append({"role": "assistant", "content": r["text"]})
    return results


async def replay_together(base: str, model: str, convs: list[list[tuple[str, int]]], budget: int | None,
                          salt: str) -> list[list[dict]]:
    """The conversations as users in turn: every conversation's first turn, then every second
    one, ... (one request at a time), so their histories share the KV pool."""
    histories = [[{"role": "system", "content": "You are a helpful assistant."}] for _ in convs]
    results: list[list[dict]] = [[] for _ in convs]
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0)) as client:
        for t in range(max(len(c) for c in convs)):
            for i, conv in enumerate(convs):
                if t >= len(conv) or (results[i] and "error" in results[i][-1]):
                    continue
                question, answer = conv[t]
                histories[i].append({"role": "user", "content": question})
                r = await turn(client, base, model, histories[i], answer, budget, f"{salt}-{i}")
                results[i].append(r)
                if "error" not in r:
                    histories[i].append({"role": "assistant", "content": r["text"]})
    return results


async def floor(base: str, model: str, conv: list[tuple[str, int]]) -> list[dict]:
    """Each turn's new message alone after the system prompt (cached after the first request): the
    least a budgeted turn prefills, at the least context."""
    results = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0)) as client:
        for question, _ in conv:
            messages = [{"role": "system", "content": "You are a helpful assistant."},
                        {"role": "user", "content": question}]
            results.append(await turn(client, base, model, messages, 1, None, "floor"))
    return results


def hit_rate_ceiling(unbudgeted: list[list[dict]], budget: int) -> float:
    """The most cached / prompt tokens any policy within `budget` can reach: the tokens each turn
    prefilled without a budget are prefilled under it too, in a prompt of at most min(prompt, budget)."""
    done = [t for conv in unbudgeted for t in conv if "error" not in t]
    return round(1 - sum(t["prompt"] - t["cached"] for t in done) / sum(min(t["prompt"], budget) for t in done), 4)


def turn_dropping_ceiling(unbudgeted: list[list[dict]], floors: list[list[dict]], budget: int) -> float | None:
    """The most cached / prompt tokens a policy that drops whole older turns can reach within
    `budget` on a server whose prefix cache is exact (a cached token's keys hold for the tokens
    before it only), over every choice of cut at every turn. A turn that keeps the cut of the turn
    before it prefills what the unbudgeted turn did (its new message); one that moves it starts its
    kept turns at new positions, so only what every prompt starts with (the system prompt and the
    first words of a message: the most the new messages alone found cached) is found cached.
    Sizes come from the runs: turn i's prompt with turns before c dropped is
    P_i - P_c + P_0 + F_c - F_0 (P: the unbudgeted prompts, F: each new message alone after the
    system prompt). None where a newest turn alone does not fit."""
    convs = []
    for conv, alone in zip(unbudgeted, floors, strict=True):
        if any("error" in t for t in conv + alone):
            return None
        p, f = [t["prompt"] for t in conv], [t["prompt"] for t in alone]
        kept = [[p[i] - p[c] + p[0] + f[c] - f[0] for c in range(i + 1)] for i in range(len(conv))]
        if any(row[-1] > budget for row in kept):
            return None
        convs.append((conv, alone, kept))

    def best(rate: float) -> float:
        """max over policies of sum(cached - rate * prompt): >= 0 exactly where `rate` is reachable."""
        total = 0.0
        for conv, alone, kept in convs:
            head = max(t["cached"] for t in alone)  # the system prompt and the words every message starts with
            gain = {0: conv[0]["cached"] - rate * kept[0][0]}  # the cut after turn i -> the best sum so far
            for i in range(1, len(conv)):
                nxt = {}
                for c in range(i + 1):
                    if kept[i][c] > budget:
                        continue
                    stay = conv[i]["cached"] - kept[i][0] + kept[i][c]  # all but the new message
                    for prev, g in gain.items():
                        cached = stay if prev == c else head
                        value = g + cached - rate * kept[i][c]
                        nxt[c] = max(nxt.get(c, value), value)
                gain = nxt
            total += max(gain.values())
        return total

    low, high = 0.0, 1.0
    for _ in range(40):
        mid = (low + high) / 2
        low, high = (mid, high) if best(mid) >= 0 else (low, mid)
    return round(low, 4)


def summary(turns: list[list[dict]]) -> dict:
    done = [t for conv in turns for t in conv if "error" not in t]
    ttfts = [t["ttft"] for t in done]
    prompt, cached = sum(t["prompt"] for t in done), sum(t["cached"] for t in done)
    return {"turns": len(done), "refused": sum(1 for conv in turns for t in conv if "error" in t),
            "ttft_p50_s": round(statistics.median(ttfts), 4), "ttft_p99_s": round(harness.p99(ttfts), 4),
            "first_turn_ttft_p50_s": round(statistics.median(conv[0]["ttft"] for conv in turns
                                                             if conv and "error" not in conv[0]), 4),
            "prompt_tokens": prompt, "prefilled_tokens": prompt - cached,
            "hit_rate": round(cached / prompt, 4) if prompt else 0.0,
            "removed_tokens": sum(t["removed"] for t in done),
            "max_prompt_tokens_seen": max(t["prompt"] for t in done)}


def main() -> None:
    ap = harness.parser(__doc__, "prompt_budget")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--min-turns", type=int, default=8)
    ap.add_argument("--max-turns", type=int, default=20)
    ap.add_argument("--budgets", default="512,1024,2048")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-prefix-caching", action="store_true",
                    help="serve with the prefix cache off (what a budget saves where no cache holds the history)")
    ap.add_argument("--together", action="store_true",
                    help="the conversations as users taking turns (their histories share the KV pool), one budget "
                         "after another, instead of one conversation at a time with the budgets interleaved")
    ap.add_argument("--num-kv-blocks", type=int, help="the server's KV pool, in blocks of 16 tokens (default: its own)")
    args = ap.parse_args()
    head = harness.header(__file__)
    harness.print_header(head)
    budgets: list[int | None] = [None, *(int(b) for b in args.budgets.split(","))]
    convs = conversations(args.conversations, args.seed, args.min_turns, args.max_turns)
    path = fetch(args.model)
    results: dict[str, list[list[dict]]] = {str(b): [] for b in budgets}
    floors: list[list[dict]] = []
    with tempfile.TemporaryDirectory() as work:
        flags = [*(["--no-prefix-caching"] if args.no_prefix_caching else []),
                 *(["--num-kv-blocks", str(args.num_kv_blocks)] if args.num_kv_blocks else [])]
        proc, base = start_server(path, *flags, workdir=Path(work))
        try:
            model = httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]
            asyncio.run(replay(base, model, [("Hello there.", 8)], None, "warm-up"))  # not measured
            if args.together:
                for b in budgets:
                    results[str(b)] = asyncio.run(replay_together(base, model, convs, b, f"budget-{b}"))
                    print(f"  budget {b}: done", flush=True)
                floors = [asyncio.run(floor(base, model, conv)) for conv in convs]
            for i, conv in enumerate(convs if not args.together else []):
                for b in budgets:
                    results[str(b)].append(asyncio.run(replay(base, model, conv, b, f"budget-{b}-{i}")))
                floors.append(asyncio.run(floor(base, model, conv)))
                print(f"  conversation {i + 1}/{len(convs)}: {len(conv)} turns", flush=True)
        finally:
            stop_server(proc)
    report = {**head, "model": args.model, "prefix_caching": not args.no_prefix_caching, "together": args.together,
              "num_kv_blocks": args.num_kv_blocks, "conversations": len(convs), "turns": [len(c) for c in convs],
              "budgets": {}}
    summaries = {b: summary(results[str(b)]) for b in budgets}
    base_p50 = summaries[None]["ttft_p50_s"]
    floor_p50 = statistics.median(t["ttft"] for conv in floors for t in conv if "error" not in t)
    report["ttft_floor_p50_s"] = round(floor_p50, 4)
    report["most_any_budget_gains_ttft_p50"] = round(base_p50 / floor_p50, 3)
    print(f"{'budget':>7} {'turns':>5} {'refused':>7} {'TTFT p50':>9} {'p99':>7} {'cold p50':>9} {'prefilled':>9} "
          f"{'hit rate':>8} {'ceiling':>8} {'by turns':>8} {'removed':>8} {'x none':>7}")
    for b, s in summaries.items():
        s["ttft_p50_vs_none"] = round(base_p50 / s["ttft_p50_s"], 3)
        s["hit_rate_ceiling"] = s["hit_rate"] if b is None else hit_rate_ceiling(results["None"], b)
        s["turn_dropping_ceiling"] = s["hit_rate"] if b is None or args.together else \
            turn_dropping_ceiling(results["None"], floors, b)
        report["budgets"]["none" if b is None else str(b)] = s
        print(f"{'none' if b is None else b:>7} {s['turns']:>5} {s['refused']:>7} {s['ttft_p50_s']:>9.4f} "
              f"{s['ttft_p99_s']:>7.3f} {s['first_turn_ttft_p50_s']:>9.4f} {s['prefilled_tokens']:>9} "
              f"{s['hit_rate']:>8.3f} {s['hit_rate_ceiling']:>8.3f} {s['turn_dropping_ceiling'] or 0:>8.3f} "
              f"{s['removed_tokens']:>8} "
              f"{s['ttft_p50_vs_none']:>7.2f}")
    print(f"TTFT floor p50 (each turn's new message alone after the cached system prompt) {floor_p50:.4f} s: "
          f"no budget can make TTFT p50 more than {base_p50 / floor_p50:.2f}x lower")
    harness.write_report(args.out, report)


if __name__ == "__main__":
    main()
