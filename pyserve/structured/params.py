"""What a request constrains its output to (vLLM's `structured_outputs`): a JSON schema, any JSON
object, a regular expression, one of a list of strings, or a Lark / EBNF grammar. Exactly one.

Schemas are checked against OpenAI's structured-output limits here, before any compile work, so
that a huge or deep schema is refused in microseconds rather than compiled.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

MAX_PROPERTIES = 5000  # object properties in one schema, all levels together
MAX_NESTING = 10  # nested objects / arrays / combinators below the root
MAX_ENUM_VALUES = 1000  # enum and const values in one schema, all levels together
MAX_SCHEMA_BYTES = 1 << 20
MAX_PATTERN_CHARS = 16 * 1024  # a regex's own text
MAX_GRAMMAR_CHARS = MAX_SCHEMA_BYTES  # a grammar's (tool-call grammars embed the tools' schemas)
MAX_CHOICES = 1000
_NESTING_KEYS = ("properties", "items", "prefixItems", "additionalProperties", "anyOf", "oneOf", "allOf",
                 "not", "$defs", "definitions", "patternProperties", "if", "then", "else", "contains")


class GrammarError(ValueError):
    """The constraint is invalid, unsupported or over a limit; the message says which and why,
    `field` (when known) which request field gave it."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


@dataclass(slots=True, frozen=True)
class StructuredOutputsParams:
    """One of: `json` (a JSON schema, as a dict or its text), `json_object` (any JSON object),
    `regex`, `choice` (the output is exactly one of these strings) or `grammar` (Lark, or
    llama.cpp's GBNF / EBNF)."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object is True else []
        if len(given) != 1:
            raise GrammarError("give exactly one of json, json_object, regex, choice, grammar"
                               + (f" (got {', '.join(given)})" if given else ""))
        if self.json is not None:
            _check_schema(self.json)
        for name, limit in (("regex", MAX_PATTERN_CHARS), ("grammar", MAX_GRAMMAR_CHARS)):
            text = getattr(self, name)
            if text is not None and (not isinstance(text, str) or not text or len(text) > limit):
                raise GrammarError(f"{name} must be a string of 1 to {limit} characters")
        if self.choice is not None:
            if not 0 < len(self.choice) <= MAX_CHOICES or not all(isinstance(c, str) and c for c in self.choice):
                raise GrammarError(f"choice must be a list of 1 to {MAX_CHOICES} non-empty strings")

    def key(self) -> tuple[str, str]:
        """A hashable identity of the constraint (the compile cache's key)."""
        if self.json is not None:
            text = self.json if isinstance(self.json, str) else json.dumps(self.json, sort_keys=True)
            return ("json", text)
        if self.json_object:
            return ("json_object", "")
        if self.regex is not None:
            return ("regex", self.regex)
        if self.choice is not None:
            return ("choice", json.dumps(list(self.choice)))
        return ("grammar", self.grammar)


def _check_schema(schema: dict[str, Any] | str) -> None:
    if isinstance(schema, str):
        if len(schema) > MAX_SCHEMA_BYTES:
            raise GrammarError(f"json: the schema exceeds {MAX_SCHEMA_BYTES} bytes")
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise GrammarError(f"json: the schema is not valid JSON: {e}") from e
    if not isinstance(schema, (dict, bool)):
        raise GrammarError("json: a schema must be a JSON object")
    counts = {"properties": 0, "enum": 0}
    _walk(schema, 0, counts)


def _walk(node: Any, depth: int, counts: dict[str, int]) -> None:
    """Counts properties and enum values, measures nesting and refuses `multipleOf`; the
    recursion is bounded by MAX_NESTING (a list nested in a list counts as a level too)."""
    if depth > MAX_NESTING:
        raise GrammarError(f"json: the schema nests deeper than {MAX_NESTING} levels")
    if isinstance(node, list):
        for item in node:
            _walk(item, depth + isinstance(item, list), counts)
        return
    if not isinstance(node, dict):
        return
    if "multipleOf" in node:  # the digit limit and the close within max_tokens cannot both hold beside it
        raise GrammarError("json: multipleOf is not supported: a number it constrains may have no ending within "
                           "a machine number's digits or max_tokens")
    props = node.get("properties")
    if isinstance(props, dict):
        counts["properties"] += len(props)
        if counts["properties"] > MAX_PROPERTIES:
            raise GrammarError(f"json: the schema has more than {MAX_PROPERTIES} properties")
    enum = node.get("enum")
    if isinstance(enum, list):
        counts["enum"] += len(enum)
        if counts["enum"] > MAX_ENUM_VALUES:
            raise GrammarError(f"json: the schema has more than {MAX_ENUM_VALUES} enum values")
    for key in _NESTING_KEYS:
        child = node.get(key)
        if child is None:
            continue
        if key in ("properties", "$defs", "definitions", "patternProperties") and isinstance(child, dict):
            for sub in child.values():
                _walk(sub, depth + 1, counts)
        else:
            _walk(child, depth + 1, counts)
