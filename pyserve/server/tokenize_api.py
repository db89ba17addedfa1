"""/tokenize and /detokenize, as vLLM serves them (lm-evaluation-harness and clients that count
tokens use them): a completion prompt or chat messages to token ids, and token ids to text.

/tokenize takes `prompt` (with `add_special_tokens`, default true) or `messages` (rendered by the
model's chat template, with `tools` when given; `add_generation_prompt` default true;
`continue_final_message` and `chat_template_kwargs` as chat completions take them); it
answers {count, max_model_len, tokens, token_strs} (`token_strs` with `return_token_strs: true`,
else null). /detokenize takes `tokens` (and `skip_special_tokens`, default false: special tokens
are text too, as vLLM gives them) and answers {prompt}, so that /tokenize of messages then
/detokenize gives the rendered chat. `model`, when given, names a served model or adapter
(default: the primary model).

GET /tokenizer_info (`?model=` as above) answers the tokenizer's configuration as vLLM does: its
special tokens, chat template and length limit (lm-evaluation-harness' `tokenizer_backend=remote`
reads it, then tokenizes through /tokenize).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator
from starlette.requests import Request
from starlette.responses import Response

from pyserve.model.tokenizer import ChatTemplateError
from pyserve.http.responses import json_body, json_response
from pyserve.server.body import check_token_ids, validate
from pyserve.server.deadline import DeadlineExceeded, run_with_deadline
from pyserve.http.errors import BadRequest
from pyserve.server.schemas import MAX_TOOLS, ChatMessage, ToolDef, check_template_options
from pyserve.server.tool_calls import template_tools
from pyserve.server.state import ServerState

MAX_TOKENIZE_CHARS = 4_000_000
MAX_DETOKENIZE_TOKENS = 1_000_000


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: Annotated[str, Field(max_length=MAX_TOKENIZE_CHARS)] | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    tools: Annotated[list[ToolDef], Field(max_length=MAX_TOOLS)] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self

    def check(self) -> None:
        """The chat fields: only with messages, and as chat completions take them (a 400 naming
        the field)."""
        for name in ("tools", "continue_final_message", "chat_template_kwargs"):
            if self.messages is None and name in self.model_fields_set:
                raise BadRequest(f"{name}: allowed only with messages", param=name)
        if self.messages is not None:
            check_template_options([m.for_template() for m in self.messages], self.add_generation_prompt,
                                   self.continue_final_message, self.chat_template_kwargs)


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: Annotated[list[StrictInt], Field(max_length=MAX_DETOKENIZE_TOKENS)]
    skip_special_tokens: bool = False  # as vLLM: the text of every token, special ones included


async def tokenize(request: Request) -> Response:
    state: ServerState = request.app.state.pyserve
    req = validate(TokenizeRequest, await json_body(request))
    req.check()
    engine = state.models.resolve(req.model)[0].engine
    tok = engine.tokenizer
    if req.prompt is not None:
        tokens = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
    else:
        timeout = state.settings.chat_template_timeout
        try:
            tools = template_tools([t.function for t in req.tools]) if req.tools else None
            text = await run_with_deadline(tok.apply_chat_template, [m.for_template() for m in req.messages],
                                           req.add_generation_prompt, None, tools, req.continue_final_message,
                                           req.chat_template_kwargs, timeout=timeout)
        except ChatTemplateError as e:
            raise BadRequest(str(e), param="messages") from e
        except DeadlineExceeded as e:
            raise BadRequest(f"the chat template did not render within {timeout} s", param="messages") from e
        tokens = tok.encode(text, add_special_tokens=bool(req.add_special_tokens))
    token_strs = [tok.decode([t], skip_special_tokens=False) for t in tokens] if req.return_token_strs else None
    return json_response({"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens,
                  "token_strs": token_strs})


async def detokenize(request: Request) -> Response:
    state: ServerState = request.app.state.pyserve
    req = validate(DetokenizeRequest, await json_body(request))
    engine = state.models.resolve(req.model)[0].engine
    check_token_ids(req.tokens, engine.vocab_size, "tokens")
    return json_response({"prompt": engine.tokenizer.decode(req.tokens, skip_special_tokens=req.skip_special_tokens)})


async def tokenizer_info(request: Request) -> Response:
    state: ServerState = request.app.state.pyserve
    unknown = set(request.query_params) - {"model"}
    if unknown:
        raise BadRequest(f"unknown query parameter {sorted(unknown)[0]!r}", param=sorted(unknown)[0])
    engine = state.models.resolve(request.query_params.get("model"))[0].engine
    tok = engine.tokenizer
    return json_response({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tok.bos_token,
                          "eos_token": tok.eos_token, "pad_token": None, "unk_token": None,
                          "chat_template": tok.chat_template, "model_max_length": engine.max_model_len,
                          "vocab_size": engine.vocab_size})
