"""OutputProcessor: turns the engine's per-step token deltas into per-request outputs.

It detokenizes incrementally, applies stop strings, assembles logprobs, and publishes to each
request's stream: one cumulative RequestOutput plus a queue of deltas for streaming consumers.
A sample whose text nobody reads before it ends (not streaming, no stop strings) keeps only its
token ids while it runs and is decoded once, when it finishes.
`process` returns the sequences that must stop (a stop string hit, a client too slow) as data;
the actor sends their Aborts back to the step's sender.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from pyserve.actors import Actor, EngineDeadError
from pyserve.engine.detokenizer import IncrementalDetokenizer
from pyserve.engine.outputs import CompletionOutput, Logprob, RequestOutput
from pyserve.step.request import Abort, EngineRequest, SampleDelta, StepOutput
from pyserve.model.tokenizer import Tokenizer


@dataclass(slots=True)
class StreamDelta:
    """What changed for one sample: new text and tokens, and the finish reason when it ended."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: str | int | None = None  # the stop string or token that ended it (vLLM's field)


class ClientTooSlow(RuntimeError):
    """A streaming consumer left more than its stream's `max_pending` deltas unread."""


class ConstraintFailed(RuntimeError):
    """A sample's output constraint could not be followed (the grammar engine failed or had no
    token left to allow): its request fails instead of ending on text that does not match."""


@dataclass(slots=True)
class RequestStream:
    """A request's outputs as they arrive. `output` is cumulative; `deltas` feeds streaming
    consumers and stays empty (but for the closing None) when `streaming` is False. With
    `max_pending` set, a consumer that leaves more deltas than that unread has its request
    aborted and the stream failed with ClientTooSlow: the buffer of a client that stopped
    reading stays bounded."""

    output: RequestOutput
    internal_ids: list[int]
    streaming: bool = True
    max_pending: int | None = None
    deltas: asyncio.Queue = field(default_factory=asyncio.Queue)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    error: BaseException | None = None

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.done.set()
        self.deltas.put_nowait(None)


@dataclass(slots=True)
class _Sample:
    stream: RequestStream
    completion: CompletionOutput
    detok: IncrementalDetokenizer | None  # None: the request asked for token ids only
    num_logprobs: int | None
    # The text is decoded once, when the sample ends: nothing reads it before (no stream, no stop strings).
    deferred: bool = False
    # No text until the end, no logprobs, no stream: a step that does not end it just appends tokens.
    ids_only: bool = False
    # Decoded as it runs, no logprobs: a one-token step that does not start or end it is a plain row.
    plain: bool = False


class OutputProcessor(Actor):
    def __init__(self, tokenizer: Tokenizer, eos_token_id: int | None = None):
        super().__init__("output_processor")
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id  # ends a sequence with finish_reason "stop", stop_reason None
        self._samples: dict[int, _Sample] = {}
        self._streams: dict[str, RequestStream] = {}

    def register(self, stream: RequestStream, requests: list[EngineRequest]) -> None:
        self._streams[stream.output.request_id] = stream
        for req, completion in zip(requests, stream.output.outputs, strict=True):
            p = req.params
            detok = None
            if p.detokenize:
                detok = IncrementalDetokenizer(
                    self.tokenizer, req.prompt_token_ids, p.skip_special_tokens, p.stop, p.min_tokens,
                    p.include_stop_str_in_output,
                )
            if p.logprobs is not None:
                completion.logprobs = []
                completion.cumulative_logprob = 0.0
            deferred = detok is not None and not p.stop and not stream.streaming
            ids_only = (detok is None or deferred) and p.logprobs is None and not stream.streaming
            plain = detok is not None and not deferred and p.logprobs is None
            self._samples[req.internal_id] = _Sample(stream, completion, detok, p.logprobs, deferred, ids_only, plain)

    def forget(self, request_id: str) -> list[int]:
        """Drops a request (client gone); returns the ids of its still-running sequences."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return []
        live = [i for i in stream.internal_ids if self._samples.pop(i, None) is not None]
        return live

    def fail_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream.fail(EngineDeadError(f"engine is dead: {error!r}"))
        self._streams.clear()
        self._samples.clear()

    async def run(self) -> None:
        while True:
            msg: StepOutput = await self.receive()
            for internal_id in self.process(msg):
                msg.reply_to.post(Abort(internal_id))

    def process(self, msg: StepOutput) -> list[int]:
        """Publishes one step's tokens; returns the sequences to abort (their output is complete).
        The plain rows (one new token of a sample decoded as it runs, no logprobs, neither its
        first step nor its last) are detokenized together, in one batched call."""
        aborts: list[int] = []
        samples = self._samples
        for rid, why in (msg.failures or {}).items():
            sample = samples.get(rid)
            if sample is not None:  # the request's other samples stop too
                aborts += self.forget(sample.stream.output.request_id)
                sample.stream.fail(ConstraintFailed(why))
        for rid, lp in (msg.prompt_logprobs or {}).items():  # before the first token is published
            sample = samples.get(rid)
            if sample is not None:
                out = sample.stream.output
                out.prompt_logprobs = [None, *self._entries(out.prompt_token_ids[1:], lp, lp.top.shape[1],
                                                            decode=sample.detok is not None)]
        ids, tokens, starts = msg.internal_ids, msg.token_ids, msg.starts
        special = msg.finish_reasons.keys() | msg.num_cached_tokens.keys()
        plain: list[tuple[_Sample, int]] = []  # (sample, its row)
        rows: list[int] = []  # the other rows, each handled on its own
        for i, (rid, lo, hi) in enumerate(zip(ids, starts, starts[1:])):
            sample = samples.get(rid)
            if sample is None:
                continue
            if rid in special:
                rows.append(i)
            elif sample.ids_only:
                sample.completion.token_ids += tokens[lo:hi]
            elif sample.plain and hi - lo == 1:
                plain.append((sample, i))
            else:
                rows.append(i)
        if plain:
            IncrementalDetokenizer.push_each(self.tokenizer, [(s.detok, tokens[starts[i]]) for s, i in plain])
        for sample, i in plain:
            if ids[i] not in samples:  # its stream failed meanwhile
                continue
            if sample.detok.stop_hit is not None:
                if self._apply(sample, msg.delta(i), aborts, pushed=True):
                    self._finish_if_done(sample.stream)
                continue
            c = sample.completion
            token = tokens[starts[i]]
            c.token_ids.append(token)
            text = sample.detok.take_delta(final=False)
            c.text += text
            if sample.stream.streaming:
                self._publish(sample.stream, StreamDelta(c.index, text, [token], None, None), aborts)
        for i in rows:
            sample = samples.get(ids[i])
            if sample is not None and self._apply(sample, msg.delta(i), aborts):
                self._finish_if_done(sample.stream)
        return aborts

    def _finish_if_done(self, stream: RequestStream) -> None:
        if all(c.finished for c in stream.output.outputs):
            stream.output.finished = True
            self._streams.pop(stream.output.request_id, None)
            stream.done.set()
            stream.deltas.put_nowait(None)

    def _apply(self, sample: _Sample, delta: SampleDelta, aborts: list[int], pushed: bool = False) -> bool:
        """Adds one delta to its sample's output (`pushed`: its text tokens are in its detokenizer
        already); True when the sample finished."""
        c = sample.completion
        out = sample.stream.output
        if delta.num_cached_tokens is not None and c.index == 0:
            out.num_cached_tokens = delta.num_cached_tokens
        finish = delta.finish_reason
        tokens = delta.token_ids
        detok = sample.detok
        # NOTE: a stop token (EOS or a stop_token_ids entry) ends the sequence: it is in token_ids
        # but, as in vLLM, its text is not part of the output.
        text_tokens = tokens[:-1] if finish == "stop" else tokens
        taken = len(text_tokens)
        if sample.deferred:
            if finish is not None:  # the whole output, decoded by take_delta below
                detok.extend(c.token_ids + text_tokens)
        elif detok is not None and not pushed:
            taken = detok.push(text_tokens)
        stop_reason: str | int | None = None
        if detok is not None and detok.stop_hit is not None:
            finish, stop_reason = "stop", detok.stop_hit
            if taken < len(text_tokens) or delta.finish_reason == "stop":
                # Tokens after the stop string's last one (speculation appends several per step)
                # are not part of the output.
                tokens = delta.token_ids = tokens[:taken]
                if delta.logprobs is not None:
                    delta.logprobs = delta.logprobs[:taken]
            if delta.finish_reason is None:
                aborts.append(delta.internal_id)
        elif finish == "stop" and delta.closed_by_budget:
            finish = "length"  # its stop token ended JSON that max_tokens closed (json_close)
        elif finish == "stop" and tokens and tokens[-1] != self.eos_token_id:
            stop_reason = tokens[-1]
        if tokens and out.first_token_time is None:
            out.first_token_time = time.perf_counter()
        c.token_ids.extend(tokens)
        new_logprobs = None
        if sample.num_logprobs is not None:
            new_logprobs = self._logprobs(delta, sample.num_logprobs, decode=detok is not None)
            c.logprobs.extend(new_logprobs)
            c.cumulative_logprob += float(delta.logprobs.sampled.sum())
        text = ""
        if detok is not None and (finish is not None or not sample.deferred):
            text = detok.take_delta(final=finish is not None)
            c.text += text
        if finish is not None:
            c.finish_reason, c.stop_reason = finish, stop_reason
            del self._samples[delta.internal_id]
        stream = sample.stream
        if stream.streaming:
            published = StreamDelta(c.index, text, tokens, new_logprobs, c.finish_reason, c.stop_reason)
            return self._publish(stream, published, aborts) and finish is not None
        return finish is not None

    def _publish(self, stream: RequestStream, delta: StreamDelta, aborts: list[int]) -> bool:
        """Queues a streaming delta; False when that left more than `max_pending` unread: the
        request is then dropped (its running sequences join `aborts`) and its stream failed."""
        stream.deltas.put_nowait(delta)
        if stream.max_pending is not None and stream.deltas.qsize() > stream.max_pending and not stream.done.is_set():
            aborts += self.forget(stream.output.request_id)
            stream.fail(ClientTooSlow(f"the client left {stream.max_pending} chunks unread; request aborted"))
            return False
        return True

    def _logprobs(self, delta: SampleDelta, k: int, decode: bool) -> list[dict[int, Logprob]]:
        return self._entries(delta.token_ids, delta.logprobs, k, decode)

    def _entries(self, token_ids: list[int], lp, k: int, decode: bool) -> list[dict[int, Logprob]]:
        """Per token: its logprob and rank, then the top-k alternatives; each with its text
        unless `decode` is False (then None, as for detokenize=False in vLLM)."""

        def text(token: int) -> str | None:
            return self.tokenizer.token_text(token, skip_special_tokens=False) if decode else None

        out = []
        for i, token in enumerate(token_ids):
            entry = {token: Logprob(float(lp.sampled[i]), int(lp.sampled_ranks[i]), text(token))}
            top = zip(lp.top[i, :k].tolist(), lp.top_token_ids[i, :k].tolist())
            for rank, (value, tid) in enumerate(top, start=1):
                entry.setdefault(tid, Logprob(value, rank, text(tid)))
            out.append(entry)
        return out
