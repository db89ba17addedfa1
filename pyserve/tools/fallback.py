"""Calls a model wrote as a bare JSON object instead of in its format: Qwen2.5-Coder
answers a tool prompt with ```json {"name": "get_weather", "arguments": {...}}``` rather than
`<tool_call>` tags. Under tool_choice "auto" only, such an answer is read as calls when the WHOLE
answer (surrounding whitespace aside) is one JSON value, bare or in one ```json / ``` fence, that is
either one call or (parallel calls allowed) a non-empty list of calls, a call being exactly
{"name": <a declared function>, "arguments" | "parameters": <object valid for its schema>}.
Anything else (text around it, another fence language, an undeclared name, arguments the schema
rejects) stays content. A call's arguments are handed out as JSON re-serialized from the object.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema

from pyserve.tools.parser import ParsedCall, json_value_end

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n?(.*?)```", re.S)
_FENCE_OPEN = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)")
_ARGS_KEYS = ("arguments", "parameters")
_JSON_LANGS = ("", "json")


class JsonCallFallback:
    """One per request: the declared functions' schemas, checked once. Stateless after that, so
    every choice of the request shares it."""

    def __init__(self, functions: list[dict[str, Any]], parallel: bool):
        """`functions`: {"name", "parameters"} each, their schemas as calls must meet them (strict
        ones closed); `parallel`: a list of calls may be read. A function whose schema jsonschema
        rejects is never read this way."""
        self.parallel = parallel
        self._validators: dict[str, Any] = {}
        for f in functions:
            schema = f.get("parameters") or {"type": "object"}
            cls = jsonschema.validators.validator_for(schema)
            try:
                cls.check_schema(schema)
            except jsonschema.SchemaError:
                continue
            self._validators[f["name"]] = cls(schema)

    def calls(self, text: str) -> list[ParsedCall]:
        """The calls `text`, a complete answer, is; [] when it is content."""
        body = text.strip()
        fence = _FENCE.fullmatch(body)
        if fence is not None:
            if fence.group(1).lower() not in _JSON_LANGS:
                return []
            body = fence.group(2).strip()
        if not body.startswith(("{", "[")):
            return []
        try:
            value = json.loads(body)
        except ValueError:
            return []
        items = value if isinstance(value, list) and self.parallel else [value]
        calls = [self._call(item) for item in items]
        if not calls or None in calls:
            return []
        return calls

    def could_become_call(self, text: str) -> bool:
        """Whether the answer so far may still turn out to be calls: what streaming holds back.
        Text that opens with neither `{`, `[` nor a ```/```json fence is free at once, and so is
        text that goes on after its first JSON value (or after that value's fence)."""
        s = text.lstrip()
        if "```".startswith(s):
            return True  # nothing yet, or a fence's first backticks
        if s.startswith("```"):
            m = _FENCE_OPEN.match(s)
            if m.end() < len(s) and m.group(1).lower() not in _JSON_LANGS:
                return False  # a fence of another language (its tag is complete: something follows it)
            value_at, after = m.end(), "```"
        elif s[0] in "{[" and (s[0] == "{" or self.parallel):
            value_at, after = 0, ""
        else:
            return False
        start = len(s) - len(s[value_at:].lstrip())
        if start == len(s):
            return True  # the value has not begun
        if s[start] not in "{[":
            return False
        end = json_value_end(s, start)
        if end is None:
            return True  # the value is still being written
        rest = s[end:].strip()
        return after.startswith(rest)  # nothing, or (part of) the closing fence

    def _call(self, item: Any) -> ParsedCall | None:
        if not isinstance(item, dict) or len(item) != 2 or not isinstance(item.get("name"), str):
            return None
        keys = [k for k in _ARGS_KEYS if k in item]
        if len(keys) != 1:
            return None
        args, validator = item[keys[0]], self._validators.get(item["name"])
        if validator is None or not isinstance(args, dict) or not validator.is_valid(args):
            return None
        return ParsedCall(item["name"], json.dumps(args, ensure_ascii=False))
