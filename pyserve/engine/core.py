"""EngineCore: the step loop, the one owner of the Rust scheduler.

Each turn: drain the inbox (adds, aborts), `schedule` (within the StepBudget's token budget,
fitted to the measured seconds of the worker's steps), run the model worker, `update` the
scheduler with the sampled tokens, and send the step's output, as `update` returned it, to the
OutputProcessor. The worker's forwards run inline, so this actor's loop serves nothing that must
answer meanwhile: the server gives it a thread of its own (see AsyncEngine). The scheduler holds every request's tokens; this actor keeps only what the
scheduler does not know (sampling parameters, samples waiting to fork). It never touches tensors.
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
from pyserve.engine.prompt_logprobs import PromptLogprobs
from pyserve.step.request import (Abort, Add, EngineRequest, Logprobs, PromptRows, RequestRefused, StepOutput,
                                  StepRows)
from pyserve.actors.loop_thread import resolve
from pyserve.engine.background import BackgroundLimit
from pyserve.engine.step_budget import StepBudget
from pyserve.speculative.speculator import can_speculate, speculation_stats
from pyserve.structured.matchers import GrammarMatchers, MaskRow

log = structlog.get_logger("pyserve.engine")

NO_TOKENS = np.empty(0, dtype=np.int64)
MAX_FORCED_TOKENS = 32  # forced tokens one step verifies for a request


@dataclass(frozen=True, slots=True)
class Published:
    """What the EngineCore shows other threads (the server's, the watchdog's) of the scheduler it
    alone calls: replaced whole after every step and every drained inbox, never changed in place."""

    busy: bool  # unfinished requests held
    num_waiting: int
    scheduler_stats: dict[str, float | int]


class EngineCore(Actor):
    def __init__(self, scheduler: _core.Scheduler, worker, output_processor: Actor, speculator=None,
                 step_budget: StepBudget | None = None, grammar: GrammarMatchers | None = None,
                 forced_tokens: bool = True, background: BackgroundLimit | None = None):
        super().__init__("engine_core")
        self.background = background  # None: batch-job lines fill any step
        self.grammar = grammar  # the matchers of constrained requests (None: no structured outputs)
        self.forced_tokens = forced_tokens  # tokens a grammar forces go out as drafts of the next step
        self.num_forced_tokens = 0
        self.step_budget = step_budget  # None: every step may take max_num_batched_tokens
        self.speculator = speculator
        self.scheduler = scheduler
        self.worker = worker
        self.output_processor = output_processor
        self.requests: dict[int, EngineRequest] = {}
        self.pending_forks: dict[int, Add] = {}  # held parent's id -> its Add, whose forks wait
        self.fork_parent: dict[int, int] = {}  # a sample waiting to fork -> its parent's id
        self.num_needing_output = 0  # live requests whose penalties read their output
        self.prompt_logprobs: dict[int, PromptLogprobs] = {}  # requests prefilling with prompt logprobs
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
            await self._drain_inbox(block=idle)
            if idle:  # work arrived: the no-progress clock starts now
                self.last_progress = time.monotonic()
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
            ready = self.scheduler.update(NO_TOKENS, NO_TOKENS).fork_ready
            if out.finished_req_ids.size and self.speculator is not None:  # aborted while nothing ran
                self.speculator.forget(out.finished_req_ids.tolist())
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
        if self.num_needing_output:
            token_ids = self.scheduler.token_ids
            rows.output_token_ids = [token_ids(r.internal_id, len(r.prompt_token_ids)) if r.needs_output else None
                                     for r in rows.requests]
        if self.grammar:  # masks computed on the grammar's thread while the forward runs
            mask_rows = self._mask_rows(out, rows, with_logits)
            if mask_rows:
                rows.token_masks = self.grammar.start_masks(mask_rows)
        prompt_rows = self._prompt_rows(req_ids) if self.prompt_logprobs else None
        adapter_ids = None
        if self.worker.lora is not None:  # per-request adapters exist only with LoRA enabled
            adapter_ids = np.fromiter((self.requests[rid].adapter_id for rid in req_ids), np.int64, len(req_ids))
        await anyio.sleep(0)  # once per step: the loop delivers what arrived meanwhile
        start = time.perf_counter()
        result = self.worker.execute(out, rows, adapter_ids, prompt_rows)
        seconds = time.perf_counter() - start
        self.last_progress = time.monotonic()
        if self.step_budget is not None:
            self.step_budget.observe(int(out.total_num_tokens), seconds)
        num_sampled = np.zeros(out.num_reqs, dtype=np.int64)
        num_sampled[with_logits] = result.num_sampled
        update = self.scheduler.update(result.token_ids, num_sampled)
        finished = dict(zip(update.finished_req_ids.tolist(), update.finish_reasons))
        prompt_done = None  # before the finished leave: a prompt may end with its only output token
        if prompt_rows is not None:
            prompt_done = self._gather_prompt_logprobs(prompt_rows, req_ids, result, update.req_ids)
        failures = self._advance_grammars(update, finished) if self.grammar else None
        for rid in finished:
            self._drop(rid)
        logprobs = None if result.logprobs is None else result.logprobs[update.sampled_index]
        step = StepOutput(update.req_ids, update.token_ids, update.starts, finished, update.num_cached_tokens,
                          logprobs, failures, reply_to=self)
        step.prompt_logprobs = prompt_done
        self.num_generation_tokens += len(step.token_ids)
        self._fork(update.fork_ready)
        if step.internal_ids:
            await self.output_processor.send(step)
        if self.speculator is not None:  # after the tokens went out: proposing may run a draft model
            num_output = out.num_output_tokens + update.num_appended
            drafts = await self.speculator.after_step(out, num_sampled, num_output, seconds, set(finished),
                                                      self.requests, self.scheduler.token_ids)
            for rid, tokens in drafts.items():
                self.scheduler.set_spec_tokens(rid, tokens)
        if self.grammar and self.forced_tokens and (self.speculator is None or not self.speculator.last_depth):
            self._draft_forced_tokens(update.req_ids, finished)

    def _prompt_rows(self, req_ids: list[int]) -> PromptRows | None:
        index = [i for i, rid in enumerate(req_ids) if rid in self.prompt_logprobs]
        if not index:
            return None
        reqs = [self.requests[req_ids[i]] for i in index]
        return PromptRows(index, [r.prompt_token_ids for r in reqs], [r.params.prompt_logprobs for r in reqs])

    def _gather_prompt_logprobs(self, prompt_rows: PromptRows, req_ids: list[int], result,
                                got_tokens: list[int]) -> dict[int, Logprobs] | None:
        """Writes the step's prompt logprobs; returns those of the requests whose prompts are
        done (their first token came this step), which leave the buffers."""
        for i, (token_indices, logprobs) in zip(prompt_rows.index, result.prompt_logprobs, strict=True):
            buffer = self.prompt_logprobs.get(req_ids[i])
            if buffer is not None and len(token_indices):
                buffer.write(token_indices, logprobs)
        done = {}
        for rid in got_tokens:
            buffer = self.prompt_logprobs.get(rid)
            if buffer is not None and buffer.complete:
                done[rid] = self.prompt_logprobs.pop(rid).rows
        return done or None

    def _mask_rows(self, out, rows: StepRows, with_logits: np.ndarray) -> list[MaskRow]:
        """The constrained rows of a step: each one's first logits row, and the drafts its
        further logits rows verify (the input token after each row's position)."""
        counts = out.num_logits[with_logits]
        firsts = np.cumsum(counts) - counts
        mask_rows = []
        for req, first, count in zip(rows.requests, firsts.tolist(), counts.tolist()):
            if req.internal_id in self.grammar:
                drafts = out.input_ids[out.logits_indices[first + 1 : first + count]].tolist() if count > 1 else []
                mask_rows.append(MaskRow(req.internal_id, first, drafts))
        return mask_rows

    def _advance_grammars(self, update, finished: dict[int, str]) -> dict[int, str] | None:
        """Feeds each constrained request's matcher the tokens the step kept. A sequence whose
        matcher could not follow them leaves the scheduler: returned with why, it fails."""
        tokens, starts = update.token_ids, update.starts
        failures = {}
        for i, rid in enumerate(update.req_ids):
            why = self.grammar.advance(rid, tokens[starts[i] : starts[i + 1]]) if rid in self.grammar else None
            if why is not None:
                log.warning("grammar_failed", internal_id=rid, reason=why)
                failures[rid] = why
                if rid not in finished:
                    self.scheduler.abort(rid)
                self._drop(rid)
        return failures or None

    def _draft_forced_tokens(self, req_ids: list[int], finished: dict[int, str]) -> None:
        """The tokens each constrained request's grammar forces next become its drafts, checked
        all in the next step instead of one step per token: a draft whose mask allows it alone
        is kept unverified; one whose bytes the tokenizer could also split otherwise is
        verified like any draft (so the output is what one token per step writes). Where the
        speculator drafts, it merges them itself."""
        for rid in req_ids:
            req = self.requests.get(rid)
            if req is None or rid in finished or rid not in self.grammar or not can_speculate(req, 0):
                continue
            forced = self.grammar.forced_tokens(rid)[:MAX_FORCED_TOKENS]
            if forced:
                self.scheduler.set_spec_tokens(rid, forced)
                self.num_forced_tokens += len(forced)

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
        self.prompt_logprobs.pop(internal_id, None)
        if req is not None and req.needs_output:
            self.num_needing_output -= 1
        if req is not None and req.grammar is not None:
            self.grammar.drop(internal_id)
        return req

    async def _drain_inbox(self, block: bool) -> None:
        if block:
            self._handle(await self.receive())
        while (msg := self.receive_nowait()) is not None:
            self._handle(msg)

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
                if req.params.prompt_logprobs is not None and req is msg.request:  # forks share its prompt
                    self.prompt_logprobs[req.internal_id] = PromptLogprobs(len(req.prompt_token_ids),
                                                                           req.params.prompt_logprobs)
                if req.grammar is not None:
                    self.grammar.add(req.internal_id, req.grammar)
                self.num_needing_output += req.needs_output
                self.num_prompt_tokens += len(req.prompt_token_ids)
                if req is not msg.request:
                    self.fork_parent[req.internal_id] = msg.request.internal_id
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
        """The scheduler's gauges and counters (as last published), the token counts and
        speculation's, by the names /metrics publishes (`pyserve:<name>`)."""
        return {
            **self.published.scheduler_stats,
            "prompt_tokens": self.num_prompt_tokens,
            "generation_tokens": self.num_generation_tokens,
            "grammar_forced_tokens": self.num_forced_tokens,
            **(self.speculator.stats() if self.speculator is not None else speculation_stats()),
        }
