"""One HTTP client against offline batch 1: what the server adds to a lone request's decode.

The 25M Llama of bench/batch1_decode.py, fp32 CPU, default settings (text output on). The same
--requests requests (16-token prompts of random ids, --tokens greedy tokens each, EOS ignored)
run one at a time:
  offline      LLM.generate, one request per call
  http         `pyserve serve` on loopback, /v1/completions without streaming, one client
  http_stream  the same with "stream": true, an httpx client reading every SSE chunk by line
  http_stream_lean  the same stream read from a plain socket, each event parsed as it arrives
  http_stream_curl  the same stream read by curl (C), timed by curl itself (time_total), the
                    tokens counted from its output afterwards (where curl is installed)
Output tokens per second over all requests; the four are interleaved --runs times after a
warm-up round (one server serves every HTTP run) and the ratios are the medians of the per-round
ratios. The client shares the machine's cores with the server: httpx's per-chunk Python costs
several percent of them, which a client on another machine would not take from the server; the
lean client takes less, curl least, so the streaming figures bracket what the server itself adds.
Goal: the HTTP ratios >= 0.95.
Writes bench/results/http_batch1.json.
"""

from __future__ import annotations

import random
import re
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import orjson

import harness
from batch1_decode import MODELS, build
from pyserve import LLM, SamplingParams
from pyserve.testing import start_server, stop_server

SERVED_NAME = "bench"


def offline(llm: LLM, prompts: list[list[int]], tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    n = sum(len(llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids) for p in prompts)
    return n / (time.perf_counter() - start)


def http(client: httpx.Client, prompts: list[list[int]], tokens: int, stream: bool) -> float:
    start = time.perf_counter()
    n = 0
    for p in prompts:
        body = {"model": SERVED_NAME, "prompt": p, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
        if not stream:
            r = client.post("/v1/completions", json=body)
            r.raise_for_status()
            n += r.json()["usage"]["completion_tokens"]
            continue
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        with client.stream("POST", "/v1/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    usage = orjson.loads(line[6:]).get("usage")
                    n += usage["completion_tokens"] if usage else 0
    return n / (time.perf_counter() - start)


SSE_EVENT = re.compile(rb"data: (.*?)\n\n")


def lean_stream(base: str, prompts: list[list[int]], tokens: int) -> float:
    """The streamed requests over a plain socket: each read's complete SSE events parsed at once
    (the HTTP chunk framing between them skipped), the tokens counted from the usage event."""
    host, port = base.removeprefix("http://").split(":")
    start = time.perf_counter()
    n = 0
    for p in prompts:
        body = orjson.dumps({"model": SERVED_NAME, "prompt": p, "max_tokens": tokens, "temperature": 0,
                             "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\nConnection: close\r\n\r\n" % (host.encode(), len(body)) + body)
            pending, done = b"", False
            while not done and (data := sock.recv(1 << 16)):
                pending += data
                end = 0
                for m in SSE_EVENT.finditer(pending):
                    end = m.end()
                    if m[1] == b"[DONE]":
                        done = True
                        break
                    usage = orjson.loads(m[1]).get("usage")
                    n += usage["completion_tokens"] if usage else 0
                pending = pending[end:]
            if not done:
                raise RuntimeError("the stream ended before [DONE]")
    return n / (time.perf_counter() - start)


def curl_stream(base: str, prompts: list[list[int]], tokens: int) -> float:
    """The streamed requests read by curl, one process each: its own clock (from the connection to
    the last byte, the process start left out), its output parsed once it has exited."""
    n, seconds = 0, 0.0
    for p in prompts:
        body = orjson.dumps({"model": SERVED_NAME, "prompt": p, "max_tokens": tokens, "temperature": 0,
                             "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
        done = subprocess.run(["curl", "-sSN", "--fail", "-H", "Content-Type: application/json", "--data-binary", "@-",
                               "-w", "\n%{time_total}", base + "/v1/completions"], input=body, capture_output=True,
                              check=True)
        events, _, total = done.stdout.rpartition(b"\n")
        seconds += float(total)
        for m in SSE_EVENT.finditer(events + b"\n"):
            if m[1] != b"[DONE]":
                usage = orjson.loads(m[1]).get("usage")
                n += usage["completion_tokens"] if usage else 0
    return n / seconds


def main() -> None:
    ap = harness.parser(__doc__, "http_batch1", runs=3)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(2, MODELS["25m"]["vocab_size"]) for _ in range(16)] for _ in range(args.requests)]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build(Path(tmp) / "25m", MODELS["25m"])
        llm = LLM(str(model_dir))
        head = harness.header(__file__)
        harness.print_header(head)
        proc, base = start_server(model_dir, "--served-model-name", SERVED_NAME, workdir=Path(tmp))
        try:
            with httpx.Client(base_url=base, timeout=600) as client:
                runs = harness.interleaved({
                    "offline": lambda: offline(llm, prompts, args.tokens),
                    "http": lambda: http(client, prompts, args.tokens, stream=False),
                    "http_stream": lambda: http(client, prompts, args.tokens, stream=True),
                    "http_stream_lean": lambda: lean_stream(base, prompts, args.tokens),
                    **({"http_stream_curl": lambda: curl_stream(base, prompts, args.tokens)}
                       if shutil.which("curl") else {}),
                }, runs=args.runs, warmup=1)
        finally:
            stop_server(proc)
            llm.close()
    report = {**head, "requests": args.requests, "tokens": args.tokens, "runs": runs,
              **{f"{k}_tokens_per_s": harness.median(v) for k, v in runs.items()},
              "http_ratio": harness.median_ratio(runs["http"], runs["offline"]),
              "http_stream_ratio": harness.median_ratio(runs["http_stream"], runs["offline"]),
              "http_stream_lean_ratio": harness.median_ratio(runs["http_stream_lean"], runs["offline"]),
              **({"http_stream_curl_ratio": harness.median_ratio(runs["http_stream_curl"], runs["offline"])}
                 if "http_stream_curl" in runs else {})}
    harness.write_report(args.out, report)
    print(f"offline {report['offline_tokens_per_s']:.1f} tok/s, http {report['http_tokens_per_s']:.1f} "
          f"({report['http_ratio']:.2f}x), http streaming {report['http_stream_tokens_per_s']:.1f} "
          f"({report['http_stream_ratio']:.2f}x), lean client {report['http_stream_lean_tokens_per_s']:.1f} "
          f"({report['http_stream_lean_ratio']:.2f}x)"
          + (f", curl {report['http_stream_curl_tokens_per_s']:.1f} ({report['http_stream_curl_ratio']:.2f}x)"
             if "http_stream_curl" in runs else ""))


if __name__ == "__main__":
    main()
