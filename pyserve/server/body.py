"""Request bodies held to the server's schemas: validation with errors that name the field (the
JSON parsing and responses are the shared HTTP layer's: pyserve.http.responses)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from pyserve.http.errors import BadRequest
from pyserve.server.schemas import NO_EFFECT_FIELDS, REFUSED_FIELDS


def validate(schema: type[BaseModel], data: dict[str, Any], no_effect: frozenset[str] = NO_EFFECT_FIELDS,
             refused: dict[str, tuple[Any, ...]] = REFUSED_FIELDS):
    """`data` as `schema`; a field the schema does not serve is refused (see server.schemas),
    unless it cannot change the output (`no_effect`) or holds a value that means "off" (`refused`
    names them). Types are strict, as OpenAI's API has them: a string is never read as a number
    nor a boolean as an integer, an integer field takes no 5.0; a number field takes an integer."""
    for key, value in data.items():
        if key in schema.model_fields or key in no_effect:
            continue
        off = refused.get(key)
        if off is None:
            raise BadRequest(f"{key}: unknown field (this server does not support it)", param=key)
        if not any(value == v and type(value) is type(v) or (value is None and v is None) for v in off):
            raise BadRequest(f"{key}: not supported by this server", param=key)
    try:
        request = schema.model_validate(data, strict=True)
    except ValidationError as e:
        param, message = _explained(e.errors())
        raise BadRequest(f"{param}: {message}" if param else message, param=param) from e
    check = getattr(request, "check", None)
    if check is not None:  # combinations of fields, each valid alone
        check()
    return request


def _explained(errors: list[dict]) -> tuple[str | None, str]:
    """(field, message) of the first field in error. A field of several accepted types has one
    error per type: the one that says more than "wrong type" (a list too long, a value out of
    range) is given; when each only says "wrong type", the types it accepts are listed."""
    param = _field_path(errors[0]["loc"])
    same = [e for e in errors if _field_path(e["loc"]) == param]
    telling = [e for e in same if not e["type"].endswith(("_type", "_parsing"))]
    if telling:  # named down to the item or key at fault ('messages.0.content.0.foo')
        loc = telling[0]["loc"]
        return ".".join(str(x) for x in loc if x != _member_tag(loc)) or None, telling[0]["msg"].removeprefix("Value error, ")
    tags = list(dict.fromkeys(tag for e in same if (tag := _member_tag(e["loc"])) is not None))
    if len(tags) > 1:
        return param, f"expected {', '.join(tags[:-1])} or {tags[-1]}"
    return param, errors[0]["msg"]


def check_token_ids(ids, vocab: int, param: str) -> None:
    """A 400 naming `param` for the first token id outside [0, vocab)."""
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise BadRequest(f"{param}: token id {bad} is outside the vocabulary [0, {vocab})", param=param)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _member_tag(loc: tuple) -> str | None:
    """The union member an error is about ('prompt.list[int].1' -> 'list[int]'), if any."""
    return next((x for x in loc if isinstance(x, str) and (not x.isidentifier() or x in _TYPE_TAGS)), None)


def _field_path(loc: tuple) -> str | None:
    """The field an error is about: pydantic's location up to the first union member tag
    ('stop.str' -> 'stop', 'prompt.list[int].1' -> 'prompt', 'messages.0.role' stays)."""
    parts = []
    for x in loc:
        if isinstance(x, str) and (not x.isidentifier() or x in _TYPE_TAGS):
            break
        parts.append(str(x))
    return ".".join(parts) or None
