"""A chat request's tools: what goes to the chat template, the grammar that forces calls
(tool_choice "required" or named), and the OpenAI shapes of the calls read out of the output
(`message.tool_calls`, streamed `delta.tool_calls`; `function_call` for the legacy `functions`).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pyserve.http.errors import BadRequest
from pyserve.server.schemas import ChatCompletionRequest, FunctionDef, NamedFunction, NamedToolChoice
from pyserve.structured.params import GrammarError, StructuredOutputsParams
from pyserve.structured.strict_schema import closed_objects
from pyserve.tools.fallback import JsonCallFallback
from pyserve.tools.formats import FORMATS, ToolFormat
from pyserve.tools.parser import CallDelta, ParseDelta, ParsedCall, ToolCallParser


@dataclass(slots=True)
class ToolPlan:
    template_tools: list[dict[str, Any]] | None  # for the chat template (HF's `tools=`)
    constraint: StructuredOutputsParams | None  # forces calls ("required", named), or holds "auto" to strict ones
    format: ToolFormat | None  # set when calls are read out of the output
    legacy: bool = False  # answer in the shape of `functions` / `function_call`
    named: bool = False  # one function forced by name: its call ends with finish_reason "stop", as OpenAI's
    forced: bool = False  # "required" or named: the whole output is calls, never content
    fallback: JsonCallFallback | None = None  # "auto": an answer that is only a call's JSON object is a call

    @property
    def field(self) -> str:
        """The request field the functions came in."""
        return "functions" if self.legacy else "tools"

    def parser(self) -> ToolCallParser | None:
        return None if self.format is None else self.format.parser()


# A forced call's format where the chat template shows none: its grammar writes the call, so any
# format reads back what it wrote (vLLM forces calls without a parser too).
FORCED_FORMAT = FORMATS["hermes"]


def plan_tools(req: ChatCompletionRequest, fmt: ToolFormat | None,
               single_tokens: Callable[[tuple[str, ...]], dict[str, int]]) -> ToolPlan:
    """The request's tools, checked; a BadRequest names the field at fault. `single_tokens`: of
    the texts given, those the model's vocabulary holds as one token, with its id (the format's
    markers a grammar names so: ToolFormat.grammar)."""
    legacy = req.functions is not None or req.function_call is not None
    if legacy and (req.tools is not None or req.tool_choice is not None):
        raise BadRequest("functions: give tools or the legacy functions, not both", param="functions")
    functions = [t.function for t in req.tools or []] if not legacy else list(req.functions or [])
    choice = req.tool_choice if not legacy else req.function_call
    field_name, choice_name = ("functions", "function_call") if legacy else ("tools", "tool_choice")
    if not functions:
        if choice not in (None, "none"):
            raise BadRequest(f"{choice_name}: needs {field_name}", param=choice_name)
        return ToolPlan(None, None, None)
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise BadRequest(f"{field_name}: function names must be unique", param=field_name)
    for_grammar = {}  # each function as the format's grammar takes it, checked once here
    for f in functions:
        kind = (f.parameters or {}).get("type", "object")
        if kind != "object":
            raise BadRequest(f"{field_name}: {f.name}: parameters: a function takes an object schema "
                             f"(type: object), not type {kind!r}", param=field_name)
        try:
            StructuredOutputsParams(json=f.parameters or {"type": "object"})  # OpenAI's schema limits
            for_grammar[f.name] = _for_grammar(f)
        except GrammarError as e:
            raise BadRequest(f"{field_name}: {f.name}: parameters: {e}", param=field_name) from e
    tools = template_tools(functions)
    choice = choice or "auto"
    if choice == "none":
        return ToolPlan(tools, None, None, legacy)
    if fmt is None:
        if choice == "auto":  # the model's own calls are read in the format its template teaches
            raise BadRequest(f"{field_name}: under {choice_name} auto a model's calls are read in the format its "
                             "chat template teaches, and this one shows none (start the server with "
                             "--tool-call-parser, or force a call)", param=field_name)
        fmt = FORCED_FORMAT
    if choice == "auto":
        parallel = req.parallel_tool_calls and not legacy
        fallback = JsonCallFallback(list(for_grammar.values()), parallel)
        if not any(f.strict for f in functions):
            return ToolPlan(tools, None, fmt, legacy, fallback=fallback)
        # A strict function's calls must match its schema, as OpenAI's: text or calls, held by a grammar.
        grammar = fmt.grammar(list(for_grammar.values()), parallel, free_text=True,
                             marker_ids=single_tokens(fmt.markers))
        return ToolPlan(tools, StructuredOutputsParams(grammar=grammar), fmt, legacy, fallback=fallback)
    for stop_field in ("stop", "stop_token_ids"):  # either would cut a call the grammar holds to its schema
        if getattr(req, stop_field):
            raise BadRequest(f"{stop_field}: not with a forced call ({choice_name} required or a named function)",
                             param=stop_field)
    if isinstance(choice, (NamedToolChoice, NamedFunction)):
        name = choice.function.name if isinstance(choice, NamedToolChoice) else choice.name
        if name not in names:
            raise BadRequest(f"{choice_name}: no function named {name!r} in {field_name}", param=choice_name)
        forced = [f for f in functions if f.name == name]
        parallel = False
    else:  # required
        forced, parallel = functions, req.parallel_tool_calls and not legacy
    grammar = fmt.grammar([for_grammar[f.name] for f in forced], parallel, marker_ids=single_tokens(fmt.markers))
    return ToolPlan(tools, StructuredOutputsParams(grammar=grammar), fmt, legacy,
                    named=isinstance(choice, (NamedToolChoice, NamedFunction)), forced=True)


def template_tools(functions: list[FunctionDef]) -> list[dict[str, Any]]:
    """Functions as a chat template takes them (HF's `tools=`)."""
    return [{"type": "function", "function": f.model_dump(exclude_none=True)} for f in functions]


def _for_grammar(function: FunctionDef) -> dict[str, Any]:
    """A function as the format's grammar takes it; `strict` closes its objects to the properties
    they name (OpenAI's strict mode). Under "auto", calls are read as written unless a function
    is strict: then every call is held to its function's schema."""
    f = function.model_dump(exclude_none=True)
    if function.strict:
        f["parameters"] = closed_objects(function.parameters or {"type": "object"})
    return f


@dataclass(slots=True)
class ChoiceCalls:
    """One choice's calls as they are read: ids given once per call. With a `fallback`, the
    calls the format's parser finds come first; only an answer in which it finds none may be a
    bare call object (tools.fallback), so while streaming, content that could still become one
    is held until it cannot or the answer ends."""

    parser: ToolCallParser
    legacy: bool
    named: bool = False  # see ToolPlan.named
    forced: bool = False  # see ToolPlan.forced: a call cut before its name leaves no content behind
    fallback: JsonCallFallback | None = None  # see ToolPlan.fallback
    text: str = ""
    ids: list[str] = field(default_factory=list)
    has_calls: bool = False
    held: str = ""  # content held back while the answer may still be a bare call object
    may_fall_back: bool = True  # False once the answer so far can no longer be one (it only grows)

    def _id(self, index: int) -> str:
        while len(self.ids) <= index:
            self.ids.append(f"call_{uuid.uuid4().hex[:24]}")
        return self.ids[index]

    def message(self, text: str) -> dict[str, Any]:
        """The final message of a complete output."""
        content, calls = self.parser.parse(text)
        if not calls and self.fallback is not None and (calls := self.fallback.calls(text)):
            content = ""
        if self.forced:
            content = ""
        msg: dict[str, Any] = {"role": "assistant",
                               "content": content if content.strip() or not (calls or self.forced) else None}
        if calls and self.legacy:
            msg["function_call"] = {"name": calls[0].name, "arguments": calls[0].arguments}
        elif calls:
            msg["tool_calls"] = [self._call(i, c) for i, c in enumerate(calls)]
        return msg

    def delta(self, text_delta: str, final: bool) -> tuple[dict[str, Any], bool]:
        """The chunk delta for newly decoded text, and whether the choice has calls so far."""
        self.text += text_delta
        pd: ParseDelta = self.parser.feed(self.text, final)
        if self.fallback is not None and self.may_fall_back:
            pd = self._hold_for_fallback(pd, final)
        out: dict[str, Any] = {}
        if pd.content and not self.forced:
            out["content"] = pd.content
        if pd.calls and self.legacy:
            first = [c for c in pd.calls if c.index == 0]
            if first:
                out["function_call"] = {**({"name": first[0].name} if first[0].name else {}),
                                        "arguments": first[0].arguments}
        elif pd.calls:
            out["tool_calls"] = [
                {"index": c.index, "id": self._id(c.index), "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments}} if c.name is not None else
                {"index": c.index, "function": {"arguments": c.arguments}}
                for c in pd.calls]
        self.has_calls = self.has_calls or bool(pd.calls)
        return out, self.has_calls

    def _hold_for_fallback(self, pd: ParseDelta, final: bool) -> ParseDelta:
        """`pd` with its content held while the answer may still be a bare call object; at the
        end, that answer's calls in place of the held content."""
        if not pd.calls and not final and self.fallback.could_become_call(self.text):
            self.held += pd.content
            return ParseDelta()
        self.may_fall_back = False
        calls = self.fallback.calls(self.text) if final and not pd.calls else []
        if calls:
            self.held = ""
            return ParseDelta(calls=[CallDelta(i, c.name, c.arguments) for i, c in enumerate(calls)])
        # The format's own calls (what was held is their text before them), or content after all.
        pd.content, self.held = self.held + pd.content, ""
        return pd

    def _call(self, index: int, call: ParsedCall) -> dict[str, Any]:
        return {"id": self._id(index), "type": "function",
                "function": {"name": call.name, "arguments": call.arguments}}

    def finish_reason(self, engine_reason: str | None, has_calls: bool) -> str | None:
        if engine_reason == "stop" and has_calls and not self.named:
            return "function_call" if self.legacy else "tool_calls"
        return engine_reason
