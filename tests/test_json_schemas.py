"""JSON schemas rewritten before they become grammars (kvserve/json_schemas.py): objects closed to
keys they do not list, references rebased where a schema is embedded, keyword by keyword. The
grammars are checked with llguidance's matcher on the bundled model's tokenizer."""

from __future__ import annotations

import json

import llguidance
import pytest

from kvserve import StructuredOutput
from kvserve.json_schemas import closed, has_ref, rebased
from kvserve.text.tokenizer import Tokenizer

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"]}


# Objects that others complete: none may be closed (each was unsatisfiable, or refused "age", closed).
BASE = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"]}
AGE = {"properties": {"age": {"type": "integer"}}, "required": ["age"]}
INCOMPLETE = [
    {"properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name", "age"]},  # names more
    {"$defs": {"Base": BASE}, "allOf": [{"$ref": "#/$defs/Base"}, AGE]},  # inheritance through a definition
    {"$defs": {"Base": BASE}, "$ref": "#/$defs/Base", **AGE},  # a definition extended beside its reference
    {"$defs": {"Base": {"$ref": "#/$defs/Root"}, "Root": BASE}, "allOf": [{"$ref": "#/$defs/Base"}, AGE]},
    {"$defs": {"A Base": BASE}, "allOf": [{"$ref": "#/$defs/A%20Base"}, AGE]},  # a percent-encoded reference
]


def test_objects_that_list_their_properties_are_closed_and_nothing_else_changes():
    schema = {
        "type": "object",
        "properties": {
            "enum": {"type": "object", "properties": {"x": {"type": "integer"}}},  # a property named "enum"
            "properties": {"type": "string"},  # and one named "properties"
            "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {"const": "v"}}}},
            "open": {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True},
            "free": {"type": "object"},
            "either": {"anyOf": [PERSON, {"type": "null"}]},
            "both": {"allOf": [{"properties": {"a": {"type": "integer"}}}, {"properties": {"b": {"type": "integer"}}}]},
        },
        "$defs": {"Node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/Node"}}}},
        "const": {"properties": {"left": "as it is"}},  # a value, not a schema
    }
    mixed = {
        "properties": {"kind": {"enum": ["a", "b"]}},
        "anyOf": [{"properties": {"a": {"type": "integer"}}}, {"properties": {"b": {"type": "integer"}}}],
        "if": {"properties": {"kind": {"const": "a"}}},
        "then": {"properties": {"a": {"type": "integer"}}, "required": ["a"]},
    }
    assert closed(mixed) == mixed  # each part describes the same object as the rest: nothing closes
    union = closed({"anyOf": [PERSON, {"type": "object", "properties": {"id": {"type": "integer"}}}]})
    assert all(member["additionalProperties"] is False for member in union["anyOf"])  # each alone: closed
    # a root that only refers to its definition (pydantic's recursive model) closes the definition
    node = {
        "$defs": {
            "Node": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/Node"}}}}
        },
        "$ref": "#/$defs/Node",
    }
    assert closed(node)["$defs"]["Node"]["additionalProperties"] is False
    out = closed(schema)
    props = out["properties"]
    assert out["additionalProperties"] is False
    assert props["enum"]["additionalProperties"] is False
    assert props["properties"] == {"type": "string"}
    assert props["tags"]["items"]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True
    assert props["free"] == {"type": "object"}  # lists no properties: any object, as json_object is
    assert props["either"]["anyOf"][0]["additionalProperties"] is False
    # allOf's members are left open (closed, each would refuse its siblings' properties), and so is the
    # whole, which lists no properties itself
    assert all("additionalProperties" not in member for member in props["both"]["allOf"])
    assert "additionalProperties" not in props["both"]
    assert out["$defs"]["Node"]["additionalProperties"] is False
    assert out["const"] == {"properties": {"left": "as it is"}}
    assert "additionalProperties" not in schema  # the caller's schema is not touched
    assert closed(out) == out


def test_references_are_rebased_keyword_by_keyword():
    schema = {
        "properties": {
            "enum": {"$ref": "#/$defs/E"},  # a property named "enum": its reference is rebased
            "self": {"anyOf": [{"$ref": "#"}, {"type": "null"}]},
            "far": {"$ref": "https://example.com/x.json"},  # not local: left as it is
        },
        "default": {"$ref": "#/not/a/schema"},  # a value
        "$defs": {"E": {"enum": ["a"]}},
    }
    out = rebased(schema, "/$defs/f")
    assert out["properties"]["enum"] == {"$ref": "#/$defs/f/$defs/E"}
    assert out["properties"]["self"]["anyOf"][0] == {"$ref": "#/$defs/f"}
    assert out["properties"]["far"] == {"$ref": "https://example.com/x.json"}
    assert out["default"] == {"$ref": "#/not/a/schema"}
    assert has_ref(schema) and not has_ref({"properties": {"$ref": {"type": "string"}}, "const": {"$ref": "#"}})


def _accepts(tokenizer: Tokenizer, output: StructuredOutput, text: str) -> bool:
    ll = llguidance.LLTokenizer(tokenizer.backend.to_str(), eos_token=list(tokenizer.stop_token_ids))
    matcher = llguidance.LLMatcher(ll, output.grammar, log_level=0)
    return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()


@pytest.mark.bundled
def test_a_schema_that_does_not_mention_other_keys_refuses_them(bundled_gguf):
    """Before, a small model could add keys after the listed ones until max_tokens cut it off."""
    smol = Tokenizer.from_gguf(bundled_gguf)
    person = StructuredOutput.json_schema(PERSON)
    assert _accepts(smol, person, '{"name": "Ada"}')
    assert not _accepts(smol, person, '{"name": "Ada", "age": 36}')
    opened = StructuredOutput.json_schema({**PERSON, "additionalProperties": True})
    assert _accepts(smol, opened, '{"name": "Ada", "age": 36}')
    parts = {"allOf": [PERSON, {"properties": {"age": {"type": "integer"}}, "required": ["age"]}]}
    assert _accepts(smol, StructuredOutput.json_schema(parts), '{"name": "Ada", "age": 36}')  # not closed apart
    for schema in INCOMPLETE:  # each compiles, and takes the key another part adds
        assert _accepts(smol, StructuredOutput.json_schema(schema), '{"name": "Ada", "age": 36}'), schema
    anything = StructuredOutput.json_object()
    assert _accepts(smol, anything, json.dumps({"any": {"keys": [1, 2]}}))


def test_a_chain_of_references_is_walked_a_fixed_number_of_times(monkeypatch):
    """Each reference of a chain found to be a part once took another walk of the whole schema: 1,900
    links of a 64 KiB schema held the server's event loop for 5 s. Now two walks, whatever its length
    (one to find the parts, one to close the rest), and the chain's end is still read as a part."""
    import kvserve.json_schemas as json_schemas

    defs = {f"D{i}": {"$ref": f"#/$defs/D{i + 1}"} for i in range(300)}
    defs["D300"] = {"type": "object", "properties": {"a": {"type": "integer"}}}
    schema = {"allOf": [{"$ref": "#/$defs/D0"}, AGE], "$defs": defs}
    walks = []
    walk = json_schemas._walk

    def counted(node, rewrite, is_part=False, parts=frozenset(), path="#"):
        if path == "#":
            walks.append(path)
        return walk(node, rewrite, is_part, parts, path)

    monkeypatch.setattr(json_schemas, "_walk", counted)
    assert "additionalProperties" not in closed(schema)["$defs"]["D300"]  # a part of allOf's object: open
    assert len(walks) == 2
