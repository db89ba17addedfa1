"""OpenAI's `strict: true` for a JSON schema: an object never holds properties its schema does
not name. OpenAI refuses a strict schema whose objects leave `additionalProperties` out; this
server closes them instead, so a schema written for either API gets what strict mode promises.
An object that asks for other properties (`additionalProperties` true or a schema) contradicts
strict mode: refused, as OpenAI refuses it."""

from __future__ import annotations

from typing import Any

from pyserve.structured.params import GrammarError

# The keywords whose value is a schema, a list of schemas, or a mapping of names to schemas.
_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames",
        "unevaluatedItems", "unevaluatedProperties")
_MANY = ("anyOf", "oneOf", "allOf", "prefixItems")
_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed_objects(schema: Any) -> Any:
    """A copy of `schema` in which every object schema without `additionalProperties` has it
    false; a GrammarError where one has it otherwise."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    kind = out.get("type")
    is_object = kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in out
    if is_object and "additionalProperties" not in out:
        out["additionalProperties"] = False
    elif out.get("additionalProperties", False) is not False:
        raise GrammarError("strict: an object's additionalProperties must be false (or left out)")
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = closed_objects(out[key])
    for key in _MANY:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(s) for s in out[key]]
    for key in _NAMED:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(s) for name, s in out[key].items()}
    return out
