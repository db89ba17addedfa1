"""A server killed with SIGKILL mid-job and started again on the same --data-dir finishes the
job: every line answered exactly once, and the lines answered before the kill not run again;
restarted without the job's model, the lines left get error records."""

from __future__ import annotations

import io
import json
import signal
import sqlite3
import time

import httpx
import openai

from pyserve.testing import parse_metrics, start_server, stop_server

KEY = "k"
MODEL = "tiny"
LINES = 40


def serve(model, data, name: str = MODEL):
    return start_server(model, "--served-model-name", name, "--api-key", KEY, "--embedding-model", "none",
                        "--data-dir", str(data), "--max-num-seqs", "4", "--batch-max-in-flight", "4",
                        workdir=model.parent)


def killed_mid_job(model, data) -> tuple[str, int]:
    """A job of LINES lines whose server was killed once 8 or more were answered: (its id, the
    lines answered before the kill)."""
    body = [json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                        "body": {"model": MODEL, "prompt": f"line {i}:", "max_tokens": 60, "ignore_eos": True}})
            for i in range(LINES)]
    proc, base = serve(model, data)
    try:
        api = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
        f = api.files.create(file=("in.jsonl", io.BytesIO("\n".join(body).encode())), purpose="batch")
        batch = api.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
        while api.batches.retrieve(batch.id).request_counts.completed < 8:
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with sqlite3.connect(data / "batches.sqlite3") as db:  # what survived the kill
        answered_before = db.execute("SELECT COUNT(*) FROM results WHERE batch_id = ?", (batch.id,)).fetchone()[0]
    assert 8 <= answered_before < LINES
    return batch.id, answered_before


def finished(api: openai.OpenAI, batch_id: str):
    deadline = time.monotonic() + 120
    while (done := api.batches.retrieve(batch_id)).status != "completed":
        assert time.monotonic() < deadline and done.status in ("in_progress", "finalizing"), done
        time.sleep(0.1)
    return done


def test_kill_9_then_restart_answers_every_line_exactly_once(model_dirs, tmp_path):
    model, data = model_dirs["llama"], tmp_path / "data"
    batch_id, answered_before = killed_mid_job(model, data)
    proc, base = serve(model, data)
    try:
        api = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
        done = finished(api, batch_id)
        assert (done.request_counts.completed, done.request_counts.failed) == (LINES, 0)
        out = [json.loads(ln) for ln in api.files.content(done.output_file_id).text.splitlines()]
        assert sorted(r["custom_id"] for r in out) == sorted(f"c{i}" for i in range(LINES))
        assert all(r["response"]["body"]["usage"]["completion_tokens"] == 60 for r in out)
        requests = parse_metrics(httpx.get(base + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text)
        run_again = sum(v for k, v in requests.items() if k.startswith("pyserve:requests_total"))
        assert run_again == LINES - answered_before  # the answered lines were not run again
    finally:
        stop_server(proc)


def test_lines_a_restarted_server_cannot_run_get_error_records(model_dirs, tmp_path):
    """Restarted without the job's model: the lines not yet answered fail with model_not_found, one
    error record each; every line has one result."""
    model, data = model_dirs["llama"], tmp_path / "data"
    batch_id, answered_before = killed_mid_job(model, data)
    proc, base = serve(model, data, name="another")
    try:
        api = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
        done = finished(api, batch_id)
        assert (done.request_counts.completed, done.request_counts.failed) == (answered_before, LINES - answered_before)
        errors = [json.loads(ln) for ln in api.files.content(done.error_file_id).text.splitlines()]
        out = [json.loads(ln) for ln in api.files.content(done.output_file_id).text.splitlines()]
        assert sorted(r["custom_id"] for r in errors + out) == sorted(f"c{i}" for i in range(LINES))
        assert {r["error"]["code"] for r in errors} == {"model_not_found"}
    finally:
        stop_server(proc)
