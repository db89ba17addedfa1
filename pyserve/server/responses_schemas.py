"""The body of POST /v1/responses (OpenAI's Responses API), validated with pydantic as the chat
body is (server.schemas' rules: a field is served, has no effect, or is refused naming it).

Served: `input` (a string, or items: messages with text parts, `function_call` and
`function_call_output`), `instructions`, function `tools`, `tool_choice`, `parallel_tool_calls`,
`text.format` (text, json_object, json_schema), `max_output_tokens`, `temperature`, `top_p`,
`metadata` and `user` (kept with the response), `store`, `previous_response_id`, `stream`,
`truncation` (auto: the prompt budget's `turns` policy at the model's length less the output).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pyserve.server.schemas import MAX_TOOLS, bounded

# Fields that only label or route a request: accepted, with no effect on its output.
NO_EFFECT_FIELDS = frozenset({"service_tier", "prompt_cache_key", "safety_identifier"})
# Fields that would change the output and are not served, each with the values that mean "off".
REFUSED_FIELDS: dict[str, tuple[Any, ...]] = {
    "include": (None, []), "reasoning": (None,), "background": (None, False), "max_tool_calls": (None,),
    "conversation": (None,), "prompt": (None,), "top_logprobs": (None, 0),
    "stream_options": (None,), "context_management": (None,), "prompt_cache_retention": (None,),
    "prompt_cache_options": (None,),
}
ITEM_TYPES = ("message", "function_call", "function_call_output")


class ContentText(BaseModel):
    """A message's text: `input_text`, or `output_text` as an earlier response gave it."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["input_text", "output_text"]
    text: str
    annotations: Annotated[list[Any], Field(max_length=0)] | None = None
    logprobs: list[Any] | None = None


class MessageItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentText]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1)]
    name: str
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1)]
    output: str | list[ContentText]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")] | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the only level that asks nothing of the model


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: Annotated[int, bounded("max_tokens")] | None = None
    temperature: Annotated[float, bounded("temperature")] | None = None
    top_p: Annotated[float, bounded("top_p")] | None = None
    metadata: Annotated[dict[str, Annotated[str, Field(max_length=512)]], Field(max_length=16)] | None = None
    user: str | None = None
    store: bool = True
    previous_response_id: str | None = None
    # auto: the conversation's oldest turns dropped to fit the model's length (the prompt budget's turns)
    truncation: Literal["disabled", "auto"] = "disabled"
    stream: bool = False

    @field_validator("input", mode="before")
    @classmethod
    def _item_types(cls, v: Any) -> Any:
        for i, item in enumerate(v if isinstance(v, list) else []):
            kind = item.get("type", "message") if isinstance(item, dict) else None
            if kind not in ITEM_TYPES:
                raise ValueError(f"item {i} is of type {kind!r}; this server takes {', '.join(ITEM_TYPES)} items")
        return v

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, v: Any) -> Any:
        for i, tool in enumerate(v if isinstance(v, list) else []):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise ValueError(f"tool {i} is of type {kind!r}; this server serves function tools only")
        return v

    def items(self) -> list[InputItem]:
        return [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else list(self.input)
