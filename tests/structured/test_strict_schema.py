"""`strict: true`'s schema: every object schema closed to the properties it names, nested ones
and definitions included; what a schema says itself is kept."""

from __future__ import annotations

from pyserve.structured.strict_schema import closed_objects


def test_every_object_is_closed_and_what_the_schema_says_is_kept():
    schema = {
        "type": "object",
        "properties": {"type": {"type": "string"},  # a property named like a keyword is not a schema keyword
                       "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {}}}},
                       "any": {"anyOf": [{"type": ["object", "null"], "properties": {"x": {}}}, {"type": "string"}]},
                       "open": {"type": "object", "additionalProperties": True},
                       "maps": {"type": "object", "additionalProperties": {"type": "object"}}},
        "$defs": {"d": {"properties": {"y": {}}}},
    }
    out = closed_objects(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["type"] == {"type": "string"}
    assert out["properties"]["tags"]["items"]["additionalProperties"] is False
    assert out["properties"]["any"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in out["properties"]["any"]["anyOf"][1]
    assert out["properties"]["open"]["additionalProperties"] is True
    assert out["properties"]["maps"]["additionalProperties"] == {"type": "object", "additionalProperties": False}
    assert out["$defs"]["d"]["additionalProperties"] is False
    assert "additionalProperties" not in schema and "additionalProperties" not in schema["$defs"]["d"]  # a copy
