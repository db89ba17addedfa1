"""The Batch API's routes and runner in the test's own event loop, over a stand-in for the
server's chat route (no engine): what a job's lines become and what its batch object reports."""

from __future__ import annotations

import asyncio
import gc
import contextlib
import io
import json
import threading
import time
from types import SimpleNamespace

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from pyserve.batches.lines import check_lines
from pyserve.server.batch_routes import cancel_batch, create_batch, file_content, retrieve_batch, upload_file
from pyserve.batches.runner import BatchRunner
from pyserve.batches.service import BatchService
from pyserve.batches.store import BatchStore
from pyserve.http.errors import EXCEPTION_HANDLERS

URL = "/v1/chat/completions"
MODEL = "m"
DONE = ("completed", "failed", "cancelled", "expired")


async def chat(request: Request) -> JSONResponse:
    """A chat answer whose usage is read off the request: prompt_tokens the characters of the
    message, completion_tokens its max_tokens, 1 cached token, 1 reasoning token."""
    body = await request.json()
    prompt, completion = len(body["messages"][0]["content"]), body["max_tokens"]
    return JSONResponse({"id": f"chatcmpl-{prompt}", "object": "chat.completion", "model": body["model"],
                         "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"},
                                      "finish_reason": "length"}],
                         "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                                   "total_tokens": prompt + completion, "prompt_tokens_details": {"cached_tokens": 1},
                                   "completion_tokens_details": {"reasoning_tokens": 1}}})


def line(custom_id: str, content: str = "hello", max_tokens: int = 3, **body) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": URL, "body": {
        "model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, **body}})


@contextlib.asynccontextmanager
async def batch_api(data_dir, model_served=MODEL.__eq__):
    """A client of the files and batches routes, their runner started over `chat`."""
    app = Starlette(routes=[Route(URL, chat, methods=["POST"]), Route("/v1/files", upload_file, methods=["POST"]),
                            Route("/v1/files/{file_id}/content", file_content, methods=["GET"]),
                            Route("/v1/batches", create_batch, methods=["POST"]),
                            Route("/v1/batches/{batch_id}", retrieve_batch, methods=["GET"]),
                            Route("/v1/batches/{batch_id}/cancel", cancel_batch, methods=["POST"])],
                    exception_handlers=EXCEPTION_HANDLERS)
    store = BatchStore(data_dir)
    runner = BatchRunner(store, app, {}, model_served, max_in_flight=4, max_lines=1_000_000)
    app.state.pyserve = SimpleNamespace(batches=BatchService(store, runner, max_file_bytes=64 << 20))
    runner.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            yield http
    finally:
        await runner.stop()
        store.close()


async def create_job(http: httpx.AsyncClient, text: str | io.BytesIO) -> dict:
    """The batch object of a new job over `text` (a file object is sent in chunks)."""
    upload = await http.post("/v1/files", data={"purpose": "batch"},
                             files={"file": ("in.jsonl", text.encode() if isinstance(text, str) else text)})
    created = await http.post("/v1/batches", json={"input_file_id": upload.json()["id"], "endpoint": URL,
                                                   "completion_window": "24h"})
    return created.json()


async def run_job(http: httpx.AsyncClient, text: str | io.BytesIO) -> tuple[dict, list[dict], list[dict]]:
    """(the finished batch object, its output records, its error records) of a job over `text`."""
    return await finished(http, await create_job(http, text))


async def finished(http: httpx.AsyncClient, batch: dict) -> tuple[dict, list[dict], list[dict]]:
    """(`batch` once it has ended, its output records, its error records)."""
    while batch["status"] not in DONE:
        await asyncio.sleep(0.02)
        batch = (await http.get(f"/v1/batches/{batch['id']}")).json()

    async def records(file_id: str | None) -> list[dict]:
        if file_id is None:
            return []
        return [json.loads(ln) for ln in (await http.get(f"/v1/files/{file_id}/content")).text.splitlines()]

    return batch, await records(batch["output_file_id"]), await records(batch["error_file_id"])


async def test_a_line_nested_3000_deep_gets_an_error_record_and_the_rest_run(tmp_path):
    deep = '{"custom_id": "deep", "method": "POST", "url": "/v1/chat/completions", "body": ' + "[" * 3000 + \
           "]" * 3000 + "}"
    async with batch_api(tmp_path) as http:
        batch, out, errors = await run_job(http, "\n".join([line("a"), deep, line("b")]))
    assert (batch["status"], batch["request_counts"]) == ("completed", {"total": 3, "completed": 2, "failed": 1})
    assert [r["custom_id"] for r in out] == ["a", "b"]
    assert [(r["custom_id"], r["error"]["code"]) for r in errors] == [(None, "invalid_json")]
    assert "depth limit exceeded" in errors[0]["error"]["message"]


async def test_an_escaped_lone_surrogate_is_an_invalid_json_record_not_an_internal_error(tmp_path):
    """Refused as the server refuses such a body over HTTP, before it is sent."""
    async with batch_api(tmp_path) as http:
        batch, out, errors = await run_job(http, "\n".join([line("a"), line("lone", content="x\ud800y"), line("b")]))
    assert '"x\\ud800y"' in line("lone", content="x\ud800y")  # the escape, as json.dumps writes it
    assert (batch["status"], batch["request_counts"]) == ("completed", {"total": 3, "completed": 2, "failed": 1})
    assert [r["custom_id"] for r in out] == ["a", "b"]
    assert [(r["custom_id"], r["error"]["code"]) for r in errors] == [(None, "invalid_json")]
    assert errors[0]["error"]["message"].startswith("line 2 is not valid JSON: no low surrogate in string")


async def test_a_body_nested_deeper_than_a_line_can_be_sent_is_an_error_record_naming_the_field(tmp_path):
    metadata: dict = {"k": "v"}
    for _ in range(399):  # 400 objects deep
        metadata = {"k": metadata}
    async with batch_api(tmp_path) as http:
        batch, out, errors = await run_job(http, "\n".join([line("a"), line("deep", metadata=metadata)]))
    assert (batch["status"], batch["request_counts"]) == ("completed", {"total": 2, "completed": 1, "failed": 1})
    assert [r["custom_id"] for r in out] == ["a"]
    assert [(r["custom_id"], r["response"], r["error"]) for r in errors] == [("deep", None, {
        "code": "invalid_request",
        "message": "body.metadata: nested more than 254 objects and arrays deep (the body counted), deeper than a "
                   "batch line is sent"})]


async def test_errors_name_the_line_of_the_file_blank_lines_counted(tmp_path):
    """A job with no line to run fails listing its lines' errors, by their line in the file."""
    text = "\n".join(["", "{oops", "", "  ", line("u").replace(URL, "/v1/embeddings"), ""])
    async with batch_api(tmp_path) as http:
        batch, _, _ = await run_job(http, text)
    assert batch["status"] == "failed"
    assert [(e["line"], e["code"]) for e in batch["errors"]["data"]] == [(2, "invalid_json"), (5, "invalid_url")]
    assert batch["errors"]["data"][0]["message"].startswith("line 2 is not valid JSON")


async def test_the_loop_keeps_serving_while_a_large_file_is_uploaded_and_validated(tmp_path):
    """A 6 MB file of lines naming a model not served, uploaded in 64 KiB chunks as over HTTP: a job
    that fails validation (no line to run). A timer wakes every 5 ms meanwhile; its longest wait,
    the loop's longest stall, stays well under the time the check itself takes (on the loop, the
    stall is all of it: 1.05x measured; off it ~0.15x). The check is timed before and after the
    job and the longer taken, so that a busy machine slows both sides alike."""
    n = 40_000
    content = "\n".join(line(f"c{i}", content="x" * 60, model="other") for i in range(n)).encode()
    assert len(content) > 6_000_000
    began = time.perf_counter()
    good, bad = check_lines(content, (URL,), MODEL.__eq__, max_lines=n)
    check_s = time.perf_counter() - began
    assert (len(good), len(bad)) == (0, n)
    del good, bad
    gc.collect()  # the objects earlier tests left: a full collection of them on the loop is not the check's stall
    stalls: list[float] = []

    async def tick() -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            stalls.append(now - last)
            last = now

    async with batch_api(tmp_path) as http:
        ticker = asyncio.create_task(tick())
        batch, _, _ = await run_job(http, io.BytesIO(content))
        ticker.cancel()
    began = time.perf_counter()
    check_lines(content, (URL,), MODEL.__eq__, max_lines=n)
    check_s = max(check_s, time.perf_counter() - began)
    assert batch["status"] == "failed" and len(batch["errors"]["data"]) == 100
    assert {(e["code"], e["message"]) for e in batch["errors"]["data"]} == {
        ("model_not_found", "body.model: 'other' is not served here")}
    assert max(stalls) < 0.6 * check_s, (max(stalls), check_s)


async def test_a_job_cancelled_while_its_file_is_checked_ends_cancelled(tmp_path):
    checking, release = threading.Event(), threading.Event()

    def model_served(model: str) -> bool:  # the check, on its thread, waits for the cancel
        checking.set()
        release.wait(10)
        return model == MODEL

    async with batch_api(tmp_path, model_served) as http:
        batch = await create_job(http, line("a"))
        assert await asyncio.to_thread(checking.wait, 10)
        cancelling = (await http.post(f"/v1/batches/{batch['id']}/cancel")).json()
        release.set()
        batch, out, errors = await finished(http, batch)
    assert cancelling["status"] == "cancelling"
    assert (batch["status"], batch["request_counts"], out, errors) == (
        "cancelled", {"total": 0, "completed": 0, "failed": 0}, [], [])


async def test_the_batch_names_its_model_and_sums_the_usage_of_its_completed_lines(tmp_path):
    """OpenAI's shape: the model the lines name; input, cached, output and reasoning tokens summed
    over the lines answered with a 200 (not the 500, nor the line that never ran)."""
    text = "\n".join([line("a", content="hello", max_tokens=3), line("b", content="hi there", max_tokens=5),
                      line("broken", max_tokens="x"), line("other", model="other")])
    async with batch_api(tmp_path) as http:
        batch, out, errors = await run_job(http, text)
    assert [r["custom_id"] for r in out] == ["a", "b"]
    assert [(r["custom_id"], r["response"] and r["response"]["status_code"]) for r in errors] == [
        ("broken", 500), ("other", None)]
    assert batch["model"] == MODEL
    assert batch["usage"] == {"input_tokens": 13, "input_tokens_details": {"cached_tokens": 2}, "output_tokens": 8,
                              "output_tokens_details": {"reasoning_tokens": 2}, "total_tokens": 21}
