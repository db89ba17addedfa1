"""Soak: --minutes of mixed traffic against `pyserve serve` on loopback, with clients that hang up.

Each of --concurrency client loops sends one request after another: chat or completions,
streaming or not, n of 1 or 2, prompts of 8-400 tokens (a third of them behind one of four shared
512-token prefixes), 4-96 output tokens, random sampling settings; about one request in five is
abandoned mid-way (the client closes the stream after a few chunks, or gives up waiting). Every
--sample-every seconds it records the server's RSS (from /proc), its KV block counts and queue
lengths (from /metrics) and the TTFT of the requests finished since the last sample.

At the end it waits for the server to go idle and checks: RSS drift (the median of the last tenth
of the samples against the median of the tenth after --warmup-minutes) within --max-rss-drift;
KV blocks back to baseline (none referenced: free + cached = the pool); no request lost (every
request not abandoned on purpose answered completely, with its usage); no 5xx. It prints the
drift of each measure and exits 1 when a check fails. Loopback only, bounded by --minutes and
--max-requests. Writes --out (JSON) with every sample.

The KV pool is reserved at start and its pages are faulted in as blocks are first written, so
RSS grows until every block has been used once (the prefix cache keeps blocks, so a long run
gets there); a run shorter than that passes --num-kv-blocks small enough to be filled during
the warm-up.

  python bench/soak.py --minutes 30
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

import harness
from pyserve.default_model import TARGET_DIR
from pyserve.testing import parse_metrics, start_server, stop_server
from serving import ExactText  # exact-length random text


@dataclass
class Tally:
    sent: int = 0
    completed: int = 0
    abandoned: int = 0
    lost: list[str] = field(default_factory=list)  # what went wrong with requests nobody abandoned
    server_errors: int = 0
    ttfts: list[float] = field(default_factory=list)  # since the last sample


def metrics(text: str) -> dict[str, float]:
    return {k.removeprefix("pyserve:"): v for k, v in parse_metrics(text, "pyserve-default").items()}


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


class Traffic:
    def __init__(self, base: str, model: str, seed: int, text: ExactText):
        self.base, self.model, self.rng, self.text = base, model, random.Random(seed), text
        self.prefixes = [text.text(512) for _ in range(4)]

    def request(self) -> tuple[str, dict, bool]:
        r = self.rng
        prompt = self.text.text(r.randint(8, 400))
        if r.random() < 1 / 3:
            prompt = r.choice(self.prefixes) + prompt
        body = {"model": self.model, "max_tokens": r.randint(4, 96), "n": r.choice([1, 1, 1, 2]),
                "temperature": r.choice([0.0, 0.7, 1.0]), "top_p": r.choice([1.0, 0.9]), "seed": r.randrange(1000),
                "stream": r.random() < 0.6, "ignore_eos": r.random() < 0.5}
        if r.random() < 0.5:
            path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
        else:
            path, body["prompt"] = "/v1/completions", prompt
        if body["stream"]:
            body["stream_options"] = {"include_usage": True}
        return path, body, r.random() < 0.2

    async def one(self, client: httpx.AsyncClient, tally: Tally) -> None:
        path, body, abandon = self.request()
        tally.sent += 1
        start = time.perf_counter()
        try:
            if not body["stream"]:
                timeout = self.rng.uniform(0.05, 1.0) if abandon else 600
                try:
                    r = await client.post(path, json=body, timeout=timeout)
                except httpx.TimeoutException:
                    if abandon:
                        tally.abandoned += 1
                        return
                    raise
                self.judge(r.status_code, r.json() if r.status_code != 200 else r.json().get("usage"), tally, body)
                tally.ttfts.append(time.perf_counter() - start)  # the whole answer is the first token here
                return
            async with client.stream("POST", path, json=body, timeout=600) as r:
                if r.status_code != 200:
                    self.judge(r.status_code, json.loads(await r.aread()), tally, body)
                    return
                chunks, usage, done, first = 0, None, False, None
                stop_after = self.rng.randint(1, 8) if abandon else None
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: "):]
                    if data == "[DONE]":
                        done = True
                        break
                    event = json.loads(data)
                    if "error" in event:
                        self.judge(event["error"].get("code") or 503, event, tally, body)
                        return
                    first = first or time.perf_counter()
                    usage = event.get("usage") or usage
                    chunks += 1
                    if stop_after is not None and chunks >= stop_after:
                        tally.abandoned += 1
                        return  # leaving the block closes the connection mid-stream
                if first is not None:
                    tally.ttfts.append(first - start)
                if not done or usage is None:
                    tally.lost.append(f"{path}: stream ended without [DONE] or usage")
                else:
                    self.judge(200, usage, tally, body)
        except (httpx.HTTPError, ValueError) as e:
            tally.lost.append(f"{path}: {e!r}")

    @staticmethod
    def judge(status: int, payload, tally: Tally, body: dict) -> None:
        if status == 200:
            want = body["n"] * body["max_tokens"]
            if payload is None or not 0 < payload["completion_tokens"] <= want:
                tally.lost.append(f"bad usage {payload} for {want} tokens at most")
            else:
                tally.completed += 1
        elif status >= 500:
            tally.server_errors += 1
            tally.lost.append(f"{status}: {payload}")
        else:
            tally.lost.append(f"{status}: {payload}")  # the traffic is valid: a refusal is a loss


async def soak(args, base: str, pid: int) -> dict:
    traffic = Traffic(base, "pyserve-default", args.seed, ExactText(TARGET_DIR / "tokenizer.json", args.seed))
    tally, samples = Tally(), []
    end = time.monotonic() + args.minutes * 60
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    async with httpx.AsyncClient(base_url=base, limits=limits) as client:
        async def loop() -> None:
            while time.monotonic() < end and tally.sent < args.max_requests:
                await traffic.one(client, tally)

        async def sampler() -> None:
            start = time.monotonic()
            while time.monotonic() < end and tally.sent < args.max_requests:
                await asyncio.sleep(args.sample_every)
                m = metrics((await client.get("/metrics")).text)
                ttft = statistics.median(tally.ttfts) * 1000 if tally.ttfts else None
                tally.ttfts.clear()
                samples.append({"t_s": round(time.monotonic() - start, 1), "rss_mib": round(rss_mib(pid), 1),
                                "kv_free_blocks": m["kv_free_blocks"], "kv_cached_blocks": m["kv_cached_blocks"],
                                "kv_usage": m["kv_cache_usage_perc"], "running": m["num_requests_running"],
                                "waiting": m["num_requests_waiting"], "ttft_ms_p50": ttft and round(ttft, 1),
                                "sent": tally.sent})
                print(json.dumps(samples[-1]), flush=True)

        await asyncio.gather(sampler(), *(loop() for _ in range(args.concurrency)))
        idle_by = time.monotonic() + 60
        while True:  # every request is answered or abandoned; the server should now go idle
            m = metrics((await client.get("/metrics")).text)
            if (m["num_requests_running"], m["num_requests_waiting"], m["kv_cache_usage_perc"]) == (0, 0, 0) \
                    or time.monotonic() > idle_by:
                break
            await asyncio.sleep(0.5)
        final = {"rss_mib": round(rss_mib(pid), 1), **m}
    return {"tally": tally, "samples": samples, "final": final}


def drift(samples: list[dict], key: str, warmup_s: float) -> tuple[float | None, float | None]:
    values = [s[key] for s in samples if s["t_s"] >= warmup_s and s[key] is not None]
    if len(values) < 2:
        return None, None
    k = max(1, len(values) // 10)
    return statistics.median(values[:k]), statistics.median(values[-k:])


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser(__doc__, "soak", device=True)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--sample-every", type=float, default=5.0)
    ap.add_argument("--warmup-minutes", type=float, default=2.0)
    ap.add_argument("--max-rss-drift", type=float, default=0.05)
    ap.add_argument("--max-requests", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-kv-blocks", type=int, default=None, help="the server's KV pool (default: its own)")
    args = ap.parse_args(argv)
    head = harness.header(__file__, argv)
    harness.print_header(head)
    with tempfile.TemporaryDirectory() as tmp:
        pool = [] if args.num_kv_blocks is None else ["--num-kv-blocks", str(args.num_kv_blocks)]
        proc, base = start_server(None, "--device", args.device, "--max-num-seqs", "32", *pool, workdir=Path(tmp))
        try:
            result = asyncio.run(soak(args, base, proc.pid))
        finally:
            exit_code = stop_server(proc)
    tally, samples, final = result["tally"], result["samples"], result["final"]
    warmup = min(args.warmup_minutes * 60, args.minutes * 60 / 4)
    rss0, rss1 = drift(samples, "rss_mib", warmup)
    ttft0, ttft1 = drift(samples, "ttft_ms_p50", warmup)
    rss_drift = None if rss0 is None else (rss1 - rss0) / rss0
    blocks_back = final["kv_cache_usage_perc"] == 0 and \
        final["kv_free_blocks"] + final["kv_cached_blocks"] == final["kv_total_blocks"] - 1  # block 0 is the null block
    checks = {
        "rss_flat": rss_drift is not None and abs(rss_drift) <= args.max_rss_drift,
        "kv_blocks_back_to_baseline": blocks_back,
        "idle_at_the_end": final["num_requests_running"] == 0 and final["num_requests_waiting"] == 0,
        "no_lost_requests": not tally.lost,
        "no_server_errors": tally.server_errors == 0,
        "server_exited_cleanly": exit_code == 0,
    }
    report = {**head, "minutes": args.minutes,
              "concurrency": args.concurrency, "sent": tally.sent, "completed": tally.completed,
              "abandoned": tally.abandoned, "lost": len(tally.lost), "lost_examples": tally.lost[:5],
              "server_errors": tally.server_errors,
              "rss_mib_after_warmup": rss0, "rss_mib_at_end": rss1, "rss_drift": rss_drift and round(rss_drift, 4),
              "ttft_ms_p50_after_warmup": ttft0, "ttft_ms_p50_at_end": ttft1, "final": final, "checks": checks,
              "samples": samples}
    harness.write_report(args.out, report)
    print(f"\n{tally.sent} requests in {args.minutes} min: {tally.completed} completed, {tally.abandoned} abandoned "
          f"by their clients, {len(tally.lost)} lost, {tally.server_errors} server errors")
    print(f"RSS {rss0} -> {rss1} MiB (drift {rss_drift if rss_drift is None else f'{rss_drift:+.2%}'}); "
          f"TTFT p50 {ttft0} -> {ttft1} ms; at the end: {final['kv_free_blocks']:.0f} free + "
          f"{final['kv_cached_blocks']:.0f} cached of {final['kv_total_blocks']:.0f} blocks, "
          f"{final['num_requests_running']:.0f} running")
    for name, ok in checks.items():
        print(f"  {'ok ' if ok else 'FAIL'} {name}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
