"""JSON schemas for structured-output tests and the bench: objects, arrays, enums, anyOf, $ref,
patterns and numeric bounds, each small enough that a tiny model completes it in ~100 tokens.
Strings and arrays carry length bounds, and numbers are integers: an unbounded string, or the
unbounded digits of a JSON number's fraction, let a small model write until max_tokens, which
truncates the JSON (a grammar bounds what may come, not when a model stops)."""

from __future__ import annotations

from typing import Any

_NAME = {"type": "string", "minLength": 1, "maxLength": 12}
_SHORT = {"type": "string", "maxLength": 8}


def _obj(props: dict[str, Any], required: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False, **extra}


_BASE: list[dict[str, Any]] = [
    _obj({"name": _NAME}),
    _obj({"name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    _obj({"ok": {"type": "boolean"}}),
    _obj({"value": {"type": "integer", "minimum": -10, "maximum": 10}}),
    _obj({"count": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 50}}),
    _obj({"score": {"type": "integer", "minimum": 1, "maximum": 5}, "comment": _SHORT}),
    _obj({"color": {"enum": ["red", "green", "blue"]}}),
    _obj({"level": {"enum": [1, 2, 3, "max"]}}),
    _obj({"status": {"const": "done"}, "code": {"type": "integer", "minimum": 200, "maximum": 599}}),
    _obj({"tags": {"type": "array", "items": _SHORT, "maxItems": 3}}),
    _obj({"ids": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
                  "minItems": 1, "maxItems": 4}}),
    _obj({"point": _obj({"x": {"type": "integer", "minimum": -9, "maximum": 9},
                         "y": {"type": "integer", "minimum": -9, "maximum": 9}})}),
    _obj({"user": _obj({"name": _NAME, "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}})}),
    _obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
    _obj({"date": {"type": "string", "pattern": "^20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])$"}}),
    _obj({"hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}}),
    _obj({"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, _SHORT]}}),
    _obj({"shape": {"anyOf": [_obj({"kind": {"const": "circle"}, "r": {"type": "integer", "minimum": 1, "maximum": 9}}),
                              _obj({"kind": {"const": "square"}, "side": {"type": "integer", "minimum": 1,
                                                                          "maximum": 9}})]}}),
    _obj({"maybe": {"anyOf": [{"type": "null"}, {"type": "boolean"}]}}),
    _obj({"name": _NAME, "nick": _SHORT}, required=["name"]),
    _obj({"a": {"type": "integer", "minimum": 0, "maximum": 9}, "b": {"type": "integer", "minimum": 0, "maximum": 9},
          "c": {"type": "integer", "minimum": 0, "maximum": 9}}),
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 3},
    {"type": "array", "items": _obj({"k": _SHORT}), "maxItems": 2},
    {"type": "array", "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["x", "y"]}],
     "items": False},
    {"type": "integer", "minimum": 10, "maximum": 99},
    {"type": "boolean"},
    {"enum": ["alpha", "beta", "gamma", "delta"]},
    {"type": "string", "pattern": "^[A-Z][a-z]{2,6}$"},
    {"$defs": {"item": _obj({"sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
                             "qty": {"type": "integer", "minimum": 1, "maximum": 9}})},
     **_obj({"items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 2}})},
    {"$defs": {"pos": {"type": "integer", "minimum": 0, "maximum": 9}},
     **_obj({"from": {"$ref": "#/$defs/pos"}, "to": {"$ref": "#/$defs/pos"}})},
    {"definitions": {"name": _NAME}, **_obj({"first": {"$ref": "#/definitions/name"},
                                             "last": {"$ref": "#/definitions/name"}})},
    _obj({"matrix": {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                            "maximum": 9},
                                                "minItems": 2, "maxItems": 2}, "minItems": 2, "maxItems": 2}}),
    _obj({"price": {"type": "integer", "minimum": 0, "maximum": 1000}, "currency": {"enum": ["EUR", "USD"]}}),
    _obj({"answer": {"enum": ["yes", "no"]}, "confidence": {"enum": [0.25, 0.5, 0.75, 1.0]}}),
    _obj({"title": _NAME, "done": {"type": "boolean"}, "priority": {"enum": ["low", "high"]}}),
    _obj({"version": {"type": "string", "pattern": "^[0-9]\\.[0-9]{1,2}\\.[0-9]{1,2}$"}}),
    _obj({"meta": _obj({"created": {"type": "integer", "minimum": 0, "maximum": 9999},
                        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}})}),
    _obj({"empty": _obj({})}),
    _obj({"note": {"type": ["string", "null"], "maxLength": 6}}),
    _obj({"op": {"enum": ["add", "sub"]}, "args": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                              "maximum": 99},
                                                   "minItems": 2, "maxItems": 2}}),
]


def _in_array(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "array", "items": schema, "minItems": 1, "maxItems": 2}


def _wrapped(schema: dict[str, Any]) -> dict[str, Any]:
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    inner = {k: v for k, v in schema.items() if k not in defs}
    return {**defs, **_obj({"result": inner})}


# The base schemas, then variants that put a few of them inside arrays and objects (the refs of
# a wrapped schema stay at its root).
SCHEMAS: list[dict[str, Any]] = _BASE + [_in_array(s) for s in _BASE[:6]] + [_wrapped(s) for s in _BASE[6:14]] \
    + [_wrapped(_BASE[28]), _wrapped(_BASE[29])]
