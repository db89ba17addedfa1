"""`pyserve batch`: an OpenAI Batch input file (one JSON request per line) run offline.

Each line goes through the same application as the HTTP server (in process, no sockets), so
validation and responses are identical. Requests run concurrently, submitted sorted by length so
that similar lengths batch together. A bad line becomes an error record; it never stops the batch.
There is one output line per non-blank input line, in input order: `response` is null for a line
that never reached the server (bad JSON, wrong url), else the status code and OpenAI body; `error`
is set ({code, message}) for every line that did not get a 200.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from pyserve.batches.asgi_call import post_json
from pyserve.batches.lines import duplicate
from pyserve.engine.async_engine import AsyncEngine
from pyserve.server.app import build_app
from pyserve.server.settings import ServerSettings

ALLOWED_URLS = ("/v1/chat/completions", "/v1/completions")
MAX_CONCURRENT = 1024


def _record(custom_id: Any, response: dict | None, error: dict | None) -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": response, "error": error}


def _parse(line: str) -> tuple[Any, dict | None, dict | None]:
    """(custom_id, request, error) for one input line."""
    try:
        item = json.loads(line)
    except json.JSONDecodeError as e:
        return None, None, {"code": "invalid_json", "message": f"line is not valid JSON: {e}"}
    if not isinstance(item, dict):
        return None, None, {"code": "invalid_request", "message": "line must be a JSON object"}
    custom_id = item.get("custom_id")
    if item.get("method", "POST") != "POST" or item.get("url") not in ALLOWED_URLS:
        return custom_id, None, {"code": "invalid_url",
                                 "message": f"method must be POST and url one of {', '.join(ALLOWED_URLS)}"}
    if not isinstance(item.get("body"), dict):
        return custom_id, None, {"code": "invalid_request", "message": "body must be a JSON object"}
    return custom_id, item, None


def _length(item: dict) -> int:
    body = item["body"]
    return len(json.dumps(body.get("messages") or body.get("prompt") or ""))


async def run_batch(engine: AsyncEngine, model_name: str, input_path: Path, output_path: Path) -> int:
    """Runs every line and writes one output record per input line, in input order. Returns the
    number of lines that got an error record."""
    lines = [ln for ln in input_path.read_text().splitlines() if ln.strip()]
    parsed = [_parse(ln) for ln in lines]
    seen: set = set()
    for i, (custom_id, item, error) in enumerate(parsed):  # as the server's Batch API, a custom_id names one line
        if error is None and isinstance(custom_id, str) and custom_id in seen:
            code, message = duplicate(custom_id)
            parsed[i] = (custom_id, None, {"code": code, "message": message})
        elif error is None and isinstance(custom_id, str):
            seen.add(custom_id)
    results: list[dict | None] = [None] * len(parsed)
    for i, (custom_id, item, error) in enumerate(parsed):
        if error is not None:
            results[i] = _record(custom_id, None, error)
    todo = sorted((i for i, (_, item, err) in enumerate(parsed) if err is None), key=lambda i: _length(parsed[i][1]))
    app = build_app(engine, ServerSettings(served_model_name=model_name))
    limit = asyncio.Semaphore(MAX_CONCURRENT)
    progress = _Progress(len(todo))

    async def run_one(i: int) -> None:
        custom_id, item, _ = parsed[i]
        body = dict(item["body"])
        body.setdefault("model", model_name)
        body["stream"] = False
        try:
            async with limit:
                status, payload = await post_json(app, item["url"], body, {})
        except Exception as e:  # noqa: BLE001 - one line's failure must not stop the batch
            results[i] = _record(custom_id, None, {"code": "internal_error", "message": repr(e)})
        else:
            if status == 200:
                response = {"status_code": 200, "request_id": payload.get("id"), "body": payload}
                results[i] = _record(custom_id, response, None)
            else:
                err = payload.get("error") or {}
                response = {"status_code": status, "request_id": None, "body": payload}
                results[i] = _record(custom_id, response, {"code": err.get("code") or err.get("type"),
                                                           "message": err.get("message")})
        progress.advance()

    await engine.start()
    try:
        await asyncio.gather(*(run_one(i) for i in todo))
    finally:
        await engine.stop()
    progress.close()
    with output_path.open("w") as f:
        for rec in results:
            f.write(json.dumps(rec) + "\n")
    return sum(rec["error"] is not None for rec in results)


class _Progress:
    """Whole progress lines on stderr (at most one a second, and the last one), so that they never
    split the JSON log lines that share stderr."""

    def __init__(self, total: int, every_s: float = 1.0):
        self.total, self.done, self.every_s = total, 0, every_s
        self.start = self.last = time.perf_counter()

    def advance(self) -> None:
        self.done += 1
        now = time.perf_counter()
        if now - self.last >= self.every_s and self.done < self.total:
            self.last = now
            self._print(now)

    def close(self) -> None:
        self._print(time.perf_counter())

    def _print(self, now: float) -> None:
        rate = self.done / max(now - self.start, 1e-9)
        print(f"batch: {self.done}/{self.total} requests done ({rate:.2f} req/s)", file=sys.stderr, flush=True)
