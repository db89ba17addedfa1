"""`pyserve batch`: an OpenAI Batch input file (one JSON request per line) run offline.

Each line goes through the same application as the HTTP server (in process, no sockets), so
validation and responses are identical. Requests run concurrently, submitted sorted by length so
that similar lengths batch together. A bad line becomes
an error record; it never stops the batch. Output lines keep the input order.
"""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from pathlib import Path
from typing import Any

import httpx

from pyserve.engine.async_engine import AsyncEngine
from pyserve.server.app import build_app
from pyserve.server.state import ServerSettings

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


async def run_batch(engine: AsyncEngine, model_name: str, input_path: Path, output_path: Path) -> None:
    lines = [ln for ln in input_path.read_text().splitlines() if ln.strip()]
    parsed = [_parse(ln) for ln in lines]
    results: list[dict | None] = [None] * len(parsed)
    for i, (custom_id, item, error) in enumerate(parsed):
        if error is not None:
            results[i] = _record(custom_id, None, error)
    app = build_app(engine, ServerSettings(served_model_name=model_name))
    await engine.start()
    limit = asyncio.Semaphore(MAX_CONCURRENT)
    done = 0

    async def run_one(client: httpx.AsyncClient, i: int) -> None:
        nonlocal done
        custom_id, item, _ = parsed[i]
        body = dict(item["body"])
        body.setdefault("model", model_name)
        body["stream"] = False
        async with limit:
            resp = await client.post(item["url"], json=body)
        payload = resp.json()
        if resp.status_code == 200:
            results[i] = _record(custom_id, {"status_code": 200, "request_id": payload.get("id"), "body": payload},
                                 None)
        else:
            err = payload.get("error", {})
            results[i] = _record(custom_id, {"status_code": resp.status_code, "request_id": None, "body": payload},
                                 {"code": err.get("type"), "message": err.get("message")})
        done += 1
        print(f"\rbatch: {done}/{len(todo)} requests", end="", file=sys.stderr, flush=True)

    todo = sorted((i for i, (_, item, err) in enumerate(parsed) if err is None), key=lambda i: _length(parsed[i][1]))
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://pyserve.batch", timeout=None) as client:
            await asyncio.gather(*(run_one(client, i) for i in todo))
    finally:
        await engine.stop()
    print(file=sys.stderr)
    with output_path.open("w") as f:
        for rec in results:
            f.write(json.dumps(rec) + "\n")
