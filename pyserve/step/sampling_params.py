"""Per-request sampling parameters (vLLM / OpenAI semantics), validated on construction."""

from __future__ import annotations

from dataclasses import InitVar, dataclass, field

from pyserve.structured.params import GrammarError, StructuredOutputsParams

MAX_LOGPROBS = 20
MAX_N = 128  # OpenAI's limit
MAX_LOGIT_BIAS = 300  # token ids one request may bias (OpenAI's limit)
GREEDY_BELOW = 1e-5  # temperatures this small are treated as greedy (as vLLM does)
INT32_MAX = 2**31 - 1


def is_greedy(temperature: float) -> bool:
    """Whether a request at `temperature` is greedy (its token the argmax of its logits): the one
    definition, which SamplingParams (it takes such a temperature as 0) and the semantic cache
    (it takes such a request as deterministic) both use."""
    return temperature < GREEDY_BELOW


@dataclass(frozen=True, slots=True)
class Bounds:
    """The values a numeric field takes: `kind` (int, or float which takes ints too) in
    [low, high], or (low, high] when low_open."""

    kind: type
    low: int | float
    high: int | float
    low_open: bool = False

    def check(self, name: str, value: object) -> None:
        """ValueError naming the field `name` where `value` is not such a value."""
        if self.kind is int:
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an int, got {value!r}")
        elif not isinstance(value, (int, float)) or isinstance(value, bool) or value != value:
            raise ValueError(f"{name} must be a number, got {value!r}")
        if value > self.high or value < self.low or (self.low_open and value == self.low):
            bound = f"{'(' if self.low_open else '['}{self.low}, {self.high}]"
            raise ValueError(f"{name} must be in {bound}, got {value}")


# Each sampling field's range, spelled once: SamplingParams checks its fields against it, and the
# HTTP schema's bounds are built from it (pyserve/server/schemas.py). OpenAI's API's ranges where
# it states one (temperature, top_p, n, the penalties, logprobs, logit_bias); otherwise pyserve's
# (counts and token ids within the scheduler's i32, repetition_penalty at most 10).
BOUNDS: dict[str, Bounds] = {
    "n": Bounds(int, 1, MAX_N),
    "temperature": Bounds(float, 0.0, 2.0),
    "top_p": Bounds(float, 0.0, 1.0, low_open=True),
    "top_k": Bounds(int, -1, INT32_MAX),  # 0 and -1: off
    "min_p": Bounds(float, 0.0, 1.0),
    "seed": Bounds(int, -(2**63), 2**63 - 1),
    "max_tokens": Bounds(int, 1, INT32_MAX),
    "min_tokens": Bounds(int, 0, INT32_MAX),
    "logprobs": Bounds(int, 0, MAX_LOGPROBS),  # top alternatives per token
    "prompt_logprobs": Bounds(int, 0, MAX_LOGPROBS),
    "presence_penalty": Bounds(float, -2.0, 2.0),
    "frequency_penalty": Bounds(float, -2.0, 2.0),
    "repetition_penalty": Bounds(float, 0.0, 10.0, low_open=True),  # 1: off
    "truncate_prompt_tokens": Bounds(int, -1, INT32_MAX),  # -1: the model's length; 0 is refused
}
NONE_MEANS_OFF = ("seed", "max_tokens", "logprobs", "prompt_logprobs", "truncate_prompt_tokens")  # may be None
TOKEN_ID = Bounds(int, 0, INT32_MAX)  # each of stop_token_ids, each key of logit_bias
LOGIT_BIAS = Bounds(float, -100.0, 100.0)  # each token's bias


def check_truncate_prompt_tokens(keep: int | None) -> None:
    """ValueError where `keep` is 0 (BOUNDS takes -1 up; 0 would keep the whole prompt)."""
    if keep == 0:
        raise ValueError("truncate_prompt_tokens must be -1 (the model's length) or at least 1, got 0")


def truncate_prompt(prompt_token_ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """The prompt's last `keep` tokens (-1: the model's length; None: the whole prompt), as vLLM's
    `truncate_prompt_tokens` keeps them."""
    check_truncate_prompt_tokens(keep)
    if keep is None:
        return prompt_token_ids
    keep = max_model_len if keep == -1 else keep
    return prompt_token_ids[-keep:] if len(prompt_token_ids) > keep else prompt_token_ids


@dataclass(slots=True)
class SamplingParams:
    """How to sample one request. Out-of-range values raise ValueError naming the field.

    temperature 0 is greedy, and so is any below GREEDY_BELOW (see is_greedy); top_k 0 or -1 disables top-k; top_p 1 and min_p 0 disable those.
    Penalties follow OpenAI (presence, frequency in [-2, 2]) and HF (repetition > 0, 1 = off).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    # Logprobs of the prompt's tokens (each given the tokens before it) with this many top
    # alternatives; the first token has none. Such a request skips the prefix cache.
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # keep the stop string that ended the text
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    detokenize: bool = True  # False: outputs carry token ids only (no text, no stop strings)
    # The output must match this constraint (a dict is read as StructuredOutputsParams' fields).
    structured_outputs: StructuredOutputsParams | None = None
    # Keep only the prompt's last this many tokens (-1: as many as the model's length), vLLM's
    # left truncation; None keeps it whole.
    truncate_prompt_tokens: int | None = None
    # vLLM's older name of structured_outputs (its GuidedDecodingParams have the same fields).
    guided_decoding: InitVar[StructuredOutputsParams | dict | None] = None

    def __post_init__(self, guided_decoding: StructuredOutputsParams | dict | None) -> None:
        if guided_decoding is not None:
            if self.structured_outputs is not None:
                raise ValueError("guided_decoding is vLLM's older name of structured_outputs: give one of them")
            self.structured_outputs = guided_decoding
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name) or []
            if not isinstance(value, (list, tuple)):
                raise ValueError(f"{name} must be a list, got {type(value).__name__}")
            setattr(self, name, list(value))
        for name, bounds in BOUNDS.items():
            value = getattr(self, name)
            if value is not None or name not in NONE_MEANS_OFF:
                bounds.check(name, value)
        if is_greedy(self.temperature):
            self.temperature = 0.0  # the sampler's rows: 0 = greedy
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)
        for i, s in enumerate(self.stop):
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop[{i}] must be a non-empty string")
        for i, t in enumerate(self.stop_token_ids):
            TOKEN_ID.check(f"stop_token_ids[{i}]", t)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError("ignore_eos must be a bool")
        for name in ("skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias must be a dict of at most {MAX_LOGIT_BIAS} token ids")
            for t, b in self.logit_bias.items():
                TOKEN_ID.check("logit_bias token id", t)
                LOGIT_BIAS.check(f"logit_bias[{t}]", b)
            self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()} or None
        if not isinstance(self.detokenize, bool):
            raise ValueError("detokenize must be a bool")
        if self.stop and not self.detokenize:
            raise ValueError("stop: stop strings need detokenize=True")
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except (TypeError, GrammarError) as e:
                raise GrammarError(f"structured_outputs: {e}") from e
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError("structured_outputs must be a StructuredOutputsParams or a dict of its fields")
            if self.min_tokens:
                raise ValueError("min_tokens: not supported with structured_outputs (the grammar decides "
                                 "where the output may end)")

    def truncated(self, prompt_token_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt the model is given (truncate_prompt)."""
        return truncate_prompt(prompt_token_ids, self.truncate_prompt_tokens, max_model_len)

    @property
    def greedy(self) -> bool:
        return is_greedy(self.temperature)

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that changes the logits or asks for more than the token (no
        penalties, no logit bias, no logprobs): such a row's token is the argmax of its logits,
        once `min_tokens` no longer bans any token."""
        return (self.greedy and self.logprobs is None and not self.presence_penalty
                and not self.frequency_penalty and self.repetition_penalty == 1.0 and self.logit_bias is None)

