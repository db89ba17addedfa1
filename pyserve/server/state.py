"""What the handlers share: the served models (engines and adapters), the settings, the metrics."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pyserve.http.metrics import Counter, Gauge, Histogram, Registry
from pyserve.server.models import ModelTable
from pyserve.server.settings import ServerSettings

if TYPE_CHECKING:
    from pyserve.batches.service import BatchService
    from pyserve.server.response_store import ResponseStore
    from pyserve.embeddings.encoder import Encoder
    from pyserve.server.chat_cache import ChatCache


@dataclass(slots=True)
class ServerMetrics:
    registry: Registry
    ttft: Histogram
    itl: Histogram
    e2e: Histogram
    outcomes: Counter
    lora_requests: Counter
    requests: Counter
    embedding_inputs: Counter
    cache_lookup: Histogram
    route_requests: Counter
    cascade_escalations: Counter

    @classmethod
    def create(cls, models: ModelTable, cache: ChatCache | None = None) -> ServerMetrics:
        """The engines' gauges carry a `model` label, one series per served model."""
        reg = Registry()
        if cache is not None:
            for name, help_text, read, kind in [
                ("hits_total", "Chat requests answered from the semantic cache.", lambda: cache.hits, "counter"),
                ("misses_total", "Chat requests looked up and not found.", lambda: cache.misses, "counter"),
                ("stores_total", "Answers stored.", lambda: cache.stores, "counter"),
                ("evictions_total", "Entries dropped for room.", lambda: cache.store.evictions, "counter"),
                ("entries", "Entries held.", lambda: len(cache.store), "gauge"),
                ("bytes", "Bytes of the entries held.", lambda: cache.store.bytes, "gauge"),
                ("threshold", "The calibrated similarity threshold.", lambda: cache.calibration.threshold, "gauge"),
            ]:
                reg.add(Gauge(f"pyserve:semantic_cache_{name}", help_text, read, kind=kind))

        def per_model(name: str, help_text: str, key: str | None = None, *, counter: bool = False,
                      read=None, labels=None) -> None:
            """One series per model: `read(engine)`, or the engine's stats()[key]."""
            gauge = reg.add(Gauge(name, help_text, kind="counter" if counter else "gauge"))
            for m in models:
                fn = (lambda e=m.engine: read(e)) if read else (lambda e=m.engine: e.stats()[key])
                gauge.add_series({"model": m.name, **(labels(m.engine) if labels else {})}, fn)

        per_model("pyserve:num_requests_running", "Sequences in the running queue.", "num_requests_running")
        per_model("pyserve:num_requests_waiting", "Sequences waiting to be scheduled.", "num_requests_waiting")
        per_model("pyserve:kv_cache_usage_perc", "Fraction of KV blocks referenced (0-1).", "kv_cache_usage_perc")
        per_model("pyserve:kv_free_blocks", "KV blocks free (never used or evicted).", "kv_free_blocks")
        per_model("pyserve:kv_cached_blocks", "KV blocks unreferenced but kept for the prefix cache.",
                  "kv_cached_blocks")
        per_model("pyserve:kv_total_blocks", "KV blocks in the pool.", read=lambda e: e.num_kv_blocks)
        per_model("pyserve:weight_bytes", "Bytes of the served weights (as quantized, if they are).", "weight_bytes")
        per_model("pyserve:weight_quantization_info", "1, labelled with the served weights' quantization "
                  "method (none, int8, int4, gptq-int4, awq-int4, compressed-tensors-int4, ...).",
                  read=lambda e: 1, labels=lambda e: {"method": str(e.stats()["quantization"])})
        for key, help_text in [
            ("prompt_tokens", "Prompt tokens received (once for a request's n samples, as usage counts them)."),
            ("generation_tokens", "Tokens generated."),
            ("grammar_forced_tokens", "Tokens a grammar forced, verified as drafts (outside speculation)."),
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
            ("prefix_cache_hits", "Prompt tokens served from the prefix cache."),
            ("num_preemptions", "Sequences preempted (recomputed later)."),
            ("spec_decode_num_drafts", "Sequence steps that verified speculative draft tokens."),
            ("spec_decode_num_draft_tokens", "Speculative draft tokens verified."),
            ("spec_decode_num_accepted_tokens", "Speculative draft tokens accepted."),
            ("spec_decode_num_trees", "Sequence steps that verified a token tree of drafts."),
            ("spec_decode_num_tree_nodes", "Draft tokens verified in token trees."),
        ]:
            per_model(f"pyserve:{key}_total", help_text, key, counter=True)
        per_model("pyserve:spec_decode_mean_acceptance_length",
                  "Tokens per verifying sequence step (accepted drafts + 1), averaged since start.",
                  "spec_decode_mean_acceptance_length")
        per_model("pyserve:spec_decode_depth",
                  "Draft tokens per sequence chosen for the latest step with requests that may draft (0 = off).",
                  "spec_decode_depth")
        for key, help_text in [
            ("spec_decode_num_draft_tokens_per_pos", "Speculative draft tokens verified, by draft position (from 0; "
             "a token tree's by depth)."),
            ("spec_decode_num_accepted_tokens_per_pos", "Speculative draft tokens accepted, by draft position."),
        ]:
            gauge = reg.add(Gauge.counter(f"pyserve:{key}_total", help_text))
            for m in models:
                for position in range(len(m.engine.stats()[key])):
                    gauge.add_series({"model": m.name, "position": str(position)},
                                     lambda e=m.engine, key=key, p=position: e.stats()[key][p])
        return cls(
            registry=reg,
            ttft=reg.add(Histogram("pyserve:time_to_first_token_seconds", "Time to first token.")),
            itl=reg.add(Histogram("pyserve:inter_token_latency_seconds",
                                  "Time between generated tokens (a non-streamed choice: its mean gap, once per token).")),
            e2e=reg.add(Histogram("pyserve:e2e_request_latency_seconds", "Request latency, arrival to finish.")),
            outcomes=reg.add(Counter("pyserve:request_outcomes_total", "Finished requests by outcome.")),
            lora_requests=reg.add(Counter("pyserve:lora_requests_total", "Requests per LoRA adapter.")),
            requests=reg.add(Counter("pyserve:requests_total", "Requests per served model and adapter (adapter "
                                     "\"\" for the base model).")),
            embedding_inputs=reg.add(Counter("pyserve:embedding_inputs_total", "Inputs embedded by /v1/embeddings.")),
            route_requests=reg.add(Counter("pyserve:route_requests_total", "Requests to a route or cascade, by the "
                                           "model that answered.")),
            cascade_escalations=reg.add(Counter("pyserve:cascade_escalations_total", "Cascade requests the small "
                                                "model's confidence sent on to the large one.")),
            cache_lookup=reg.add(Histogram("pyserve:semantic_cache_lookup_seconds", "Semantic cache lookups (the "
                                           "index search and checks, after the embedding).")),
        )


@dataclass(slots=True)
class ServerState:
    models: ModelTable
    settings: ServerSettings
    metrics: ServerMetrics
    encoder: Encoder | None = None  # /v1/embeddings, the semantic cache, the router
    cache: ChatCache | None = None
    batches: BatchService | None = None  # the Batch API, with --data-dir
    responses: ResponseStore | None = None  # stored responses (the Responses API), with --data-dir
    draining: bool = False
    # The completion requests being answered (server.completion_context adds and drops them;
    # weakly, so that one whose response was never iterated goes with it): what a shutdown whose
    # time runs out ends, each with an error its client reads.
    answering: weakref.WeakSet = field(default_factory=weakref.WeakSet)

    def end_requests(self, reason: str) -> None:
        """Ends every request being answered now: its sequences aborted, a 503 or a stream's
        error event saying `reason` sent in its place."""
        for ctx in list(self.answering):
            ctx.end(reason)
