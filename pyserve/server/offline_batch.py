"""`pyserve batch`: an OpenAI Batch input file (one JSON request per line) run offline, once, by
the command (the Batch API's jobs, which the server runs in the background: pyserve/batches).

Lines are checked as the server's Batch API checks them (batches.lines: a unique string
custom_id, POST, a chat or completions url, a body naming the served model (the default) or
one of its `--lora-modules`, not streamed), then each goes through the same application as the HTTP server
(in process, no sockets), so validation and responses are identical. Requests run concurrently,
submitted sorted by length so that similar lengths batch together. A bad line becomes an error
record; it never stops the batch. There is one output line per non-blank input line, in input
order: `response` is null for a line that never reached the server, else the status code and
OpenAI body; `error` is set ({code, message}) for every line that did not get a 200.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

from pyserve.batches.asgi_call import post_json
from pyserve.batches.lines import Line, Rejected, answered_record, check_lines, error_record
from pyserve.engine.async_engine import AsyncEngine
from pyserve.server.app import build_app
from pyserve.server.settings import ServerSettings

ALLOWED_URLS = ("/v1/chat/completions", "/v1/completions")
MAX_CONCURRENT = 1024


def _length(line: Line) -> int:
    return len(json.dumps(line.body.get("messages") or line.body.get("prompt") or ""))


def read_input(input_path: Path, settings: ServerSettings) -> tuple[list[Line], list[Rejected]]:
    """The input file's lines to run, and the error records of the others (before any model
    loads); ValueError when the file cannot be a batch input (not UTF-8, no lines)."""
    served = {settings.served_model_name, *settings.lora_modules}
    return check_lines(input_path.read_bytes(), ALLOWED_URLS, served.__contains__, max_lines=sys.maxsize,
                       default_model=settings.served_model_name)


async def run_batch(engine: AsyncEngine, settings: ServerSettings, lines: tuple[list[Line], list[Rejected]],
                    output_path: Path) -> int:
    """Runs the `lines` read_input gave and writes one output record per input line, in input
    order. Returns the number of lines that got an error record."""
    good, bad = lines
    results: list[dict | None] = [None] * (len(good) + len(bad))
    for r in bad:
        results[r.number] = r.record
    app = build_app(engine, settings)
    limit = asyncio.Semaphore(MAX_CONCURRENT)
    progress = _Progress(len(good) + len(bad), done=len(bad))  # a request line with an error record is done

    async def run_one(line: Line) -> None:
        try:
            async with limit:
                status, payload = await post_json(app, line.url, line.body, {})
        except Exception as e:  # noqa: BLE001 - one line's failure must not stop the batch
            results[line.number] = error_record(line.custom_id, "internal_error", repr(e))
        else:
            results[line.number] = answered_record(line.custom_id, status, payload)
        progress.advance()

    startup = app.state.startup  # the server's own start: the engine, then the --lora-modules adapters
    await startup.run()
    try:
        await asyncio.gather(*(run_one(line) for line in sorted(good, key=_length)))
    finally:
        await startup.stop()
    progress.close()
    with output_path.open("w") as f:
        for rec in results:
            f.write(json.dumps(rec) + "\n")
    return sum(rec["error"] is not None for rec in results)


class _Progress:
    """Whole progress lines on stderr (at most one a second, and the last one), so that they never
    split the JSON log lines that share stderr."""

    def __init__(self, total: int, done: int = 0, every_s: float = 1.0):
        self.total, self.done, self.every_s = total, done, every_s
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
