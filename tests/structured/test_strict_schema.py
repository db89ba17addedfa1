"""`strict: true`'s schema: every object schema closed to the properties it names, nested ones
and definitions included; an object that asks for other properties refused, as OpenAI refuses it."""

from __future__ import annotations

import pytest

from pyserve.structured.params import GrammarError
from pyserve.structured.strict_schema import closed_objects


def test_every_object_is_closed():
    schema = {
        "type": "object",
        "properties": {"type": {"type": "string"},  # a property named like a keyword is not a schema keyword
                       "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {}}}},
                       "any": {"anyOf": [{"type": ["object", "null"], "properties": {"x": {}}}, {"type": "string"}]},
                       "closed": {"type": "object", "additionalProperties": False}},
        "$defs": {"d": {"properties": {"y": {}}}},
    }
    out = closed_objects(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["type"] == {"type": "string"}
    assert out["properties"]["tags"]["items"]["additionalProperties"] is False
    assert out["properties"]["any"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in out["properties"]["any"]["anyOf"][1]
    assert out["properties"]["closed"] == {"type": "object", "additionalProperties": False}
    assert out["$defs"]["d"]["additionalProperties"] is False
    assert "additionalProperties" not in schema and "additionalProperties" not in schema["$defs"]["d"]  # a copy


@pytest.mark.parametrize("extra", [True, {"type": "string"}])
def test_an_object_open_to_other_properties_is_refused(extra):
    schema = {"type": "object", "properties": {"m": {"type": "object", "additionalProperties": extra}}}
    with pytest.raises(GrammarError, match="additionalProperties must be false"):
        closed_objects(schema)
