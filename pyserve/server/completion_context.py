"""One HTTP completion request while it runs: its engine streams merged into (choice, delta)
events, served as SSE chunks or one final body (read as its endpoint's body reads: ChatBody or
TextBody), with its timings, metrics and log line. A client that disconnects, streaming or not,
gets its sequences aborted at once (freeing their blocks)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import structlog
from starlette.requests import Request
from starlette.responses import Response

from pyserve.engine.output_processor import ClientTooSlow, ConstraintFailed, RequestStream, StreamDelta
from pyserve.http import sse
from pyserve.http.errors import APIError, BadRequest, Unavailable, error_body
from pyserve.http.responses import json_response
from pyserve.lora.request import LoRARequest
from pyserve.prompt_budget import Diet
from pyserve.server.chat_body import ChatBody
from pyserve.server.completion_result import CompletionResult
from pyserve.server.models import ServedModel
from pyserve.server.schemas import SamplingFields
from pyserve.server.state import ServerState
from pyserve.server.text_body import TextBody

log = structlog.get_logger("pyserve.server")
REQUEST_ID_HEADER = "x-pyserve-request-id"  # the id of the request's `request_finished` log line


class CompletionContext:
    """One HTTP request's engine requests, timings and response building."""

    def __init__(self, shape: ChatBody | TextBody, base_id: str, req: SamplingFields, prompts: list[list[int]],
                 state: ServerState, model: ServedModel, arrival: float, created: int, lora: LoRARequest | None,
                 echo_only: bool = False, cache_status: str | None = None,
                 on_done: Callable[[CompletionResult], None] | None = None, diet: Diet | None = None):
        """`model` (with `lora`, when an adapter serves it) answers the request; `shape` builds its
        chunks and body; `echo_only`: nothing generated is returned (nor counted in its usage);
        `cache_status`: the semantic cache's word on it (miss / bypass); `on_done`: told the
        result of a request that finished; `diet`: what the prompt budget removed (its usage
        and a header say)."""
        self.shape, self.id, self.req, self.prompts, self.state = shape, base_id, req, prompts, state
        self.model, self.engine = model, model.engine
        self.model_name = model.name if lora is None else lora.lora_name  # the response's `model`
        self.echo_only = echo_only
        self.arrival, self.created = arrival, created
        self.lora = lora
        state.metrics.requests.inc(model=model.name, adapter="" if lora is None else lora.lora_name)
        if lora is not None:
            model.loras.started(lora.lora_name)
            state.metrics.lora_requests.inc(adapter=lora.lora_name)
        self.streams: list[RequestStream] = []
        self.first_token: float | None = None
        self.last_token: dict[int, float] = {}
        self.outcome = "ok"
        self.ended = False  # by end(): its failure is the server's stopping, not the engine's
        self._logged = False
        state.answering.add(self)
        self.cache_status = cache_status
        self.on_done = on_done
        self.diet = diet

    def headers(self) -> dict[str, str]:
        """The response's pyserve headers: the id its log lines carry (`request_finished`'s
        request_id; the Responses API passes it on under its own ids), the cache's answer, the
        prompt budget's policy."""
        out = {REQUEST_ID_HEADER: self.id}
        if self.cache_status is not None:
            out["x-pyserve-cache"] = self.cache_status
        if self.diet is not None:
            out["x-pyserve-prompt-policy"] = self.diet.policy
        return out

    def end(self, reason: str) -> None:
        """Ends the request now (the server stops): its engine requests aborted and its streams
        failed with `reason`, which its answer (a 503, or a stream's error event) says."""
        self.ended = True
        self.abort(self.streams)
        for stream in self.streams:
            stream.fail(RuntimeError(reason))

    def _failure(self, error: Exception) -> str:
        """The outcome of a request its engine requests failed."""
        if self.ended:
            return "shutdown"
        return "engine_dead" if isinstance(error, Unavailable) else "error"

    def ended_unstarted(self, outcome: str) -> None:
        """The request ends before its engine requests were all added (refused, cancelled, or the
        engine gone): its outcome counted and logged, as every counted request's is."""
        self.outcome = outcome
        self._finish_log()

    def release_lora(self) -> None:
        """Tells the registry this request no longer uses its adapter (once)."""
        if self.lora is not None:
            self.model.loras.finished(self.lora)
            self.lora = None

    def abort(self, streams: list[RequestStream]) -> None:
        for s in streams:
            self.engine.abort_nowait(s.output.request_id)

    def slow_client(self) -> None:
        """The client stopped reading its stream (see TimedStreamingResponse)."""
        self.outcome = "slow_client"

    async def events(self) -> AsyncIterator[tuple[int, StreamDelta]]:
        """(choice index, delta) pairs from every prompt's stream, in arrival order. The merge
        queue is bounded, so deltas a slow client has not taken stay in their streams, where
        each stream's max_pending bound applies."""
        if len(self.streams) == 1 and self.req.n == 1:  # the usual case: no merging, no task
            stream = self.streams[0]
            while (d := await stream.deltas.get()) is not None:
                self._time(0, d)
                yield 0, d
            self._raise_error(stream)
            return
        merged: asyncio.Queue = asyncio.Queue(maxsize=len(self.streams))

        async def forward(i: int, stream: RequestStream) -> None:
            while (d := await stream.deltas.get()) is not None:
                await merged.put((i * self.req.n + d.index, d))
            await merged.put((i, None))

        tasks = [asyncio.create_task(forward(i, s)) for i, s in enumerate(self.streams)]
        try:
            open_streams = len(tasks)
            while open_streams:
                idx, d = await merged.get()
                if d is None:
                    open_streams -= 1
                    continue
                self._time(idx, d)
                yield idx, d
        finally:
            for t in tasks:
                t.cancel()
        for s in self.streams:
            self._raise_error(s)

    @staticmethod
    def _raise_error(stream: RequestStream) -> None:
        if isinstance(stream.error, ClientTooSlow):
            raise stream.error
        if isinstance(stream.error, ConstraintFailed):
            raise BadRequest(f"the output's constraint could not be followed: {stream.error}", code="constraint_failed")
        if stream.error is not None:
            raise Unavailable(str(stream.error))

    def _time(self, idx: int, d: StreamDelta) -> None:
        if not d.token_ids:
            return
        now = time.perf_counter()
        m = self.state.metrics
        if self.first_token is None:
            self.first_token = now
            m.ttft.observe(now - self.arrival, model=self.model.name)
        elif idx in self.last_token:
            m.itl.observe((now - self.last_token[idx]) / len(d.token_ids), times=len(d.token_ids),
                          model=self.model.name)
        self.last_token[idx] = now

    async def _finished(self) -> None:
        """Waits until every stream ended (a non-streaming request's streams carry no deltas) and
        times the request as `_time` times a stream: the first token, and between tokens each
        choice's mean gap (nothing arrives in between to time)."""
        for s in self.streams:
            await s.done.wait()
        for s in self.streams:
            self._raise_error(s)
        firsts = [s.output.first_token_time for s in self.streams if s.output.first_token_time is not None]
        if not firsts:
            return
        now = time.perf_counter()
        self.first_token = min(firsts)
        m = self.state.metrics
        m.ttft.observe(self.first_token - self.arrival, model=self.model.name)
        for s in self.streams:
            for c in s.output.outputs:
                if len(c.token_ids) > 1:
                    gaps = len(c.token_ids) - 1
                    m.itl.observe((now - s.output.first_token_time) / gaps, times=gaps, model=self.model.name)

    async def respond(self, request: Request) -> Response:
        """One JSON body once every stream finished (499 for a client gone meanwhile)."""
        result = await self.result(request)
        if result is None:
            return Response(status_code=499)
        return json_response(result.body, headers=self.headers())

    async def result(self, request: Request) -> CompletionResult | None:
        """The finished request; None when the client left first (its sequences aborted)."""
        body_task = asyncio.create_task(self._finished())
        gone_task = asyncio.create_task(_wait_disconnect(request))
        try:
            await asyncio.wait({body_task, gone_task}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the server gave up on this request (shutdown timeout)
            body_task.cancel()
            self.abort(self.streams)
            self.outcome = "cancelled"
            self._finish_log()
            raise
        finally:
            gone_task.cancel()
        if not body_task.done():
            body_task.cancel()
            self.abort(self.streams)
            self.outcome = "disconnected"
            self._finish_log()
            return None
        try:
            body_task.result()
        except Exception as e:
            self.outcome = self._failure(e)
            self._finish_log()
            raise
        self._finish_log()
        result = self._result()
        if self.on_done is not None:
            self.on_done(result)
        return result

    async def sse(self) -> AsyncIterator[bytes]:
        try:
            for choice in self.shape.opening(len(self.prompts) * self.req.n):
                yield self._chunk([choice])
            try:
                async for idx, d in self.events():
                    if d.text or d.finish_reason or d.token_ids:
                        choice = self.shape.delta_choice(idx, d)
                        if choice is not None:
                            yield self._chunk([choice])
            except APIError as e:
                self.outcome = self._failure(e)
                yield sse.raw_event(error_body(e.status, e.type, e.message, e.param, e.code))
                yield sse.DONE
                return
            except ClientTooSlow:  # its requests are aborted already; the client is not reading
                self.outcome = "slow_client"
                log.warning("slow_client_dropped", request_id=self.id, max_stream_buffer=self.state.settings.max_stream_buffer)
                return
            if self.req.wants_usage():
                yield self._chunk([], usage=self._usage())
            yield sse.DONE
            if self.on_done is not None and self.shape.final_body_of_stream:
                self.on_done(self._result())
        except (asyncio.CancelledError, GeneratorExit):
            self.abort(self.streams)
            if self.outcome == "ok":
                self.outcome = "disconnected"
            raise
        finally:
            self._finish_log()

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> bytes:
        body: dict[str, Any] = {"id": self.id, "object": self.shape.chunk_object, "created": self.created,
                                "model": self.model_name, "system_fingerprint": self.model.fingerprint,
                                "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return sse.event(body)

    def _result(self) -> CompletionResult:
        choices = [self.shape.choice(i, s.output, c, i * self.req.n + c.index)
                   for i, s in enumerate(self.streams) for c in s.output.outputs]
        usage = self._usage()
        body = {"id": self.id, "object": self.shape.object, "created": self.created, "model": self.model_name,
                "system_fingerprint": self.model.fingerprint, "choices": choices, "usage": usage}
        return CompletionResult(body, usage["prompt_tokens"], usage["completion_tokens"])

    def _usage(self) -> dict:
        prompt = sum(len(p) for p in self.prompts)
        completion = 0 if self.echo_only else sum(len(c.token_ids) for s in self.streams for c in s.output.outputs)
        cached = sum(s.output.num_cached_tokens for s in self.streams)
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        if self.diet is not None:  # the conversation's tokens the budget left out of prompt_tokens
            usage["prompt_tokens_details"]["removed_tokens"] = self.diet.removed_tokens
        if self.cache_status is not None:
            usage["pyserve_cache"] = self.cache_status
        return usage

    def _finish_log(self) -> None:
        if self._logged:
            return
        self._logged = True
        self.state.answering.discard(self)
        self.release_lora()
        now = time.perf_counter()
        self.state.metrics.e2e.observe(now - self.arrival, model=self.model.name)
        self.state.metrics.outcomes.inc(outcome=self.outcome, model=self.model.name)
        usage = self._usage()
        log.info("request_finished", request_id=self.id, outcome=self.outcome, model=self.model_name,
                 prompt_tokens=usage["prompt_tokens"], completion_tokens=usage["completion_tokens"],
                 cached_tokens=usage["prompt_tokens_details"]["cached_tokens"],
                 ttft_s=None if self.first_token is None else round(self.first_token - self.arrival, 6),
                 e2e_s=round(now - self.arrival, 6),
                 finish_reasons=[c.finish_reason for s in self.streams for c in s.output.outputs])


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
