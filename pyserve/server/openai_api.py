"""The OpenAI endpoints: /v1/chat/completions and /v1/completions, streaming (SSE) or not.

A request is validated, templated and tokenized, checked against the model length, then queued
as one engine request per prompt. Its deltas feed either SSE chunks or one final body. A client
that disconnects, streaming or not, gets its sequences aborted at once (freeing their blocks).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
import structlog
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from pyserve.actors import EngineDeadError
from pyserve.engine.output_processor import ClientTooSlow, RequestStream, StreamDelta
from pyserve.engine.sampling_params import SamplingParams
from pyserve.lora.request import LoRARequest
from pyserve.model.tokenizer import ChatTemplateError
from pyserve.server.deadline import DeadlineExceeded, run_with_deadline
from pyserve.server.errors import BadRequest, NotFound, TooManyRequests, Unavailable, error_body
from pyserve.server.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from pyserve.server.state import ServerState
from pyserve.server.streaming import TimedStreamingResponse

log = structlog.get_logger("pyserve.server")


async def chat_completions(request: Request) -> Response:
    state: ServerState = request.app.state.pyserve
    req = _validate(ChatCompletionRequest, await json_body(request))
    lora = state.loras.resolve(req.model, state.settings.served_model_name)
    tok = state.engine.tokenizer
    settings = state.settings
    param = "messages" if req.chat_template is None else "chat_template"
    if req.chat_template is not None and not settings.trust_request_chat_template:
        raise BadRequest("chat_template: this server renders only the model's chat template "
                         "(start it with --trust-request-chat-template to accept one per request)", param=param)
    try:  # in a thread, under a deadline: the event loop keeps serving while a template renders
        text = await run_with_deadline(tok.apply_chat_template, req.template_messages(), req.add_generation_prompt,
                                       req.chat_template, timeout=settings.chat_template_timeout)
    except ChatTemplateError as e:
        raise BadRequest(str(e), param=param) from e
    except DeadlineExceeded as e:
        raise BadRequest(f"the chat template did not render within {settings.chat_template_timeout} s",
                         param=param) from e
    prompt = tok.encode(text, add_special_tokens=False)
    max_tokens = req.max_completion_tokens or req.max_tokens
    return await _serve(request, state, "chat", req, [prompt], max_tokens, req.num_logprobs(), lora)


async def completions(request: Request) -> Response:
    state: ServerState = request.app.state.pyserve
    req = _validate(CompletionRequest, await json_body(request))
    lora = state.loras.resolve(req.model, state.settings.served_model_name)
    tok = state.engine.tokenizer
    vocab = state.engine.model_config.vocab_size
    prompts = []
    for p in req.prompts():
        if isinstance(p, str):
            if not p:
                raise BadRequest("prompt must not be empty", param="prompt")
            prompts.append(tok.encode(p))
        else:
            bad = next((t for t in p if not 0 <= t < vocab), None)
            if bad is not None:
                raise BadRequest(f"token id {bad} is outside the vocabulary [0, {vocab})", param="prompt")
            prompts.append(list(p))
    return await _serve(request, state, "text", req, prompts, req.max_tokens, req.logprobs, lora)


async def json_body(request: Request) -> Any:
    body = await request.body()
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise BadRequest(f"request body is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise BadRequest("request body must be a JSON object")
    return data


def _validate(schema: type[BaseModel], data: dict[str, Any]):
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = _field_path(err["loc"])
        raise BadRequest(f"{param}: {err['msg']}" if param else err["msg"], param=param) from e


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _field_path(loc: tuple) -> str | None:
    """The field an error is about: pydantic's location up to the first union member tag
    ('stop.str' -> 'stop', 'prompt.list[int].1' -> 'prompt', 'messages.0.role' stays)."""
    parts = []
    for x in loc:
        if isinstance(x, str) and (not x.isidentifier() or x in _TYPE_TAGS):
            break
        parts.append(str(x))
    return ".".join(parts) or None


def _params(req: SamplingFields, prompt_len: int, max_tokens: int | None, logprobs: int | None,
            max_model_len: int) -> SamplingParams:
    room = max_model_len - prompt_len
    if room < 1:
        raise BadRequest(f"the prompt has {prompt_len} tokens; the model's length is {max_model_len}",
                         param="messages" if isinstance(req, ChatCompletionRequest) else "prompt")
    if max_tokens is not None and max_tokens > room:
        raise BadRequest(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the model's length "
                         f"({max_model_len})", param="max_tokens")
    try:
        return SamplingParams(
            n=req.n, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0, min_p=req.min_p or 0.0,
            seed=req.seed, stop=req.stop, max_tokens=max_tokens or room, ignore_eos=req.ignore_eos,
            logprobs=logprobs, presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty,
        )
    except ValueError as e:
        raise BadRequest(str(e)) from e


async def _serve(request: Request, state: ServerState, kind: str, req: SamplingFields, prompts: list[list[int]],
                 max_tokens: int | None, logprobs: int | None, lora: LoRARequest | None) -> Response:
    engine = state.engine
    params = [_params(req, len(p), max_tokens, logprobs, engine.max_model_len) for p in prompts]
    if state.draining:
        raise Unavailable("server is shutting down")
    try:
        engine.system.check_alive()
    except EngineDeadError as e:
        raise Unavailable(str(e)) from e
    limit = state.settings.max_waiting
    if limit is not None and engine.stats()["num_requests_waiting"] + len(prompts) * req.n > limit:
        raise TooManyRequests(f"the queue is full ({limit} waiting requests)")
    base_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    ctx = _Context(kind, base_id, req, prompts, state, time.perf_counter(), int(time.time()), lora)
    streams = []
    try:
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            streams.append(await engine.add_request(f"{base_id}-{i}", prompt, p, lora_request=lora,
                                                    max_pending=state.settings.max_stream_buffer))
    except ValueError as e:
        ctx.abort(streams)
        ctx.release_lora()
        field = getattr(e, "field", None)  # RequestRefused: the scheduler's field name
        prompt_param = "messages" if kind == "chat" else "prompt"
        raise BadRequest(str(e), param=prompt_param if field == "prompt_token_ids" else field) from e
    except EngineDeadError as e:
        ctx.release_lora()
        raise Unavailable(str(e)) from e
    except asyncio.CancelledError:
        ctx.release_lora()
        # NOTE: AsyncEngine.add_request only cleans up after a ValueError; a cancel while it waits
        # for the engine's answer would leave the prompt being added registered (and running).
        for i in range(len(streams) + 1):
            engine.abort_nowait(f"{base_id}-{i}")
        raise
    ctx.streams = streams
    if req.stream:
        return TimedStreamingResponse(ctx.sse(), state.settings.stream_timeout, ctx.slow_client,
                                      media_type="text/event-stream",
                                      headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await ctx.respond(request)


class _Context:
    """One HTTP request's engine requests, timings and response building."""

    def __init__(self, kind, base_id, req, prompts, state, arrival, created, lora):
        self.kind, self.id, self.req, self.prompts, self.state = kind, base_id, req, prompts, state
        self.arrival, self.created = arrival, created
        self.lora = lora
        if lora is not None:
            state.loras.started(lora.lora_name)
            state.metrics.lora_requests.inc(adapter=lora.lora_name)
        self.streams: list[RequestStream] = []
        self.first_token: float | None = None
        self.last_token: dict[int, float] = {}
        self.outcome = "ok"
        self._logged = False

    def release_lora(self) -> None:
        """Tells the registry this request no longer uses its adapter (once)."""
        if self.lora is not None:
            self.state.loras.finished(self.lora)
            self.lora = None

    def abort(self, streams: list[RequestStream]) -> None:
        for s in streams:
            self.state.engine.abort_nowait(s.output.request_id)

    def slow_client(self) -> None:
        """The client stopped reading its stream (see TimedStreamingResponse)."""
        self.outcome = "slow_client"

    async def events(self) -> AsyncIterator[tuple[int, StreamDelta]]:
        """(choice index, delta) pairs from every prompt's stream, in arrival order. The merge
        queue is bounded, so deltas a slow client has not taken stay in their streams, where
        each stream's max_pending bound applies."""
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
            if isinstance(s.error, ClientTooSlow):
                raise s.error
            if s.error is not None:
                raise Unavailable(str(s.error))

    def _time(self, idx: int, d: StreamDelta) -> None:
        if not d.token_ids:
            return
        now = time.perf_counter()
        m = self.state.metrics
        if self.first_token is None:
            self.first_token = now
            m.ttft.observe(now - self.arrival)
        elif idx in self.last_token:
            gap = (now - self.last_token[idx]) / len(d.token_ids)
            for _ in d.token_ids:
                m.itl.observe(gap)
        self.last_token[idx] = now

    async def respond(self, request: Request) -> Response:
        async def drain():
            async for _ in self.events():
                pass

        body_task = asyncio.create_task(drain())
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
        return Response(orjson.dumps(self._final_body()), media_type="application/json")

    async def sse(self) -> AsyncIterator[bytes]:
        try:
            if self.kind == "chat":
                for i in range(len(self.prompts) * self.req.n):
                    yield self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}])
            try:
                async for idx, d in self.events():
                    if d.text or d.finish_reason or d.token_ids:
                        yield self._chunk([self._delta_choice(idx, d)])
            except Unavailable as e:
                self.outcome = "engine_dead"
                yield b"data: " + error_body(503, "service_unavailable", e.message) + b"\n\n"
                return
            except ClientTooSlow:  # its requests are aborted already; the client is not reading
                self.outcome = "slow_client"
                log.warning("slow_client_dropped", request_id=self.id, max_stream_buffer=self.state.settings.max_stream_buffer)
                return
            opts = self.req.stream_options
            if opts is not None and opts.include_usage:
                yield self._chunk([], usage=self._usage())
            yield b"data: [DONE]\n\n"
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
                                "model": self.req.model, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return b"data: " + orjson.dumps(body) + b"\n\n"

    def _delta_choice(self, idx: int, d: StreamDelta) -> dict:
        lp = None if d.logprobs is None else self._logprobs(d.token_ids, d.logprobs)
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
                    choices.append({"index": idx, "message": {"role": "assistant", "content": c.text},
                                    "logprobs": lp, "finish_reason": c.finish_reason})
                else:
                    choices.append({"index": idx, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason})
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.req.model,
                "choices": choices, "usage": self._usage()}

    def _logprobs(self, token_ids: list[int], entries) -> dict:
        decode = self.state.engine.tokenizer.decode
        if self.kind == "chat":
            content = []
            for tid, entry in zip(token_ids, entries):
                text = decode([tid], skip_special_tokens=False)
                top = [{"token": e.decoded_token, "logprob": e.logprob, "bytes": list((e.decoded_token or "").encode())}
                       for t, e in sorted(entry.items(), key=lambda kv: -kv[1].logprob)][: self._num_top()]
                content.append({"token": text, "logprob": entry[tid].logprob, "bytes": list(text.encode()),
                                "top_logprobs": top})
            return {"content": content}
        tokens, token_logprobs, tops = [], [], []
        for tid, entry in zip(token_ids, entries):
            tokens.append(decode([tid], skip_special_tokens=False))
            token_logprobs.append(entry[tid].logprob)
            best = sorted(entry.values(), key=lambda e: -e.logprob)[: self._num_top()]
            tops.append({e.decoded_token: e.logprob for e in best})
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops}

    def _num_top(self) -> int:
        if self.kind == "chat":
            return self.req.top_logprobs or 0
        return self.req.logprobs or 0

    def _usage(self) -> dict:
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(len(c.token_ids) for s in self.streams for c in s.output.outputs)
        cached = sum(s.output.num_cached_tokens for s in self.streams)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def _finish_log(self) -> None:
        if self._logged:
            return
        self._logged = True
        self.release_lora()
        now = time.perf_counter()
        self.state.metrics.e2e.observe(now - self.arrival)
        self.state.metrics.outcomes.inc(outcome=self.outcome)
        usage = self._usage()
        log.info("request_finished", request_id=self.id, outcome=self.outcome, model=self.req.model,
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
