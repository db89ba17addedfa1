"""EngineCore: the step loop, the one owner of the Rust scheduler.

Each turn: drain the inbox (adds, aborts), `schedule`, run the model worker in a thread, `update`
the scheduler with the sampled tokens, and send the step's new tokens (column-wise) to the
OutputProcessor. It never touches tensors.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import anyio
import numpy as np
import structlog

from pyserve import _core
from pyserve.actors import Actor
from pyserve.engine.request import LOGPROB_FIELDS, Abort, Add, EngineRequest, RequestRefused, StepOutput
from pyserve.engine.worker_call import WorkerCall, worker_call

if TYPE_CHECKING:
    from pyserve.model.worker import StepResult

log = structlog.get_logger("pyserve.engine")

NO_TOKENS = np.empty(0, dtype=np.int64)


class EngineCore(Actor):
    def __init__(self, scheduler: _core.Scheduler, worker, output_processor: Actor, speculator=None,
                 call_worker: WorkerCall = worker_call(on_loop=False)):
        super().__init__("engine_core")
        self.call_worker = call_worker
        self.speculator = speculator
        self.scheduler = scheduler
        self.worker = worker
        self.output_processor = output_processor
        self.requests: dict[int, EngineRequest] = {}
        self.new_ids: set[int] = set()
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.last_progress = time.monotonic()  # when a step that ran requests last completed

    async def run(self) -> None:
        while True:
            idle = not self.scheduler.has_unfinished_requests()
            if idle:  # an empty step reports the requests that just ended: their state is freed now
                await self.step()
            await self._drain_inbox(block=idle)
            if idle:  # work arrived: the no-progress clock starts now
                self.last_progress = time.monotonic()
            await self.step()

    def seconds_without_progress(self, now: float) -> float:
        """How long the engine has held unfinished requests without completing a step that ran
        any of them (0 when it holds none)."""
        if not self.scheduler.has_unfinished_requests():
            return 0.0
        return now - self.last_progress

    async def step(self) -> None:
        out = self.scheduler.schedule()
        if out.num_reqs == 0:
            self.scheduler.update(NO_TOKENS, NO_TOKENS)
            if out.finished_req_ids.size:  # aborted while nothing else ran: free their state
                await self.call_worker(self.worker.execute, out, [])
                if self.speculator is not None:
                    self.speculator.forget(out.finished_req_ids.tolist())
            if self.scheduler.has_unfinished_requests():
                await anyio.sleep(0.001)  # nothing fits yet; let the loop serve others
            return
        req_ids = out.req_ids.tolist()
        num_logits = out.num_logits
        with_logits = num_logits > 0
        if with_logits.all():  # a decode step: every request samples
            rows = list(map(self.requests.__getitem__, req_ids))
        else:
            rows = [self.requests[rid] for rid, n in zip(req_ids, with_logits.tolist()) if n]
        adapter_ids = None
        if self.worker.lora is not None:  # per-request adapters exist only with LoRA enabled
            adapter_ids = np.fromiter((self.requests[rid].adapter_id for rid in req_ids), np.int64, len(req_ids))
        start = time.perf_counter()
        result = await self.call_worker(self.worker.execute, out, rows, adapter_ids)
        seconds = time.perf_counter() - start
        self.last_progress = time.monotonic()
        # Read before `update`, which frees requests that finish on their first token.
        cached = {}
        if self.new_ids:
            cached = {rid: self.scheduler.num_cached_tokens(rid) for rid in self.new_ids.intersection(req_ids)}
        num_sampled = np.zeros(out.num_reqs, dtype=np.int64)
        num_sampled[with_logits] = result.num_sampled
        update = self.scheduler.update(result.token_ids, num_sampled)
        finished = dict(zip(update.finished_req_ids.tolist(), update.finish_reasons))
        appended = update.num_appended[with_logits]
        step = _step_output(out.req_ids[with_logits], result, appended, finished)
        tokens, starts = step.token_ids, step.starts
        if (appended == 1).all():
            for req, token in zip(rows, tokens):
                req.output_token_ids.append(token)
        else:
            for req, lo, hi in zip(rows, starts, starts[1:]):  # `rows`: the requests with logits, in order
                req.output_token_ids += tokens[lo:hi]
        for rid in finished:
            self.requests.pop(rid, None)
        if cached:
            got = set(step.internal_ids)
            step.num_cached_tokens = {rid: n for rid, n in cached.items() if rid in got}
            self.new_ids.difference_update(step.num_cached_tokens)
        self.num_generation_tokens += len(tokens)
        if step.internal_ids:
            await self.output_processor.send(step)
        if self.speculator is not None:  # after the tokens went out: proposing may run a draft model
            await self.speculator.after_step(out, num_sampled, seconds, set(finished), self.requests)

    async def _drain_inbox(self, block: bool) -> None:
        if block:
            self._handle(await self.receive())
        while (msg := self.receive_nowait()) is not None:
            self._handle(msg)

    def _handle(self, msg) -> None:
        if isinstance(msg, Add):
            req = msg.request
            try:
                self._add(msg)
            except _core.InvalidRequestError as e:
                if not msg.accepted.done():
                    msg.accepted.set_exception(RequestRefused(str(e), e.field))
                return
            if not msg.accepted.done():
                msg.accepted.set_result(None)
            self.requests[req.internal_id] = req
            self.new_ids.add(req.internal_id)
            self.num_prompt_tokens += len(req.prompt_token_ids)
        elif isinstance(msg, Abort):
            if self.requests.pop(msg.internal_id, None) is not None:
                self.new_ids.discard(msg.internal_id)
                self.scheduler.abort(msg.internal_id)
        else:
            raise TypeError(f"EngineCore got an unknown message {msg!r}")

    def _add(self, msg: Add) -> None:
        req = msg.request
        self.scheduler.add_request(
            req.internal_id,
            req.prompt_token_ids,
            max_tokens=msg.max_tokens,
            min_tokens=req.params.min_tokens,
            priority=msg.priority,
            adapter_id=msg.adapter_id,
            cache_salt=msg.cache_salt,
            stop_token_ids=msg.stop_token_ids,
            eos_token_id=msg.eos_token_id,
            ignore_eos=req.params.ignore_eos,
        )

    def stats(self) -> dict[str, float | int]:
        s = self.scheduler.stats()
        return {
            "num_requests_running": s["num_running"],
            "num_requests_waiting": s["num_waiting"],
            "kv_cache_usage_perc": s["kv_usage"],
            "kv_free_blocks": s["num_free_blocks"],
            "kv_cached_blocks": s["num_cached_blocks"],
            "prompt_tokens": self.num_prompt_tokens,
            "generation_tokens": self.num_generation_tokens,
            "prefix_cache_queries": s["prefix_query_tokens"],
            "prefix_cache_hits": s["prefix_hit_tokens"],
            "num_preemptions": s["num_preemptions"],
            **(self.speculator.stats() if self.speculator is not None else {
                "spec_decode_num_drafts": 0, "spec_decode_num_draft_tokens": 0,
                "spec_decode_num_accepted_tokens": 0, "spec_decode_mean_acceptance_length": 0.0,
                "spec_decode_depth": 0,
            }),
        }


def _step_output(req_ids: np.ndarray, result: StepResult, num_appended: np.ndarray,
                 finished: dict[int, str]) -> StepOutput:
    """The step's tokens column-wise: for each request with logits, the tokens the scheduler
    appended (a stop met inside accepted drafts drops the tokens after it)."""
    starts = np.zeros(len(req_ids) + 1, dtype=np.int64)
    np.cumsum(num_appended, out=starts[1:])
    keep = None
    if not np.array_equal(num_appended, result.num_sampled):
        sampled_at = np.concatenate([[0], np.cumsum(result.num_sampled)[:-1]])
        keep = np.repeat(sampled_at - starts[:-1], num_appended) + np.arange(starts[-1])
    tokens = result.token_ids if keep is None else result.token_ids[keep]
    step = StepOutput(req_ids.tolist(), tokens.tolist(), starts.tolist(), finished, {})
    if result.logprobs is not None:
        for name in LOGPROB_FIELDS:
            values = getattr(result, name)
            setattr(step, name, values if keep is None else values[keep])
    return step
