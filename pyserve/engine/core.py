"""EngineCore: the step loop, the one owner of the Rust scheduler.

Each turn: drain the inbox (adds, aborts), `schedule` (within the StepBudget's token budget,
fitted to the measured seconds of the worker's steps), run the model worker, `update` the
scheduler with the sampled tokens, and send the step's output, as `update` returned it, to the
OutputProcessor. The step's optional parts (grammar, prompt logprobs, speculation, LoRA,
penalties) are participants (engine/participants) called at fixed points of it: they hand back
data (masks, failures, drafts), and only this actor calls the scheduler. The worker's forwards
run inline, so this actor's loop serves nothing that must answer meanwhile: the server gives it
a thread of its own (see AsyncEngine). The scheduler holds every request's tokens; this actor
keeps only what the scheduler does not know (sampling parameters, samples waiting to fork). It
never touches tensors.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import anyio
import numpy as np
import structlog

from pyserve import _core
from pyserve.actors import Actor
from pyserve.actors.loop_thread import resolve
from pyserve.engine.background import BackgroundLimit
from pyserve.engine.participants.base import Step, StepParticipant, overriding
from pyserve.engine.step_budget import StepBudget
from pyserve.speculative.proposer import DraftTree
from pyserve.speculative.speculator import speculation_stats
from pyserve.step.request import Abort, Add, EngineRequest, RequestRefused, StepOutput, StepRows

log = structlog.get_logger("pyserve.engine")

NO_TOKENS = np.empty(0, dtype=np.int64)


@dataclass(frozen=True, slots=True)
class Published:
    """What the EngineCore shows other threads (the server's, the watchdog's) of the scheduler it
    alone calls: replaced whole after every step and every drained inbox, never changed in place."""

    busy: bool  # unfinished requests held
    num_waiting: int
    scheduler_stats: dict[str, float | int]


class EngineCore(Actor):
    def __init__(self, scheduler: _core.Scheduler, worker, output_processor: Actor,
                 participants: list[StepParticipant], step_budget: StepBudget | None = None,
                 background: BackgroundLimit | None = None):
        """`participants`: the step's optional parts (engine/participants), called in this order."""
        super().__init__("engine_core")
        self.background = background  # None: batch-job lines fill any step
        self.step_budget = step_budget  # None: every step may take max_num_batched_tokens
        self.participants = participants
        self._add_hooks = overriding(participants, "add")
        self._drop_hooks = overriding(participants, "drop")
        self._before_forward = overriding(participants, "before_forward")
        self._after_update = overriding(participants, "after_update")
        self._after_output = overriding(participants, "after_output")
        self.scheduler = scheduler
        self.worker = worker
        self.output_processor = output_processor
        self.requests: dict[int, EngineRequest] = {}
        self.pending_forks: dict[int, Add] = {}  # held parent's id -> its Add, whose forks wait
        self.fork_parent: dict[int, int] = {}  # a sample waiting to fork -> its parent's id
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.last_progress = time.monotonic()  # when a step that ran requests last completed
        self.published = self._publish()
        # Set while it holds no unfinished request; an event of the loop the core runs on (the
        # offline LLM's, whose wait_idle awaits it), replaced when work arrives.
        self.idle = asyncio.Event()

    async def run(self) -> None:
        while True:
            idle = not self.scheduler.has_unfinished_requests()
            if idle:  # an empty step reports the requests that just ended: their state is freed now
                await self.step()
                self._publish_all()
            drained = await self._drain_inbox(block=idle)
            if idle:  # work arrived: the no-progress clock starts now
                self.last_progress = time.monotonic()
            if drained:
                self._publish_all()
            await self.step()
            self._publish_all()

    def _publish(self) -> Published:
        s = self.scheduler
        return Published(s.has_unfinished_requests(), s.num_waiting, s.stats())

    def _publish_all(self) -> None:
        self.published = published = self._publish()
        if published.busy:
            if self.idle.is_set():
                self.idle = asyncio.Event()
        else:
            self.idle.set()

    def seconds_without_progress(self, now: float) -> float:
        """How long the engine has held unfinished requests without completing a step that ran
        any of them (0 when it holds none). Reads what was published: safe from any thread."""
        if not self.published.busy:
            return 0.0
        return now - self.last_progress

    async def step(self) -> None:
        max_background = None
        if self.background is not None:
            max_background = self.background.limit(self.scheduler.has_foreground_requests(), time.monotonic())
        out = self.scheduler.schedule(None if self.step_budget is None else self.step_budget.next_budget(),
                                      max_background)
        if out.num_reqs == 0:
            self.worker.copy_blocks(out)
            ready = self.scheduler.update(NO_TOKENS, NO_TOKENS).fork_ready
            self._fork(ready)
            if self.scheduler.has_unfinished_requests() and not ready:
                await anyio.sleep(0.001)  # nothing fits yet; let the loop serve others
            return
        req_ids = out.req_ids.tolist()
        with_logits = out.num_logits > 0
        if with_logits.all():  # a decode step: every request samples
            rows = StepRows(list(map(self.requests.__getitem__, req_ids)), out.num_output_tokens.tolist())
        else:
            rows = StepRows([self.requests[rid] for rid, n in zip(req_ids, with_logits.tolist()) if n],
                            out.num_output_tokens[with_logits].tolist())
        step = Step(out, req_ids, rows, with_logits, self.requests, self.scheduler.token_ids)
        for before_forward in self._before_forward:
            before_forward(step)
        await anyio.sleep(0)  # once per step: the loop delivers what arrived meanwhile
        start = time.perf_counter()
        result = self.worker.execute(out, rows, step.adapter_ids, step.prompt_rows)
        step.seconds = seconds = time.perf_counter() - start
        self.last_progress = time.monotonic()
        if self.step_budget is not None:
            self.step_budget.observe(int(out.total_num_tokens), seconds)
        num_sampled = np.zeros(out.num_reqs, dtype=np.int64)
        num_sampled[with_logits] = result.num_sampled
        update = self.scheduler.update(result.token_ids, num_sampled)
        step.result, step.num_sampled, step.update = result, num_sampled, update
        step.finished = finished = dict(zip(update.finished_req_ids.tolist(), update.finish_reasons))
        for after_update in self._after_update:  # the finished are still held
            after_update(step)
        for rid in step.failures:  # they leave the scheduler; their requests fail
            if rid not in finished:
                self.scheduler.abort(rid)
            self._drop(rid)
        for rid in finished:
            self._drop(rid)
        logprobs = None if result.logprobs is None else result.logprobs[update.sampled_index]
        output = StepOutput(update.req_ids, update.token_ids, update.starts, finished, update.num_cached_tokens,
                            logprobs, step.failures or None, reply_to=self)
        output.prompt_logprobs = step.prompt_logprobs
        output.closed_by_budget = step.closed_by_budget
        self.num_generation_tokens += len(output.token_ids)
        self._fork(update.fork_ready)
        if output.internal_ids:
            await self.output_processor.send(output)
        for after_output in self._after_output:  # may run a draft model
            await after_output(step)
        for rid, tokens in step.drafts.items():
            if isinstance(tokens, DraftTree):
                self.scheduler.set_spec_tokens(rid, tokens.tokens, tokens.parents)
            else:
                self.scheduler.set_spec_tokens(rid, tokens)

    def _fork(self, ready: list[int]) -> None:
        """Starts the samples waiting on each ready parent, sharing its computed blocks."""
        for parent_id in ready:
            add = self.pending_forks.pop(parent_id, None)
            for child in add.forks if add is not None else ():
                if self.fork_parent.pop(child.internal_id, None) is not None:  # not aborted meanwhile
                    self.scheduler.fork_request(parent_id, child.internal_id)
            self.scheduler.release_hold(parent_id)

    def _drop(self, internal_id: int) -> EngineRequest | None:
        req = self.requests.pop(internal_id, None)
        if req is not None:
            for drop in self._drop_hooks:
                drop(req)
        return req

    async def _drain_inbox(self, block: bool) -> bool:
        """Handles the messages waiting (with `block`, at least one); whether there were any."""
        drained = block
        if block:
            self._handle(await self.receive())
        while (msg := self.receive_nowait()) is not None:
            self._handle(msg)
            drained = True
        return drained

    def _handle(self, msg) -> None:
        if isinstance(msg, Add):
            try:
                self._add(msg.request, msg, hold_for_fork=bool(msg.forks))
            except _core.InvalidRequestError as e:
                resolve(msg.accepted, RequestRefused(str(e), e.field))
                return
            resolve(msg.accepted)
            if msg.forks:
                self.pending_forks[msg.request.internal_id] = msg
            for req in (msg.request, *msg.forks):
                self.requests[req.internal_id] = req
                is_fork = req is not msg.request
                for add in self._add_hooks:
                    add(req, is_fork)
                if is_fork:  # a sample of the same prompt: the prompt counts once, as usage bills it
                    self.fork_parent[req.internal_id] = msg.request.internal_id
                else:
                    self.num_prompt_tokens += len(req.prompt_token_ids)
        elif isinstance(msg, Abort):
            if self._drop(msg.internal_id) is None:
                return
            if self.fork_parent.pop(msg.internal_id, None) is not None:
                return  # never reached the scheduler
            self.scheduler.abort(msg.internal_id)
            add = self.pending_forks.pop(msg.internal_id, None)
            for child in add.forks if add is not None else ():  # the parent left: its samples go alone
                if self.fork_parent.pop(child.internal_id, None) is not None:
                    self._add(child, add, hold_for_fork=False)
        else:
            raise TypeError(f"EngineCore got an unknown message {msg!r}")

    def _add(self, req: EngineRequest, msg: Add, hold_for_fork: bool) -> None:
        self.scheduler.add_request(
            req.internal_id,
            req.prompt_token_ids,
            max_tokens=msg.max_tokens,
            min_tokens=req.params.min_tokens,
            priority=msg.priority,
            adapter_id=msg.adapter_id,
            # prompt logprobs need every prompt token computed: a namespace of its own, never hit
            cache_salt=msg.cache_salt if req.params.prompt_logprobs is None
            else f"{msg.cache_salt}\x00prompt-logprobs\x00{req.internal_id}",
            stop_token_ids=msg.stop_token_ids,
            eos_token_id=msg.eos_token_id,
            ignore_eos=req.params.ignore_eos,
            hold_for_fork=hold_for_fork,
        )

    def stats(self) -> dict[str, float | int]:
        """The scheduler's gauges and counters (as last published), the token counts and the
        participants' counters (speculation's are 0 without a speculator), by the names /metrics
        publishes (`pyserve:<name>`)."""
        stats = {
            **self.published.scheduler_stats,
            "prompt_tokens": self.num_prompt_tokens,
            "generation_tokens": self.num_generation_tokens,
            **speculation_stats(),
        }
        for participant in self.participants:
            stats.update(participant.stats())
        return stats
