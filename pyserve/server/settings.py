"""The server's settings (beside the engine's: pyserve.config)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from pyserve.options import option
from pyserve.prompt_budget import POLICIES, check_policy


@dataclass(slots=True, frozen=True)
class RequestPolicy:
    """What a served model does to the generation requests it gets (server.openai_api): output
    caps (`default_max_tokens` for a request naming none, `max_tokens_limit` the most one may
    ask; None: no cap of that kind); `concise`: chat requests get the concise instruction in
    their system prompt; `max_prompt_tokens`: the prompt budget (chats are fitted to it by
    `prompt_policy`, pyserve.prompt_budget; a longer completion prompt is refused)."""

    default_max_tokens: int | None = None
    max_tokens_limit: int | None = None
    concise: bool = False
    max_prompt_tokens: int | None = None
    prompt_policy: str = "turns"

    def __post_init__(self) -> None:
        if not isinstance(self.concise, bool):
            raise ValueError(f"concise must be true or false, got {self.concise!r}")
        check_policy(self.prompt_policy)
        for name in ("default_max_tokens", "max_tokens_limit", "max_prompt_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an int of at least 1, got {value!r}")
        if None not in (self.default_max_tokens, self.max_tokens_limit) and \
                self.default_max_tokens > self.max_tokens_limit:
            raise ValueError(f"default_max_tokens ({self.default_max_tokens}) must not exceed max_tokens_limit "
                             f"({self.max_tokens_limit})")


POLICY_KEYS = tuple(f.name for f in fields(RequestPolicy))  # also ServerSettings' flags of a model's policy


@dataclass(slots=True)
class ServerSettings:
    """The server's knobs, spelled once: `pyserve serve` derives its flags from them."""

    served_model_name: str
    api_key: str | None = option(None, "require 'Authorization: Bearer KEY' (or set PYSERVE_API_KEY)", type=str)
    max_waiting: int | None = option(None, "429 when a request would make more than this many sequences wait",
                                     type=int)
    max_body_bytes: int = option(1 << 20, "largest request body accepted (413 beyond)")
    default_max_tokens: int | None = option(
        None, "output tokens a generation request that names no max_tokens may take (default: the room left in "
        "the model's length)", type=int)
    max_tokens_limit: int | None = option(
        None, "the largest max_tokens a generation request may ask (a 400 naming max_tokens beyond); a request "
        "naming none is held to it too", type=int)
    concise: bool = option(False, "add --concise-instruction to every chat request's system prompt (a system "
                           "message first where it has none)")
    concise_instruction: str = option("Answer as briefly as the question allows: no preamble, no recap.",
                                      "the instruction --concise (or a models file entry's concise) adds")
    max_prompt_tokens: int | None = option(
        None, "the prompt budget: a chat's older turns are dropped to fit it (--prompt-policy), a longer completion "
        "prompt is refused (a request may ask a lower budget with its own max_prompt_tokens)", type=int)
    prompt_policy: str = option("turns", "how a chat is fitted to --max-prompt-tokens: 'turns' drops whole older "
                                "turns, 'turns+repeats' also drops passages repeated verbatim from earlier messages",
                                choices=list(POLICIES))
    public_metrics: bool = option(False, "serve /metrics without the API key")
    allowed_origins: list[str] = option(
        help="ORIGIN (e.g. https://app.example, or *) whose browser pages may call the API: CORS, preflights "
        "answered before the API key is checked (repeatable; none by default)",
        default_factory=list, action="append", type=str)
    lora_modules: dict[str, str] = field(default_factory=dict)  # name -> adapter directory, loaded at start
    lora_root: str | None = option(  # enables runtime load/unload, restricted to this directory
        None, "enable /v1/load_lora_adapter and /v1/unload_lora_adapter for adapters under DIR", type=str)
    stream_timeout: float = option(60.0, "seconds a streaming client may take to accept one chunk before it is dropped")
    max_stream_buffer: int = option(1024, "chunks a streaming client may leave unread before its request is aborted")
    trust_request_chat_template: bool = option(
        False, "accept a chat_template field in chat requests (rendered in the sandbox, under the timeout)")
    chat_template_timeout: float = option(2.0, "seconds a chat template may take to render")
    embedding_model: str = option(
        "wordllama", "the /v1/embeddings model (also the semantic cache's): 'wordllama' (WordLlama l2_supercat, "
        "shipped in the pinned wordllama package), a Hugging Face encoder directory, or 'none'", type=str)
    semantic_cache: bool = option(False, "answer chat requests like ones already answered from the semantic cache "
                                  "(pyserve.server.chat_cache)")
    semantic_cache_error_bound: float = option(
        0.01, "the semantic cache's threshold: the lowest at which the share of wrong hits on the calibration pairs "
        "is shown (at 95 percent confidence) to stay under this")
    semantic_cache_ttl: float = option(3600.0, "seconds a cache entry lives (hits do not renew it)")
    semantic_cache_max_entries: int = option(100_000, "cache entries kept at most (least recently used go first)")
    semantic_cache_max_bytes: int = option(256 << 20, "bytes of cache entries kept at most")
    semantic_cache_sampled: bool = option(False, "also cache requests that sample (temperature > 0, no seed)")
    route: list[str] = option(
        help="NAME=ROUTER.json: a served name whose requests the router (written by pyserve route-train) sends to its "
        "small or large model (repeatable)", default_factory=list, action="append", type=str)
    cascade: list[str] = option(
        help="NAME=SMALL,LARGE,MIN_LOGPROB: a served name answered by SMALL, escalated to LARGE when the mean "
        "logprob of the first line of its answer is below MIN_LOGPROB (repeatable)",
        default_factory=list, action="append", type=str)
    route_policy: list[str] = option(
        help="NAME=KEY:VALUE[,KEY:VALUE...]: a route's or cascade's request policy (default_max_tokens, "
        "max_tokens_limit, concise, max_prompt_tokens, prompt_policy) in place of the answering model's, key by key "
        "(repeatable)", default_factory=list, action="append", type=str)
    data_dir: str | None = option(
        None, "directory for the Batch API's files and job state and for stored responses (SQLite); /v1/files, "
        "/v1/batches and stored responses are off without it", type=str)
    responses_max_stored: int = option(10_000, "stored responses kept at most (--data-dir; the oldest go first)")
    responses_max_age: float = option(30 * 86400.0, "seconds a stored response is kept (--data-dir)")
    batch_max_file_bytes: int = option(200 << 20, "largest file /v1/files accepts (413 beyond)")
    batch_max_lines: int = option(50_000, "most lines a batch input file may have")
    batch_max_in_flight: int = option(
        256, "batch lines in the engine at once (while interactive requests run, a step runs at most "
        "--max-background-seqs of them, and each takes a batch line's seat when max-num-seqs are taken)")
    tool_call_parser: str = option("auto", "how the model writes tool calls: hermes, llama3_json, or auto (read "
                                   "from its chat template)", choices=["auto", "hermes", "llama3_json"])

    def request_policy(self, own: dict[str, Any] | None = None) -> RequestPolicy:
        """A served model's request policy: its `own` keys (its models file entry's) over the flags'
        of the same names."""
        return RequestPolicy(**({key: getattr(self, key) for key in POLICY_KEYS} | (own or {})))

    def __post_init__(self) -> None:
        for name in ("stream_timeout", "chat_template_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 < self.semantic_cache_error_bound < 1:
            raise ValueError(f"semantic_cache_error_bound must be in (0, 1), got {self.semantic_cache_error_bound}")
        if self.semantic_cache and self.embedding_model == "none":
            raise ValueError("semantic_cache needs an embedding model (embedding_model is 'none')")
        self.request_policy()  # checked at start
        if self.max_waiting is not None and self.max_waiting < 1:  # the request asking counts: 0 would refuse all
            raise ValueError(f"max_waiting must be at least 1, got {self.max_waiting}")
        if not self.responses_max_age > 0:
            raise ValueError(f"responses_max_age must be positive, got {self.responses_max_age}")
        for name in ("max_body_bytes", "batch_max_file_bytes", "batch_max_lines", "batch_max_in_flight",
                     "responses_max_stored"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_stream_buffer < 1:
            raise ValueError(f"max_stream_buffer must be at least 1, got {self.max_stream_buffer}")
