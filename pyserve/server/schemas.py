"""Request bodies of the OpenAI endpoints, validated with pydantic. Bounds are enforced here,
before any work is queued; a sampling field's are the ones SamplingParams checks (its BOUNDS).
Every top-level field is either served, accepted because it cannot change the output
(NO_EFFECT_FIELDS), or refused with a 400 naming it (REFUSED_FIELDS, and any field this server
does not know); nested objects forbid keys they do not name, but for a few that change nothing;
`check()` refuses combinations OpenAI's API refuses. A client never believes a field took effect
when it did not."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pyserve.http.errors import BadRequest
from pyserve.model.tokenizer import check_continuable, check_template_kwargs
from pyserve.prompt_budget import POLICIES
from pyserve.step.sampling_params import BOUNDS, LOGIT_BIAS, MAX_LOGIT_BIAS, TOKEN_ID, Bounds
from pyserve.structured.params import GrammarError, StructuredOutputsParams
from pyserve.structured.strict_schema import closed_objects

MAX_STOP = 16
MAX_STOP_LEN = 256
MAX_CHAT_TEMPLATE = 64 * 1024
MAX_TOOLS = 128  # OpenAI's limit


# Fields that only label, store or route a request: accepted, with no effect on its output.
NO_EFFECT_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key",
                              "safety_identifier", "request_id"})
# Fields that would change the output and are not served, each with the values that mean "off".
REFUSED_FIELDS: dict[str, tuple[Any, ...]] = {
    "suffix": (None, ""), "prompt_logprobs": (None,), "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0), "allowed_token_ids": (None,), "bad_words": (None, []),
    "logits_processors": (None, []),
    "spaces_between_special_tokens": (None, True), "return_tokens_as_token_ids": (None, False),
    "prediction": (None,), "audio": (None,), "modalities": (None, ["text"]), "web_search_options": (None,),
    "reasoning_effort": (None,), "verbosity": (None,), "guided_whitespace_pattern": (None,),
    "documents": (None,), "mm_processor_kwargs": (None,),
    "add_special_tokens": (None,), "kv_transfer_params": (None,), "vllm_xargs": (None,),
    "structural_tag": (None,),
}
GUIDED_BACKENDS = ("auto", "guidance", "llguidance")


def bounded(field: str | Bounds, low: int | None = None) -> Any:
    """pydantic's bounds of a sampling field, as SamplingParams checks it (its BOUNDS, by name);
    `low` where a field of the API takes less than the engine (a completion's max_tokens 0)."""
    b = BOUNDS[field] if isinstance(field, str) else field
    if low is not None:
        return Field(ge=low, le=b.high)
    return Field(gt=b.low, le=b.high) if b.low_open else Field(ge=b.low, le=b.high)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    # OpenAI pads chunks with random characters unless this is false; this server never pads.
    include_obfuscation: Literal[False] | None = None


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text (no constraint), any JSON object, or a JSON schema."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def constraint(self) -> StructuredOutputsParams:
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.json_schema is None:
            raise GrammarError("json_schema: required when type is json_schema")
        schema = self.json_schema.json_schema if self.json_schema.json_schema is not None else {}
        return StructuredOutputsParams(json=closed_objects(schema) if self.json_schema.strict else schema)


class StructuredOutputsField(BaseModel):
    """vLLM's structured_outputs: exactly one of json, regex, choice, grammar, json_object."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def constraint(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(json=self.json_, regex=self.regex, choice=self.choice, grammar=self.grammar,
                                       json_object=bool(self.json_object))


class SamplingFields(BaseModel):
    """Fields shared by chat and completions."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: Annotated[int, bounded("max_tokens")] | None = None
    temperature: Annotated[float, bounded("temperature")] | None = None
    top_p: Annotated[float, bounded("top_p")] | None = None
    top_k: Annotated[int, bounded("top_k")] | None = None
    min_p: Annotated[float, bounded("min_p")] | None = None
    seed: Annotated[int, bounded("seed")] | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    n: Annotated[int, bounded("n")] = 1
    presence_penalty: Annotated[float, bounded("presence_penalty")] = 0.0
    frequency_penalty: Annotated[float, bounded("frequency_penalty")] = 0.0
    repetition_penalty: Annotated[float, bounded("repetition_penalty")] = 1.0
    ignore_eos: bool = False
    min_tokens: Annotated[int, bounded("min_tokens")] = 0
    truncate_prompt_tokens: Annotated[int, bounded("truncate_prompt_tokens")] | None = None
    max_prompt_tokens: Annotated[int, Field(ge=1, le=2**31 - 1)] | None = None  # at most the model's budget
    stop_token_ids: Annotated[list[Annotated[int, bounded(TOKEN_ID)]], Field(max_length=MAX_STOP)] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: Annotated[dict[str, Annotated[float, bounded(LOGIT_BIAS)]], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    priority: Annotated[int, Field(ge=-(2**31), le=2**31 - 1)] = 0  # the scheduler's i32
    cache_salt: Annotated[str, Field(max_length=256)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None

    def check(self) -> None:
        """Refuses combinations of fields that are each valid alone, as OpenAI's API does."""
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options: allowed only with stream", param="stream_options")

    def wants_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk (stream_options.include_usage)."""
        return self.stream_options is not None and self.stream_options.include_usage

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key in v or {}:
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"keys must be token ids (digits 0-9), got {key!r}")
        return v

    @field_validator("guided_decoding_backend")
    @classmethod
    def _backend(cls, v: str | None) -> str | None:
        if v is not None and v not in GUIDED_BACKENDS:
            raise ValueError(f"this server decodes with llguidance; use one of {', '.join(GUIDED_BACKENDS)}")
        return v

    def constraint(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """The output constraint and the field that gave it; at most one field may. A
        GrammarError names what is wrong (the caller names the field)."""
        given = []
        if self.response_format is not None and self.response_format.type != "text":
            given.append(("response_format", self.response_format.constraint))
        if self.structured_outputs is not None:
            given.append(("structured_outputs", self.structured_outputs.constraint))
        guided = {k: getattr(self, f"guided_{k}") for k in ("json", "regex", "choice", "grammar")}
        for k, v in guided.items():
            if v is not None:
                given.append((f"guided_{k}", lambda k=k, v=v: StructuredOutputsParams(**{k: v})))
        if len(given) > 1:
            raise GrammarError(f"give one constraint, not {' and '.join(name for name, _ in given)}", given[1][0])
        if not given:
            return None, None
        name, make = given[0]
        try:
            return make(), name
        except GrammarError as e:
            raise GrammarError(str(e), name) from e

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        for s in stops:
            if not s or len(s) > MAX_STOP_LEN:
                raise ValueError(f"each stop string must have 1 to {MAX_STOP_LEN} characters")
        return stops


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None  # a prompt-caching hint: this server caches every prefix anyway


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str


class MessageToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction
    index: int | None = None  # kept by clients that gathered the call from a stream's deltas


class ChatMessage(BaseModel):
    """A message; the fields of a response's message that a client may send back as they came
    (refusal, annotations, audio, reasoning_content) are accepted when empty. The legacy shapes
    (an assistant's `function_call`, a `function` message with its result) reach the chat
    template as a tool call and a tool message."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    refusal: None = None
    annotations: Annotated[list[Any], Field(max_length=0)] | None = None
    audio: None = None
    function_call: CalledFunction | None = None  # a legacy assistant's call
    reasoning_content: None = None

    @model_validator(mode="after")
    def _content_given(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":  # an assistant's may be its tool calls alone
            raise ValueError(f"content: required in a {self.role} message")
        if self.function_call is not None and (self.role != "assistant" or self.tool_calls):
            raise ValueError("function_call: only in an assistant message without tool_calls")
        if self.role == "function" and not self.name:
            raise ValueError("name: required in a function message (the function it answers)")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("tool_call_id: required in a tool message (the call it answers)")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""

    def for_template(self) -> dict[str, Any]:
        """The message as Hugging Face chat templates take it: tool calls with their arguments
        as objects (as the model wrote them, when they are not valid JSON)."""
        out: dict[str, Any] = {"role": "tool" if self.role == "function" else self.role, "content": self.text()}
        if self.name:
            out["name"] = self.name
        calls = self.tool_calls or ([MessageToolCall(id="call_0", function=self.function_call)]
                                    if self.function_call is not None else [])
        if calls:
            out["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name, "arguments": _json_or_text(c.function.arguments)}}
                                 for c in calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def check_template_options(messages: list[dict[str, Any]], add_generation_prompt: bool,
                           continue_final_message: bool, chat_template_kwargs: dict[str, Any] | None) -> None:
    """vLLM's chat template fields, as a chat request and /tokenize take them: a 400 naming the
    field where the template cannot honour one."""
    try:
        if continue_final_message:
            check_continuable(messages, add_generation_prompt)
    except ValueError as e:
        raise BadRequest(str(e), param="continue_final_message") from e
    try:
        check_template_kwargs(chat_template_kwargs or {})
    except ValueError as e:
        raise BadRequest(str(e), param="chat_template_kwargs") from e


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, bounded("max_tokens")] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, bounded("logprobs")] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: the last (assistant) message is continued, not closed
    chat_template_kwargs: dict[str, Any] | None = None  # more variables for the chat template (vLLM's)
    chat_template: Annotated[str, Field(min_length=1, max_length=MAX_CHAT_TEMPLATE)] | None = None
    tools: Annotated[list[ToolDef], Field(min_length=1, max_length=MAX_TOOLS)] | None = None  # [] refused, as OpenAI
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    functions: Annotated[list[FunctionDef], Field(min_length=1, max_length=MAX_TOOLS)] | None = None  # legacy tools
    function_call: Literal["none", "auto"] | NamedFunction | None = None  # legacy tool_choice
    prompt_policy: Literal[POLICIES] | None = None  # how the prompt budget fits the messages

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.for_template() for m in self.messages]

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequest("top_logprobs: needs logprobs set to true", param="top_logprobs")
        if "parallel_tool_calls" in self.model_fields_set and self.tools is None:
            raise BadRequest("parallel_tool_calls: allowed only with tools", param="parallel_tool_calls")
        check_template_options(self.template_messages(), self.add_generation_prompt, self.continue_final_message,
                               self.chat_template_kwargs)
        # As OpenAI's: a tool message answers an earlier call, and an assistant message's calls
        # are each answered by the tool messages right after it.
        called: set[str] = set()
        at, unanswered = 0, []  # the last message with calls, and its calls no tool message answered yet
        for i, m in enumerate(self.messages):
            if m.role == "tool":
                if m.tool_call_id not in called:
                    raise BadRequest(f"messages.{i}.tool_call_id: no earlier assistant message has a tool call "
                                     f"with id {m.tool_call_id!r}", param=f"messages.{i}.tool_call_id")
                if m.tool_call_id in unanswered:
                    unanswered.remove(m.tool_call_id)
                continue
            if unanswered:
                _raise_unanswered(at, unanswered)
            if m.tool_calls:
                at, unanswered = i, [c.id for c in m.tool_calls]
                called.update(unanswered)
        if unanswered:
            _raise_unanswered(at, unanswered)

    def num_logprobs(self) -> int | None:
        """The alternatives per token the response lists; None: no logprobs."""
        if not self.logprobs:
            return None
        return self.top_logprobs or 0

    def with_logprobs(self) -> ChatCompletionRequest:
        """This request, its tokens' logprobs asked for (a cascade reads the small answer's)."""
        return self if self.logprobs else self.model_copy(update={"logprobs": True})


def _raise_unanswered(index: int, ids: list[str]) -> None:
    raise BadRequest(f"messages.{index}.tool_calls: an assistant message's tool calls must each be answered by a "
                     f"tool message after it; none answers {', '.join(map(repr, ids))}",
                     param=f"messages.{index}.tool_calls")


class CompletionRequest(SamplingFields):
    best_of: Annotated[int, bounded("n")] | None = None

    prompt: str | Annotated[list[int], Field(min_length=1)] | Annotated[list[str], Field(min_length=1, max_length=64)] \
        | Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1, max_length=64)]
    # 0 only with echo: the prompt's logprobs, nothing generated (lm-evaluation-harness' scoring)
    max_tokens: Annotated[int, bounded("max_tokens", low=0)] | None = None
    logprobs: Annotated[int, bounded("logprobs")] | None = None
    echo: bool = False  # the prompt before the completion, in the text and (with logprobs) the logprobs

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v: int | None, info) -> int | None:
        if v is not None and v != info.data.get("n", 1):
            raise ValueError("only best_of equal to n is supported (every sample is returned)")
        return v

    def num_logprobs(self) -> int | None:
        """The alternatives per token the response lists; None: no logprobs."""
        return self.logprobs

    def with_logprobs(self) -> CompletionRequest:
        """This request, its tokens' logprobs asked for (a cascade reads the small answer's)."""
        return self if self.logprobs is not None else self.model_copy(update={"logprobs": 0})

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)
