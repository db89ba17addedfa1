"""Runs batch jobs beside interactive traffic, one job at a time, oldest first.

Each line is a request to this same server, in process (through its app: the same validation and
answers as over HTTP), at the scheduler's background priority (BACKGROUND_PRIORITY): interactive
requests are scheduled first, a step that computes an interactive prompt runs no batch line, and
batch lines give up their KV blocks and seats to interactive requests, and while interactive
requests run (and for a second after) a step runs only a few batch lines (engine/background.py).
At most `max_in_flight` lines are in the engine at once. Lines are sent grouped by how their
prompt begins, so that lines sharing a prefix run together (one prefill, then prefix-cache hits),
and by length within a group, so similar lengths batch together. The input file is read, checked
and ordered on a thread, so that the loop keeps serving through a large one.

Status moves as OpenAI documents: validating -> in_progress -> finalizing -> completed; failed
when the file cannot be a batch input; cancelling -> cancelled; expired past the completion
window (the lines answered by then are kept). A restart carries on from the stored rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable

import structlog

from pyserve.batches.asgi_call import post_json
from pyserve.batches.lines import Line, Rejected, answered_record, check_lines, error_record, tokens_used
from pyserve.batches.store import BatchStore

log = structlog.get_logger("pyserve.batches")

POLL_SECONDS = 0.2  # how often an idle runner looks for work, and a running one for cancels and expiry
PREFIX_CHARS = 256  # lines whose prompts begin alike (a shared system prompt) are sent together
MAX_LISTED_ERRORS = 100  # line errors a job that fails validation lists


class BatchRunner:
    def __init__(self, store: BatchStore, app, internal_headers: dict[str, str], model_served: Callable[[str], bool],
                 max_in_flight: int, max_lines: int):
        self.store, self.app, self.headers = store, app, internal_headers
        self.model_served, self.max_in_flight, self.max_lines = model_served, max_in_flight, max_lines
        self.wake = asyncio.Event()  # set when a job is created or cancelled
        self._task: asyncio.Task | None = None
        from pyserve._core import BACKGROUND_PRIORITY  # with the engine, not with the server's modules

        # Background work for the scheduler: after every other request, and never in a step that
        # computes another request's prompt (interactive requests default to priority 0).
        self.priority = BACKGROUND_PRIORITY

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="pyserve-batches")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            jobs = self.store.active_batches()
            for _, batch in jobs:
                try:
                    await self._carry_on(batch)
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # noqa: BLE001 - one job's fault must not stop the others
                    log.error("batch_failed", batch_id=batch["id"], error=repr(e))
                    self._set(batch, "failed", errors=_errors("internal_error", repr(e)))
            if not jobs:
                self.wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.wake.wait(), POLL_SECONDS * 5)

    def _set(self, batch: dict, status: str, **fields) -> None:
        batch.update(fields, status=status)
        batch[f"{status}_at"] = int(time.time())
        self.store.save_batch(batch)
        log.info("batch_status", batch_id=batch["id"], status=status)

    async def _carry_on(self, batch: dict) -> None:
        batch = self.store.batch(batch["id"])  # as it stands now (a cancel may have come meanwhile)
        if batch["status"] in ("validating", "in_progress"):
            # On a thread: reading and checking a large file takes seconds the loop serves through.
            checked = await asyncio.to_thread(self._read_lines, batch)
            batch = self.store.batch(batch["id"])  # a cancel may have come while they were read
            if batch["status"] in ("validating", "in_progress"):
                await self._run_lines(batch, *checked)
        if batch["status"] == "cancelling":
            self._finish(batch, "cancelled")
        elif batch["status"] == "finalizing":
            self._finish(batch, "expired" if time.time() >= batch["expires_at"] else "completed")

    def _read_lines(self, batch: dict) -> tuple[list[Line], list[Rejected], str | None]:
        """(the lines to run, in the order they are sent; the others; why the file cannot be a batch
        input, or None). Touches no row of the store: it runs on a thread."""
        try:
            good, bad = check_lines(self.store.content(batch["input_file_id"]), (batch["endpoint"],),
                                    self.model_served, self.max_lines)
        except ValueError as e:
            return [], [], str(e)
        return sorted(good, key=_order), bad, None

    async def _run_lines(self, batch: dict, good: list[Line], bad: list[Rejected], problem: str | None) -> None:
        """After the check: the job fails (a file that is no input, no line to run), or its rejected
        lines are recorded and the others run until it finalizes, is cancelled or expires."""
        if problem is not None:  # only while validating: a job in progress passed these checks
            self._set(batch, "failed", errors=_errors("invalid_file", problem, "input_file_id"))
            return
        if batch["status"] == "validating" and not good:  # as OpenAI's: a file with no line to run fails
            self._set(batch, "failed", errors={"object": "list", "data": [
                {**r.record["error"], "param": None, "line": r.line} for r in bad[:MAX_LISTED_ERRORS]]})
            return
        # Resumed after a restart, a line can fail a check it passed (its model no longer
        # served): it gets its error record too, unless it was answered before.
        for r in bad:
            self.store.add_result(batch["id"], r.number, False, r.record)
        if batch["status"] == "validating":
            batch["request_counts"]["total"] = len(good) + len(bad)
            batch["model"] = ", ".join(sorted({line.body["model"] for line in good}))  # joined if several
            self._set(batch, "in_progress")
        await self._answer(batch, good)
        if not self._should_stop(batch):  # every line answered
            self._set(batch, "finalizing")
        if batch["status"] == "finalizing" and time.time() >= batch["expires_at"]:
            # As OpenAI's: each line the window closed on gets an error record.
            answered = self.store.answered(batch["id"])
            for line in good:
                if line.number not in answered:
                    self.store.add_result(batch["id"], line.number, False, error_record(
                        line.custom_id, "batch_expired", "the completion window ended before this line ran"))

    async def _answer(self, batch: dict, good: list[Line]) -> None:
        """Runs the job's unanswered lines of `good`, in its order, until none is left, the job is
        cancelled or it expires (then the lines in flight are abandoned: they run again if the job is
        ever resumed)."""
        done = self.store.answered(batch["id"])
        todo = [ln for ln in good if ln.number not in done]
        owner = self.store.owner(batch["id"])  # each line runs as the job's tenant (the semantic cache's scope)
        in_flight: set[asyncio.Task] = set()
        room = asyncio.Semaphore(self.max_in_flight)
        checked = time.monotonic()

        def finished(task: asyncio.Task) -> None:
            in_flight.discard(task)
            room.release()

        try:
            for line in todo:
                # A cancel or the window's end is looked for every POLL_SECONDS, also while waiting.
                while not await _take(room):
                    if self._should_stop(batch):
                        return
                if time.monotonic() - checked >= POLL_SECONDS:
                    checked = time.monotonic()
                    if self._should_stop(batch):
                        room.release()
                        return
                task = asyncio.create_task(self._one(batch, line, owner))
                in_flight.add(task)
                task.add_done_callback(finished)
            while in_flight:
                await asyncio.wait(in_flight, timeout=POLL_SECONDS)
                if self._should_stop(batch):
                    return
        finally:  # stopped, cancelled or the server shutting down: the lines in flight are abandoned
            for task in in_flight:
                task.cancel()
            if in_flight:
                await asyncio.wait(in_flight)

    def _should_stop(self, batch: dict) -> bool:
        """A cancel (the stored status says so) or the window's end."""
        stored = self.store.batch(batch["id"])
        if stored["status"] == "cancelling":
            batch.update(status="cancelling", cancelling_at=stored["cancelling_at"])
            return True
        if time.time() >= batch["expires_at"]:
            self._set(batch, "finalizing")
            return True
        return False

    async def _one(self, batch: dict, line: Line, owner: str) -> None:
        body = {**line.body, "priority": self.priority}
        try:
            status, payload = await post_json(self.app, line.url, body, self.headers, tenant=owner)
        except Exception as e:  # noqa: BLE001 - recorded as the line's error
            self.store.add_result(batch["id"], line.number, False, error_record(line.custom_id, "internal_error",
                                                                                repr(e)))
            return
        record = answered_record(line.custom_id, status, payload)
        self.store.add_result(batch["id"], line.number, status == 200, record, tokens_used(payload))

    def _finish(self, batch: dict, status: str) -> None:
        """Writes the output and error files from the stored rows, then the final status."""
        owner = self.store.owner(batch["id"])
        for ok, field, name in ((True, "output_file_id", "output"), (False, "error_file_id", "errors")):
            rows = self.store.results(batch["id"], ok)
            if rows and batch.get(field) is None:
                record = self.store.add_file(owner, "batch_output", f"{batch['id']}_{name}.jsonl",
                                             ("\n".join(rows) + "\n").encode())
                batch[field] = record.id
        self._set(batch, status)


async def _take(room: asyncio.Semaphore) -> bool:
    """Takes a place in `room`; False when none came free within POLL_SECONDS."""
    if not room.locked():
        await room.acquire()
        return True
    try:
        await asyncio.wait_for(room.acquire(), POLL_SECONDS)
    except TimeoutError:
        return False
    return True


def _order(line: Line) -> tuple[str, int]:
    """Lines sharing the first PREFIX_CHARS of their prompt together, shortest first among them."""
    body = line.body
    text = json.dumps(body.get("messages") if "messages" in body else body.get("prompt"))
    return text[:PREFIX_CHARS], len(text)


def _errors(code: str, message: str, param: str | None = None) -> dict:
    return {"object": "list", "data": [{"code": code, "message": message, "param": param, "line": None}]}
