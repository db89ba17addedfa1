"""One HTTP completion request while it runs: its engine streams merged into (choice, delta)
events, served as SSE chunks or one final body, with its timings, metrics and log line. A client
that disconnects, streaming or not, gets its sequences aborted at once (freeing their blocks)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
import structlog
from starlette.requests import Request
from starlette.responses import Response

from pyserve.engine.output_processor import ClientTooSlow, ConstraintFailed, RequestStream, StreamDelta
from pyserve.lora.request import LoRARequest
from pyserve.http.responses import json_response
from pyserve.http.errors import APIError, BadRequest, Unavailable, error_body
from pyserve.server.models import ServedModel
from pyserve.server.schemas import SamplingFields
from pyserve.server.state import ServerState
from pyserve.server.tool_calls import ChoiceCalls, ToolPlan

log = structlog.get_logger("pyserve.server")
# Alternatives whose logprob is below this are tokens a grammar masked out (their logits got
# model.token_masks.BANNED): they are left out of top_logprobs, never offered as choices.
MASKED = -1e30


class CompletionContext:
    """One HTTP request's engine requests, timings and response building."""

    def __init__(self, kind: str, base_id: str, req: SamplingFields, prompts: list[list[int]], state: ServerState,
                 model: ServedModel, arrival: float, created: int, lora: LoRARequest | None,
                 tools: ToolPlan | None = None, echo: list[str] | None = None, echo_only: bool = False):
        """`model` (with `lora`, when an adapter serves it) answers the request; `echo`: each
        prompt's text, put before its completions (with their logprobs when asked); `echo_only`:
        max_tokens 0, the one token the engine generated is not returned."""
        self.kind, self.id, self.req, self.prompts, self.state = kind, base_id, req, prompts, state
        self.model, self.engine = model, model.engine
        self.model_name = model.name if lora is None else lora.lora_name  # the response's `model`
        self.echo, self.echo_only = echo, echo_only
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
        self._logged = False
        self.tools = tools if tools is not None and tools.format is not None else None  # calls to read out
        self._calls: dict[int, ChoiceCalls] = {}  # per choice, when calls are read out
        self._streamed_chars: dict[int, int] = {}  # per choice: its streamed tokens' characters (text_offset)
        self.cache_status: str | None = None  # the semantic cache's word on this request (hit / miss / bypass)
        self.on_done: Callable[[dict], None] | None = None  # told the final body of a request that finished

    def headers(self) -> dict[str, str]:
        return {} if self.cache_status is None else {"x-pyserve-cache": self.cache_status}

    def _choice_calls(self, idx: int) -> ChoiceCalls:
        calls = self._calls.get(idx)
        if calls is None:
            calls = self._calls[idx] = ChoiceCalls(self.tools.parser(), self.tools.legacy, self.tools.named,
                                                   self.tools.forced, self.tools.fallback)
        return calls

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
            return Response(status_code=499)
        try:
            body_task.result()
        except Exception as e:
            self.outcome = "engine_dead" if isinstance(e, Unavailable) else "error"
            self._finish_log()
            raise
        self._finish_log()
        body = self._final_body()
        if self.on_done is not None:
            self.on_done(body)
        return json_response(body, headers=self.headers())

    async def sse(self) -> AsyncIterator[bytes]:
        try:
            if self.kind == "chat":
                for i in range(len(self.prompts) * self.req.n):
                    yield self._chunk([{"index": i, "delta": {"role": "assistant", "content": "", "refusal": None},
                                        "logprobs": None, "finish_reason": None}])
            try:
                async for idx, d in self.events():
                    if d.text or d.finish_reason or d.token_ids:
                        choice = self._delta_choice(idx, d)
                        if choice.get("delta") == {} and not choice["finish_reason"] and choice["logprobs"] is None:
                            continue  # text held back while it may still be a tool call's start
                        yield self._chunk([choice])
            except APIError as e:
                self.outcome = "engine_dead" if isinstance(e, Unavailable) else "error"
                yield b"data: " + error_body(e.status, e.type, e.message, e.param, e.code) + b"\n\n"
                return
            except ClientTooSlow:  # its requests are aborted already; the client is not reading
                self.outcome = "slow_client"
                log.warning("slow_client_dropped", request_id=self.id, max_stream_buffer=self.state.settings.max_stream_buffer)
                return
            if self.req.wants_usage():
                yield self._chunk([], usage=self._usage())
            yield b"data: [DONE]\n\n"
            if self.on_done is not None and self.tools is None:  # streamed calls' final message is not kept
                self.on_done(self._final_body())
        except (asyncio.CancelledError, GeneratorExit):
            self.abort(self.streams)
            if self.outcome == "ok":
                self.outcome = "disconnected"
            raise
        finally:
            self._finish_log()

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> bytes:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        body: dict[str, Any] = {"id": self.id, "object": obj, "created": self.created,
                                "model": self.model_name, "system_fingerprint": self.model.fingerprint,
                                "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return b"data: " + orjson.dumps(body) + b"\n\n"

    def _delta_choice(self, idx: int, d: StreamDelta) -> dict:
        lp = None
        if d.logprobs is not None:
            lp = self._logprobs(d.token_ids, d.logprobs, offset=self._streamed_chars.get(idx, 0))
            if "tokens" in lp:
                self._streamed_chars[idx] = self._streamed_chars.get(idx, 0) + sum(len(t) for t in lp["tokens"])
        if self.kind == "chat" and self.tools is not None:
            calls = self._choice_calls(idx)
            delta, has_calls = calls.delta(d.text, final=d.finish_reason is not None)
            return {"index": idx, "delta": delta, "logprobs": lp,
                    "finish_reason": calls.finish_reason(d.finish_reason, has_calls)}
        if self.kind == "chat":
            delta = {"content": d.text} if d.text or not d.finish_reason else {}
            return {"index": idx, "delta": delta, "logprobs": lp, "finish_reason": d.finish_reason}
        return {"index": idx, "text": d.text, "logprobs": lp, "finish_reason": d.finish_reason}

    def _final_body(self) -> dict:
        choices = []
        for i, s in enumerate(self.streams):
            for c in s.output.outputs:
                idx = i * self.req.n + c.index
                lp = None if c.logprobs is None else self._logprobs(c.token_ids, c.logprobs)
                if self.kind == "chat":
                    message, finish = {"role": "assistant", "content": c.text}, c.finish_reason
                    if self.tools is not None:
                        calls = self._choice_calls(idx)
                        message = calls.message(c.text)
                        finish = calls.finish_reason(finish, "tool_calls" in message or "function_call" in message)
                    # OpenAI's message always has a refusal; this server never refuses
                    choices.append({"index": idx, "message": message | {"refusal": None}, "logprobs": lp,
                                    "finish_reason": finish})
                elif self.echo is not None:
                    choices.append(self._echoed(i, s.output, c, idx))
                else:
                    choices.append({"index": idx, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason})
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model_name,
                "system_fingerprint": self.model.fingerprint, "choices": choices, "usage": self._usage()}

    def _logprobs(self, token_ids: list[int], entries, offset: int = 0) -> dict:
        """The OpenAI logprobs of `token_ids`: chat's `content` (each token's bytes as it stands
        for them, a piece of a character included), or the completions API's lists, where each
        token's `top_logprobs` holds the sampled token besides the top k and `text_offset` counts
        characters from `offset`, the choice's text before these tokens."""
        tokenizer = self.engine.tokenizer
        if self.kind == "chat":
            content = []
            for tid, entry in zip(token_ids, entries):
                text = tokenizer.token_text(tid, skip_special_tokens=False)
                top = [{"token": e.decoded_token, "logprob": e.logprob, "bytes": list(tokenizer.token_bytes(t))}
                       for t, e in sorted(entry.items(), key=lambda kv: -kv[1].logprob)
                       if e.logprob > MASKED][: self._num_top()]
                content.append({"token": text, "logprob": entry[tid].logprob, "bytes": list(tokenizer.token_bytes(tid)),
                                "top_logprobs": top})
            return {"content": content}
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for tid, entry in zip(token_ids, entries):
            text = tokenizer.token_text(tid, skip_special_tokens=False)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
            sampled = entry[tid]
            token_logprobs.append(sampled.logprob)
            best = [e for e in sorted(entry.values(), key=lambda e: -e.logprob) if e.logprob > MASKED][: self._num_top()]
            tops.append({e.decoded_token: e.logprob for e in best} | {sampled.decoded_token: sampled.logprob})
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}

    def _echoed(self, i: int, output, c, idx: int) -> dict:
        """A completion choice with prompt i before it: text, and logprobs (the prompt's first token
        has none) when asked."""
        tokens = [] if self.echo_only else c.token_ids
        text = self.echo[i] + ("" if self.echo_only else c.text)
        lp = None
        if self.req.logprobs is not None:
            prompt = self.prompts[i]
            first = self.engine.tokenizer.decode(prompt[:1], skip_special_tokens=False)
            head = self._logprobs(prompt[1:], output.prompt_logprobs[1:], offset=len(first))
            lp = {"tokens": [first, *head["tokens"]], "token_logprobs": [None, *head["token_logprobs"]],
                  "top_logprobs": [None, *head["top_logprobs"]], "text_offset": [0, *head["text_offset"]]}
            if tokens:
                tail = self._logprobs(tokens, c.logprobs, offset=sum(len(t) for t in lp["tokens"]))
                lp = {k: lp[k] + tail[k] for k in lp}
        finish = "length" if self.echo_only else c.finish_reason
        return {"index": idx, "text": text, "logprobs": lp, "finish_reason": finish}

    def _num_top(self) -> int:
        if self.kind == "chat":
            return self.req.top_logprobs or 0
        return self.req.logprobs or 0

    def _usage(self) -> dict:
        prompt = sum(len(p) for p in self.prompts)
        completion = 0 if self.echo_only else sum(len(c.token_ids) for s in self.streams for c in s.output.outputs)
        cached = sum(s.output.num_cached_tokens for s in self.streams)
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        if self.cache_status is not None:
            usage["pyserve_cache"] = self.cache_status
        return usage

    def _finish_log(self) -> None:
        if self._logged:
            return
        self._logged = True
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
