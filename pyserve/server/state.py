"""What the handlers share: the engine, the settings, the metrics, the LoRA registry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pyserve.server.lora_registry import LoraRegistry
from pyserve.server.metrics import Counter, Gauge, Histogram, Registry
from pyserve.server.settings import ServerSettings

if TYPE_CHECKING:  # the engine (and torch) load after the socket is bound: see server.startup
    from pyserve.engine.async_engine import AsyncEngine


@dataclass(slots=True)
class ServerMetrics:
    registry: Registry
    ttft: Histogram
    itl: Histogram
    e2e: Histogram
    outcomes: Counter
    lora_requests: Counter

    @classmethod
    def create(cls, engine: AsyncEngine) -> ServerMetrics:
        reg = Registry()

        def stat(key: str):
            return lambda: engine.stats()[key]

        reg.add(Gauge("pyserve:num_requests_running", "Sequences in the running queue.", stat("num_requests_running")))
        reg.add(Gauge("pyserve:num_requests_waiting", "Sequences waiting to be scheduled.", stat("num_requests_waiting")))
        reg.add(Gauge("pyserve:kv_cache_usage_perc", "Fraction of KV blocks referenced (0-1).", stat("kv_cache_usage_perc")))
        reg.add(Gauge("pyserve:kv_free_blocks", "KV blocks free (never used or evicted).", stat("kv_free_blocks")))
        reg.add(Gauge("pyserve:kv_cached_blocks", "KV blocks unreferenced but kept for the prefix cache.",
                      stat("kv_cached_blocks")))
        reg.add(Gauge("pyserve:kv_total_blocks", "KV blocks in the pool.", lambda: engine.num_kv_blocks))
        reg.add(Gauge("pyserve:weight_bytes", "Bytes of the served weights (as quantized, if they are).",
                      stat("weight_bytes")))
        reg.add(Gauge("pyserve:weight_quantization_info", "1, labelled with the served weights' quantization "
                      "method (none, int8, int4, gptq-int4, awq-int4, compressed-tensors-int4, ...).", lambda: 1,
                      labels={"method": str(engine.stats()["quantization"])}))
        for key, help_text in [
            ("prompt_tokens", "Prompt tokens received."),
            ("generation_tokens", "Tokens generated."),
            ("grammar_forced_tokens", "Tokens a grammar forced, verified as drafts (outside speculation)."),
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
            ("prefix_cache_hits", "Prompt tokens served from the prefix cache."),
            ("num_preemptions", "Sequences preempted (recomputed later)."),
            ("spec_decode_num_drafts", "Sequence steps that verified speculative draft tokens."),
            ("spec_decode_num_draft_tokens", "Speculative draft tokens verified."),
            ("spec_decode_num_accepted_tokens", "Speculative draft tokens accepted."),
        ]:
            reg.add(Gauge.counter(f"pyserve:{key}_total", help_text, stat(key)))
        reg.add(Gauge("pyserve:spec_decode_mean_acceptance_length",
                      "Tokens per verifying sequence step (accepted drafts + 1), averaged since start.",
                      stat("spec_decode_mean_acceptance_length")))
        reg.add(Gauge("pyserve:spec_decode_depth", "Draft tokens per sequence chosen for the next step (0 = off).",
                      stat("spec_decode_depth")))
        return cls(
            registry=reg,
            ttft=reg.add(Histogram("pyserve:time_to_first_token_seconds", "Time to first token.")),
            itl=reg.add(Histogram("pyserve:inter_token_latency_seconds", "Time between streamed tokens.")),
            e2e=reg.add(Histogram("pyserve:e2e_request_latency_seconds", "Request latency, arrival to finish.")),
            outcomes=reg.add(Counter("pyserve:request_outcomes_total", "Finished requests by outcome.")),
            lora_requests=reg.add(Counter("pyserve:lora_requests_total", "Requests per LoRA adapter.")),
        )


@dataclass(slots=True)
class ServerState:
    engine: AsyncEngine
    settings: ServerSettings
    metrics: ServerMetrics
    loras: LoraRegistry
    draining: bool = False
