"""AsyncEngine: builds the actors (EngineCore, OutputProcessor) around one ModelWorker and gives
callers an async API. The offline `LLM` and the HTTP server both sit on it."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import gc
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from pyserve import _core
from pyserve.actors import ActorSystem, EngineDeadError
from pyserve.actors.loop_thread import SharedLoopThread, resolve
from pyserve.config import EngineConfig
from pyserve.engine.background import BackgroundLimit
from pyserve.engine.core import EngineCore
from pyserve.engine.output_processor import OutputProcessor, RequestStream
from pyserve.engine.outputs import CompletionOutput, RequestOutput
from pyserve.engine.participants.base import StepParticipant
from pyserve.engine.participants.grammar import GrammarStep
from pyserve.engine.participants.lora import LoraAdapters
from pyserve.engine.participants.output_tokens import OutputTokens
from pyserve.engine.participants.prompt_logprobs import PromptLogprobsGathering
from pyserve.engine.participants.speculation import Speculation
from pyserve.engine.step_budget import StepBudget
from pyserve.engine.watchdog import Watchdog
from pyserve.lora.request import LoRARequest
from pyserve.model.checkpoint import load_config, load_tokenizer
from pyserve.model.config import ModelConfig
from pyserve.model.hub import fetch_model
from pyserve.speculative.config import SpeculativeConfig, default_speculators
from pyserve.speculative.eagle_config import HeadConfig
from pyserve.speculative.proposer import NgramProposer, WorkerProposer
from pyserve.speculative.speculator import Speculator
from pyserve.step.request import Abort, Add, EngineRequest
from pyserve.step.sampling_params import SamplingParams
from pyserve.structured.compiler import Grammar, GrammarCompiler
from pyserve.structured.matchers import GrammarMatchers
from pyserve.structured.params import GrammarError, StructuredOutputsParams
from pyserve.worker.model_worker import ModelWorker

GRAMMAR_COMPILE_TIMEOUT = 1.0  # seconds
# The thread of every CPU engine in the process: they take turns, step by step (one OpenMP team;
# see AsyncEngine.__init__). A GPU engine has a thread of its own.
CPU_ENGINE_THREAD = SharedLoopThread("pyserve-engine")
atexit.register(gc.unfreeze)  # see AsyncEngine.start


@dataclass(slots=True, frozen=True)
class EngineHealth:
    """"ok"; "stalled" (requests held, no step completed for `seconds_without_step`); or "dead"
    (an actor crashed with `error`: nothing more can be served)."""

    status: str
    error: BaseException | None = None
    seconds_without_step: float = 0.0


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector held off for the block (left as it was if already off);
    what the block leaves is collected after it, if it is garbage at all."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


class AsyncEngine:
    """The engine's face, what callers (the server, LLM, the batch runner) use: `start`/`stop`,
    `add_request`, `abort`/`abort_nowait`, `load_lora`/`unload_lora`, `health()`, `num_waiting()`,
    `stats()`, `wait_idle()`, and the model facts `tokenizer`, `vocab_size`, `max_model_len`,
    `model_path`, `num_kv_blocks`. The actors and the worker inside are not part of it."""

    def __init__(self, config: EngineConfig, own_thread: bool = True):
        """`own_thread`: the EngineCore, which runs the model's forwards inline, runs on an engine
        thread and its loop (one for all the process's CPU engines, which take turns step by step;
        so one engine's forward that never returns holds the others too), so the caller's loop
        keeps serving during a forward (the server); without it the EngineCore shares the caller's
        loop (the offline LLM, whose loop serves nothing else: no thread hop per step)."""
        self.config = config
        self.model_path = fetch_model(config.model, config.revision, config.gguf_file)  # downloads a hub id
        # Loading creates a model's modules and a vocabulary's strings by the hundred thousand,
        # none of them garbage: with the collector on, its passes over them (and the whole heap's
        # every so often) took SmolLM2-135M-Instruct's load from 0.10-0.11 s to 0.21-0.23 and
        # Qwen2.5-Coder-1.5B's from 0.31-0.34 to 0.43-0.60.
        with _collector_paused():
            self.model_config = load_config(self.model_path)
            cfg = self.model_config
            self.max_model_len = cfg.served_length(config.max_model_len)
            cfg.check_context(self.max_model_len)
            self.spec_config = SpeculativeConfig.parse(config.speculative_config, default_speculators(self.model_path))
            self.tokenizer = load_tokenizer(self.model_path)
            spec = self.spec_config
            draft_config = self._check_draft(spec.model) if spec is not None and spec.method == "draft_model" else None
            head_config = HeadConfig.from_dir(spec.model, cfg) if spec is not None and spec.method == "eagle3" else None
            # The model is built on the thread that will run its forwards, and the CPU engines of a
            # process share that thread: libgomp gives every thread that starts parallel work a team
            # of its own, and once the teams hold more threads than the machine has cores their idle
            # threads stop spinning between parallel regions, so every kernel call pays for waking
            # them (SmolLM2's batch-1 decode ran at 0.7x on two cores beside a second team).
            self._threads = None if not own_thread else (
                CPU_ENGINE_THREAD if ModelWorker.runs_on_cpu(config) else SharedLoopThread("pyserve-engine"))
            self._engine_thread = None if self._threads is None else self._threads.acquire()

            def build() -> ModelWorker:
                return ModelWorker.from_config(config, cfg, model_dir=self.model_path, max_model_len=self.max_model_len,
                                               speculative=spec, draft_config=draft_config, head_config=head_config)

            try:
                self.worker = build() if self._engine_thread is None else self._engine_thread.call(build)
            except BaseException:
                self._close_engine_thread()
                raise
            try:
                self._assemble(spec)
            except BaseException:  # the worker's ranks and the thread's hold go with the engine that failed
                self.worker.close()
                self._close_engine_thread()
                raise

    def _assemble(self, spec: SpeculativeConfig | None) -> None:
        """The scheduler, output processing, grammars and actors around the built worker."""
        config, cfg = self.config, self.model_config
        self.scheduler = _core.Scheduler(
            num_blocks=self.worker.num_kv_blocks,
            block_size=config.block_size,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len,
            max_loras=config.max_loras,
            enable_prefix_caching=config.enable_prefix_caching,
            # a tree's drafts beyond a step's budget are cut by the scheduler (it keeps the first)
            num_lookahead_tokens=0 if spec is None else max(
                spec.num_speculative_tokens, min(spec.tree_nodes, config.max_num_batched_tokens - 1)),
        )
        eos = self.tokenizer.eos_token_id
        eos_ids = list(cfg.eos_token_ids) or ([eos] if eos is not None else [])
        if eos is not None and eos in eos_ids:
            eos_ids.remove(eos)
            eos_ids.insert(0, eos)
        self.eos_token_ids = eos_ids
        self.output_processor = OutputProcessor(self.tokenizer, eos_ids[0] if eos_ids else None)
        self.grammar_compiler = GrammarCompiler(self.tokenizer.inner.to_str, cfg.vocab_size, eos_ids)
        self.grammar_matchers = GrammarMatchers(cfg.vocab_size, eos_ids)
        target = config.max_inter_token_latency
        step_budget = StepBudget(target, config.max_num_batched_tokens) if target else None
        self.engine_core = EngineCore(self.scheduler, self.worker, self.output_processor, self._participants(spec),
                                      step_budget, BackgroundLimit(config.max_background_seqs))
        self.watchdog = None if config.watchdog_timeout is None else Watchdog(self.engine_core, config.watchdog_timeout)
        self.system = ActorSystem()
        self.system.on_failure(self.output_processor.fail_all)
        self.system.on_failure(self._fail_pending_adds)
        self.system.on_failure(self.worker.abort_group)
        self._ids = itertools.count()
        self.loras: dict[int, str] = {}  # adapter id -> path, loaded in the worker
        self._lora_locks: dict[int, asyncio.Lock] = {}
        self._pending_adds: set[asyncio.Future[None]] = set()  # Add messages not yet answered

    def _close_engine_thread(self) -> None:
        if self._engine_thread is not None:
            self._threads.release()
            self._engine_thread = None

    def _participants(self, spec: SpeculativeConfig | None) -> list[StepParticipant]:
        """The step's optional parts, in the order the EngineCore calls them: speculation
        before the grammar, whose forced tokens go out as drafts where the speculator drafted
        nothing."""
        forced = self.config.grammar_forced_tokens
        parts: list[StepParticipant] = [OutputTokens(), PromptLogprobsGathering()]
        if self.worker.lora is not None:
            parts.append(LoraAdapters())
        if spec is not None:
            proposer = (NgramProposer(self.scheduler, spec.prompt_lookup_min, spec.prompt_lookup_max)
                        if spec.method == "ngram" else WorkerProposer(self.worker))
            parts.append(Speculation(Speculator(spec, proposer, self.grammar_matchers, forced)))
        parts.append(GrammarStep(self.grammar_matchers, forced))
        return parts

    def _check_draft(self, draft_dir: str) -> ModelConfig:
        """The draft's config, once its tokenizer is known to be the target's."""
        draft_cfg = load_config(draft_dir)
        same_vocab = load_tokenizer(draft_dir).inner.get_vocab() == self.tokenizer.inner.get_vocab()
        if not same_vocab or draft_cfg.vocab_size != self.model_config.vocab_size:
            raise ValueError(f"speculative_config.model: the draft at {draft_dir} does not use the target's tokenizer")
        draft_cfg.check_context(self.max_model_len)
        return draft_cfg

    async def start(self) -> None:
        self.system.start(self.output_processor, *([self.watchdog] if self.watchdog else []))
        if self._threads is not None and self._engine_thread is None:  # started again after a stop
            self._engine_thread = self._threads.acquire()
        self.system.start(self.engine_core, thread=self._engine_thread)
        self.worker.on_failure(self.system.fail_threadsafe)  # a tensor-parallel rank that dies
        # What exists now lives as long as the engine (modules, tokenizer, imported libraries:
        # ~400k objects): out of the collector's sight, a full collection while serving scans
        # only what requests create instead of pausing the steps for ~0.3 s. Unfrozen when the
        # engine stops, or at exit (so that interpreter shutdown still finalizes them).
        gc.freeze()

    async def stop(self) -> None:
        await self.system.stop()
        self.worker.close()
        self.grammar_matchers.close()
        self.grammar_compiler.close()
        self._close_engine_thread()
        gc.unfreeze()  # a stopped engine's cycles are collectable again

    async def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        streaming: bool = True,
        max_pending: int | None = None,
        cache_salt: str = "",
    ) -> RequestStream:
        """Queues a request (one sequence per sample: the first computes the prompt, the others
        fork from it) and returns its stream; with `streaming`
        False only its cumulative output is kept (no per-step deltas); `max_pending` bounds the
        deltas a streaming consumer may leave unread (see RequestStream); `cache_salt` keeps
        the prefix cache of requests with different salts apart. Raises ValueError naming
        the field when it can never be served (a GrammarError for a constraint that does not
        compile)."""
        self.system.check_alive()
        prompt_token_ids = params.truncated(prompt_token_ids, self.max_model_len)
        if not -(2**31) <= priority < 2**31:  # the scheduler's i32: past it, the step would fail
            raise ValueError(f"priority: {priority} is outside [-2**31, 2**31)")
        vocab = self.model_config.vocab_size
        for name, ids in (("prompt_token_ids", prompt_token_ids), ("logit_bias", params.logit_bias or ()),
                          ("stop_token_ids", params.stop_token_ids)):
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:  # a kernel would index past the logits
                raise ValueError(f"{name}: token id {bad} is outside the vocabulary [0, {vocab})")
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty")
        grammar = None
        if params.structured_outputs is not None:
            grammar = await self.compile_grammar(params.structured_outputs)
        adapter_id = 0
        if lora_request is not None:
            await self.load_lora(lora_request)
            adapter_id = lora_request.lora_int_id
        extra_eos = [] if params.ignore_eos else self.eos_token_ids[1:]
        eos = self.eos_token_ids[0] if self.eos_token_ids else None
        stop_ids = list(params.stop_token_ids) + extra_eos
        ban = stop_ids + ([] if params.ignore_eos or eos is None else [eos])
        requests = []
        for index in range(params.n):
            req = EngineRequest(next(self._ids), request_id, index, params, list(prompt_token_ids), ban,
                                adapter_id=adapter_id, grammar=grammar)
            requests.append(req)
        output = RequestOutput(request_id, prompt, list(prompt_token_ids), [CompletionOutput(i) for i in range(params.n)])
        stream = RequestStream(output, [r.internal_id for r in requests], streaming, max_pending)
        self.output_processor.register(stream, requests)
        msg = Add(requests[0], asyncio.get_running_loop().create_future(), params.max_tokens, stop_ids, eos,
                  priority, adapter_id, cache_salt, forks=requests[1:])
        self._pending_adds.add(msg.accepted)
        try:
            await self.engine_core.send(msg)
            self.system.check_alive()  # NOTE: a dead EngineCore would never answer the add
            await msg.accepted
        except BaseException:  # refused, cancelled or dead: drop whatever was queued
            self.abort_nowait(request_id)
            raise
        finally:
            self._pending_adds.discard(msg.accepted)
        return stream

    async def compile_grammar(self, spec: StructuredOutputsParams) -> Grammar:
        """The compiled constraint (cached), compiled on the compiler's threads within
        GRAMMAR_COMPILE_TIMEOUT (the wait for a thread included; the vocabulary's one-off build
        not); a GrammarError says why it cannot be. A timed-out compile still waiting gives its
        place up; llguidance's own limits end a running one soon after."""
        compiler = self.grammar_compiler
        grammar = compiler.cached(spec)
        if grammar is not None:
            return grammar
        await asyncio.to_thread(compiler.prepare)
        compiling = compiler.submit(spec)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(compiling), GRAMMAR_COMPILE_TIMEOUT)
        except TimeoutError as e:
            compiling.cancel()
            raise GrammarError(f"the constraint did not compile within {GRAMMAR_COMPILE_TIMEOUT} s") from e

    async def load_lora(self, lora: LoRARequest) -> None:
        """Loads (once per id and path) and validates the adapter, off the event loop; raises a
        ValueError saying why an adapter is refused. The running engine is not affected."""
        if not self.config.enable_lora:
            raise ValueError("lora_request: the engine was started without enable_lora")
        async with self._lora_locks.setdefault(lora.lora_int_id, asyncio.Lock()):
            if self.loras.get(lora.lora_int_id) == lora.lora_path:
                return
            await asyncio.to_thread(self.worker.add_lora, lora.lora_int_id, lora.lora_path)
            self.loras[lora.lora_int_id] = lora.lora_path

    def unload_lora(self, adapter_id: int) -> None:
        """Frees an adapter's weights; call it once no request uses the adapter."""
        self.loras.pop(adapter_id, None)
        self.worker.remove_lora(adapter_id)

    def _fail_pending_adds(self, error: BaseException) -> None:
        for accepted in self._pending_adds:
            resolve(accepted, EngineDeadError(f"engine is dead: {error!r}"))

    async def wait_idle(self) -> None:
        """Returns once the engine has no unfinished sequence (the offline LLM, whose requests are
        all done). NOTE: a stop string aborts its sequence by a message, so the EngineCore may
        still hold the sequence, and its KV blocks, after the output is complete."""
        core = self.engine_core
        while core.published.busy:
            self.system.check_alive()
            with contextlib.suppress(TimeoutError):  # an actor that dies sets nothing: look again
                await asyncio.wait_for(core.idle.wait(), 0.1)

    async def abort(self, request_id: str) -> None:
        for internal_id in self.output_processor.forget(request_id):
            if self.system.error is not None:
                return  # a dead engine has nothing left to abort
            await self.engine_core.send(Abort(internal_id))

    def abort_nowait(self, request_id: str) -> None:
        """Aborts from code that must not await (a cancelled streaming response). A dead engine
        has nothing left to abort."""
        for internal_id in self.output_processor.forget(request_id):
            if self.system.error is not None:
                return
            self.engine_core.post(Abort(internal_id))

    def stats(self) -> dict[str, float | int | str]:
        """The EngineCore's counters and gauges, the served weights (their bytes and the
        quantization method, "none" for full precision) and, over several ranks, the
        tensor-parallel size and rank 0's seconds in collectives."""
        return {**self.engine_core.stats(), "weight_bytes": self.worker.weight_bytes,
                "quantization": self.worker.quantization or "none", **self.worker.parallel_stats}

    def health(self) -> EngineHealth:
        if self.system.error is not None:
            return EngineHealth("dead", self.system.error)
        if self.watchdog is not None and self.watchdog.stalled:
            return EngineHealth("stalled", seconds_without_step=self.watchdog.stalled_for)
        return EngineHealth("ok")

    def check_alive(self) -> None:
        """Raises EngineDeadError once an actor crashed."""
        self.system.check_alive()

    def num_waiting(self) -> int:
        """Sequences queued but not running."""
        return self.engine_core.published.num_waiting

    @property
    def num_kv_blocks(self) -> int:
        return self.worker.num_kv_blocks

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

