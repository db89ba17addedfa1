"""What a request returns (vLLM-style): per-request outputs holding one completion per sample."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    # Per generated token: {token_id: Logprob} for the sampled token and the top-k.
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or stop token that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    # With SamplingParams.prompt_logprobs: per prompt token, {token_id: Logprob} for the token
    # itself and the top alternatives; None for the first token (nothing before it).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    finished: bool = False
    first_token_time: float | None = None  # time.perf_counter() when a first output token was published
