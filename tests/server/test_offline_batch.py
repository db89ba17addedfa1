"""`pyserve batch`: an OpenAI Batch input file run as a real subprocess, good and bad lines mixed."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import httpx
import pytest

from pyserve.testing import start_server, stop_server

PICK = {"type": "object", "properties": {"c": {"enum": ["x", "y"]}}, "required": ["c"], "additionalProperties": False}
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def engine_flags() -> list[str]:
    return ["--block-size", "4", "--num-kv-blocks", "512"]


@pytest.fixture(scope="module")
def batch_run(model_dirs, tmp_path_factory):
    """Runs one batch file on the tiny llama (served name: the directory's basename, "llama")."""
    model_dir = model_dirs["llama"]
    name = model_dir.name
    greedy_chat = {"messages": [{"role": "user", "content": "def add(a, b):"}], "max_tokens": 8, "temperature": 0}
    greedy_cmpl = {"model": name, "prompt": "for i in", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    lines = [
        line("chat-greedy", CHAT, greedy_chat),
        line("cmpl-text", COMPLETIONS, greedy_cmpl),
        '{"custom_id": "broken", "method": "POST", "url": ',
        line("chat-sampled", CHAT, {"model": name, "messages": [{"role": "system", "content": "be brief"},
                                                                 {"role": "user", "content": "class Point:"}],
                                    "max_tokens": 5, "temperature": 0.7, "seed": 3, "n": 2}),
        line("embed", "/v1/embeddings", {"model": name, "input": "hello"}),
        line("chat-long", CHAT, {"messages": [{"role": "user", "content": "import os\nimport sys\n" * 6}],
                                 "max_tokens": 7, "temperature": 0, "stream": True}),
        line("cmpl-ids", COMPLETIONS, {"prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0,
                                       "ignore_eos": True}),
        line("bad-temp", CHAT, {"messages": [{"role": "user", "content": "x"}], "temperature": 9}),
        line("bad-model", COMPLETIONS, {"model": "other", "prompt": "x"}),
        line("chat-json", CHAT, {"messages": [{"role": "user", "content": "pick"}], "max_tokens": 40,
                                 "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": PICK}}}),
        line("cmpl-choice", COMPLETIONS, {"prompt": "x", "max_tokens": 9, "structured_outputs": {"choice": ["red", "green"]}}),
        line("bad-regex", COMPLETIONS, {"prompt": "x", "structured_outputs": {"regex": "(a"}}),
        line("cmpl-ids", COMPLETIONS, {"prompt": [9], "max_tokens": 1}),  # a custom_id used twice
    ]
    tmp = tmp_path_factory.mktemp("batch")
    src, dst = tmp / "in.jsonl", tmp / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    cmd = [sys.executable, "-m", "pyserve.cli", "batch", str(model_dir), "--input", str(src), "--output", str(dst),
           *engine_flags()]
    start = time.perf_counter()
    # Run outside the repository, so the installed package (with its native module) is imported.
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp)
    elapsed = time.perf_counter() - start
    records = [json.loads(x) for x in dst.read_text().splitlines()] if dst.exists() else []
    return dict(proc=proc, records=records, n_lines=len(lines), name=name, elapsed=elapsed,
                greedy={"chat-greedy": (CHAT, greedy_chat), "cmpl-text": (COMPLETIONS, greedy_cmpl)})


def by_id(records: list[dict]) -> dict:
    """Each custom_id's record (its first line's, where a line repeats one)."""
    out: dict = {}
    for r in records:
        out.setdefault(r["custom_id"], r)
    return out


def test_batch_exits_zero_with_one_record_per_line_in_order(batch_run):
    proc = batch_run["proc"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = batch_run["records"]
    assert len(records) == batch_run["n_lines"]
    assert [r["custom_id"] for r in records] == ["chat-greedy", "cmpl-text", None, "chat-sampled", "embed",
                                                "chat-long", "cmpl-ids", "bad-temp", "bad-model", "chat-json",
                                                "cmpl-choice", "bad-regex", "cmpl-ids"]
    assert len({r["id"] for r in records}) == len(records)
    assert all(r["id"].startswith("batch_req_") for r in records)


def test_batch_valid_lines_get_200_bodies_with_choices_and_usage(batch_run):
    recs = by_id(batch_run["records"])
    for cid, obj, n in [("chat-greedy", "chat.completion", 1), ("cmpl-text", "text_completion", 1),
                        ("chat-sampled", "chat.completion", 2), ("cmpl-ids", "text_completion", 1)]:
        rec = recs[cid]
        assert rec["error"] is None, cid
        resp = rec["response"]
        assert resp["status_code"] == 200, cid
        body = resp["body"]
        assert resp["request_id"] == body["id"] and body["object"] == obj, cid
        assert body["model"] == batch_run["name"], cid
        assert sorted(c["index"] for c in body["choices"]) == list(range(n)), cid
        usage = body["usage"]
        assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0, cid
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"], cid
    assert recs["cmpl-text"]["response"]["body"]["usage"]["completion_tokens"] == 6
    assert recs["cmpl-text"]["response"]["body"]["choices"][0]["finish_reason"] == "length"
    assert recs["cmpl-ids"]["response"]["body"]["usage"] == {"prompt_tokens": 4, "completion_tokens": 4,
                                                             "total_tokens": 8,
                                                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_batch_bad_lines_get_error_records(batch_run):
    recs = batch_run["records"]
    broken = recs[2]
    assert broken["response"] is None and broken["error"]["code"] == "invalid_json" and broken["error"]["message"]
    embed = by_id(recs)["embed"]
    assert embed["response"] is None and embed["error"]["code"] == "invalid_url"
    assert "/v1/chat/completions" in embed["error"]["message"]
    bad_temp = by_id(recs)["bad-temp"]
    assert bad_temp["response"]["status_code"] == 400
    err = bad_temp["response"]["body"]["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == "temperature"
    assert bad_temp["error"]["code"] == "invalid_request_error" and "temperature" in bad_temp["error"]["message"]
    twice = recs[-1]
    assert twice["response"] is None and twice["error"]["code"] == "duplicate_custom_id"
    # Checked as the Batch API checks a line, before it runs: a model not served, a streamed line.
    bad_model = by_id(recs)["bad-model"]
    assert bad_model["response"] is None and bad_model["error"]["code"] == "model_not_found"
    assert "'other' is not served" in bad_model["error"]["message"]
    streamed = by_id(recs)["chat-long"]
    assert streamed["response"] is None and streamed["error"]["code"] == "invalid_request"
    assert "body.stream" in streamed["error"]["message"]


def test_batch_lines_with_constraints(batch_run):
    recs = by_id(batch_run["records"])
    content = recs["chat-json"]["response"]["body"]["choices"][0]["message"]["content"]
    assert json.loads(content)["c"] in ("x", "y")
    assert recs["cmpl-choice"]["response"]["body"]["choices"][0]["text"] in ("red", "green")
    bad = recs["bad-regex"]["response"]
    assert bad["status_code"] == 400 and bad["body"]["error"]["param"] == "structured_outputs"


def test_batch_reports_progress_on_stderr(batch_run):
    stderr = batch_run["proc"].stderr
    assert re.search(r"^batch: 13/13 requests done", stderr, re.M), stderr[-2000:]  # every request line, bad ones too
    assert "(7 lines with errors)" in stderr
    # the JSON log lines that share stderr stay whole
    for ln in stderr.splitlines():
        if ln.startswith("{"):
            json.loads(ln)


def test_batch_greedy_results_equal_the_http_server(batch_run, model_dirs, tmp_path):
    proc, base = start_server(model_dirs["llama"], *engine_flags(), workdir=tmp_path)
    try:
        recs = by_id(batch_run["records"])
        for cid, (url, body) in batch_run["greedy"].items():
            http = httpx.post(base + url, json={"model": batch_run["name"], **body}, timeout=60).json()
            batched = recs[cid]["response"]["body"]
            assert batched["choices"] == http["choices"], cid
            assert batched["usage"]["completion_tokens"] == http["usage"]["completion_tokens"], cid
    finally:
        stop_server(proc)


@pytest.mark.asyncio
async def test_batch_engine_death_writes_503_records_for_every_request(llama_dir, tmp_path):
    from pyserve.engine.async_engine import AsyncEngine
    from pyserve.config import EngineConfig
    from pyserve.server.offline_batch import read_input, run_batch
    from pyserve.server.settings import ServerSettings

    engine = AsyncEngine(EngineConfig(model=str(llama_dir), block_size=4, num_kv_blocks=512))

    def device_lost(out, rows, *rest):
        raise RuntimeError("device lost")

    engine.worker.execute = device_lost
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join([line(f"c{i}", COMPLETIONS, {"prompt": "x" * (i + 1), "max_tokens": 3})
                              for i in range(4)] + ["not json"]) + "\n")
    settings = ServerSettings(served_model_name="m")
    num_errors = await run_batch(engine, settings, read_input(src, settings), dst)
    records = [json.loads(x) for x in dst.read_text().splitlines()]
    assert num_errors == 5 and [r["custom_id"] for r in records] == ["c0", "c1", "c2", "c3", None]
    for r in records[:4]:
        assert r["response"]["status_code"] == 503
        assert r["error"]["code"] == "service_unavailable" and "device lost" in r["error"]["message"]
    assert engine.system.error is not None  # what `pyserve batch` turns into a non-zero exit


def test_batch_serves_its_lora_modules_and_refuses_a_file_that_is_no_input(tmp_path):
    """Lines may name an adapter given with --lora-modules; a file that is not UTF-8 stops the
    command before the model loads, naming --input."""
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    body = {"prompt": "def f(x):", "max_tokens": 3, "temperature": 0}
    src.write_text("\n".join([line("base", COMPLETIONS, body),
                               line("adapter", COMPLETIONS, {**body, "model": "docstrings"})]))
    run = subprocess.run([sys.executable, "-m", "pyserve.cli", "batch", "--input", str(src), "--output", str(dst),
                          "--lora-modules", "docstrings"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    records = {r["custom_id"]: r for r in map(json.loads, dst.read_text().splitlines())}
    assert records["base"]["response"]["body"]["model"] == "pyserve-default"
    assert records["adapter"]["response"]["body"]["model"] == "docstrings"
    src.write_bytes(b"\xff\xfe not text")
    run = subprocess.run([sys.executable, "-m", "pyserve.cli", "batch", "--input", str(src), "--output", str(dst)],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode != 0 and "pyserve batch: --input: the file is not UTF-8" in run.stderr
    assert "engine_loaded" not in run.stderr  # refused before the model loaded


def test_batch_reads_a_line_with_unicode_separators_as_one_request(tmp_path):
    """`pyserve batch` reads lines as the Batch API does: U+2028, U+2029 and U+0085 written raw
    (json.dumps(ensure_ascii=False), JSON.stringify) stay inside their line."""
    from pyserve.server.offline_batch import read_input
    from pyserve.server.settings import ServerSettings

    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": COMPLETIONS,
                                         "body": {"prompt": f"x{sep}y"}}, ensure_ascii=False)
                             for i, sep in enumerate("\u2028\u2029\u0085")) + "\n", encoding="utf-8")
    good, bad = read_input(src, ServerSettings(served_model_name="m"))
    assert bad == []
    assert [(g.custom_id, g.body) for g in good] == [("c0", {"prompt": "x\u2028y", "model": "m"}),
                                                     ("c1", {"prompt": "x\u2029y", "model": "m"}),
                                                     ("c2", {"prompt": "x\u0085y", "model": "m"})]
