"""How a model family writes tool calls: the parser that reads them, and the grammar that forces
them (tool_choice "required" or a named function). A call's JSON is compiled from the tool's
parameter schema (llguidance's `%json` inside a Lark grammar), so forced arguments always
validate against it.

- hermes (Hermes, Qwen 2.5+, the embedded model): `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`,
  one block per call, after optional text.
- llama3_json (Llama 3.1+): the whole output is `{"name": ..., "parameters": {...}}`, calls joined
  by "; ", optionally after `<|python_tag|>`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from pyserve.structured.compiler import JSON_OPTIONS
from pyserve.tools.parser import ToolCallParser

# Calls one forced answer may hold. A grammar that allowed any number would let a model that
# keeps choosing "one more call" write until max_tokens, cutting the last call short.
MAX_PARALLEL_CALLS = 8


@dataclass(frozen=True, slots=True)
class ToolFormat:
    name: str
    args_key: str  # the key the format writes the arguments under
    open: str | None  # a call's opening (None: calls are the whole output)
    close: str | None
    separator: str  # between forced calls
    prefix: str = ""

    def parser(self) -> ToolCallParser:
        return ToolCallParser(self.open, self.close, ("arguments", "parameters"), self.separator, self.prefix)

    @property
    def markers(self) -> tuple[str, ...]:
        """The texts that open and close a call (a vocabulary may hold each as one token)."""
        return tuple(m for m in (self.open, self.close) if m is not None)

    def grammar(self, functions: list[dict[str, Any]], parallel: bool, free_text: bool = False,
                marker_ids: dict[str, int] | None = None) -> str:
        """A Lark grammar of one call (or, `parallel`, one to MAX_PARALLEL_CALLS) of `functions` (each
        {"name", "parameters"}), written as this format writes calls. `free_text`: the model may
        answer in text instead (tool_choice "auto" held to strict schemas): text that never
        writes a call's opening, then, where the format allows text before calls, calls.
        `marker_ids`: the markers the vocabulary holds as one token, with its id (Qwen's
        `<tool_call>`): the grammar names that token, the one the model was trained to write (a
        quoted literal of an added token llguidance reads as special would allow only the text
        spelled out in other tokens)."""
        rules = []
        for i, f in enumerate(functions):
            # The parameters sit under the call's args key: their local references ($defs, as
            # pydantic writes them) must point there.
            parameters = rebased(f.get("parameters") or {"type": "object"}, f"/properties/{self.args_key}")
            schema = {"type": "object", "properties": {"name": {"const": f["name"]}, self.args_key: parameters},
                      "required": ["name", self.args_key], "additionalProperties": False, "x-guidance": JSON_OPTIONS}
            rules.append(f"fn{i}: %json {json.dumps(schema)}")
        one = " | ".join(f"fn{i}" for i in range(len(functions)))
        if self.open is None:  # the calls are the whole output
            calls = f"call ({json.dumps(self.separator)} call){{0,{MAX_PARALLEL_CALLS - 1}}}" if parallel else "call"
            lines = [f"start: TEXT | {calls}" if free_text else f"start: {calls}", f"call: {one}"]
            if free_text:  # text is what does not open as a call does
                lines.append("TEXT: /(?s:.*)/ & ~/(?s:[ \\t\\n]*\\{.*)/")
            return "\n".join([*lines, *rules])
        ids = marker_ids or {}  # a marker held as one token is named by its id: <[id]>
        opening = f'<[{ids[self.open]}]> "\\n"' if self.open in ids else json.dumps(self.open + "\n")
        closing = f'"\\n" <[{ids[self.close]}]>' if self.close in ids else json.dumps("\n" + self.close)
        more = f'("\\n" {opening} call_rest){{0,{MAX_PARALLEL_CALLS - 1}}}' if parallel else ""
        # The calls may end with a newline: Qwen2.5 writes one after its last `</tool_call>`, then
        # its end of text (were a newline only the start of another call, it would write calls on).
        calls = f'{opening} call_rest {more} "\\n"?'
        lines = [f"call_rest: ({one}) {closing}"]
        plain = re.escape(self.open).replace("/", "\\/")
        no_opening = f"PLAIN: /(?s:.*)/ & ~/(?s:.*{plain}.*)/"  # text never spells a call's opening out
        if free_text and self.open in ids:
            # The opening token ends the text, which never spells the opening out.
            lines += [f"start: TEXT | TEXT? {calls}", no_opening, "TEXT: PLAIN"]
        elif free_text:
            # Text, and text with a call's opening after it, are one lexeme each, both started at
            # the text's first byte: the lexer follows the two, so text may hold any prefix of the
            # opening, and the opening is where the text ends.
            lines += [f'start: TEXT | TEXT_OPEN call_rest {more} "\\n"?', no_opening, "TEXT: PLAIN",
                      f"TEXT_OPEN: PLAIN {opening}"]
        else:
            lines.append(f"start: {calls}")
        return "\n".join([*lines, *rules])


def rebased(schema: Any, pointer: str) -> Any:
    """A copy of `schema` whose local references ("#", "#/...") point into it once it is placed
    at JSON pointer `pointer` of a larger document."""
    if isinstance(schema, list):
        return [rebased(s, pointer) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: rebased(v, pointer) for k, v in schema.items()}
    ref = out.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        out["$ref"] = "#" + pointer + ref[1:]
    return out


FORMATS = {
    "hermes": ToolFormat("hermes", "arguments", "<tool_call>", "</tool_call>", "\n"),
    "llama3_json": ToolFormat("llama3_json", "parameters", None, None, "; ", prefix="<|python_tag|>"),
}


def detect(chat_template: str | None) -> ToolFormat | None:
    """The format a chat template teaches its model, or None when it shows none."""
    if not chat_template:
        return None
    if "<tool_call>" in chat_template:
        return FORMATS["hermes"]
    if "<|python_tag|>" in chat_template or "ipython" in chat_template:
        return FORMATS["llama3_json"]
    return None
