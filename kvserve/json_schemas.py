"""Rewriting JSON schemas before they become grammars: keyword by keyword, so that a property
named "enum" or "$ref" is a name and a `const` value is a value, never a schema.

- `closed`: an object that lists its properties and says nothing of others allows no others (as
  vLLM's default grammar engine, xgrammar, reads it, and as OpenAI's strict mode requires), or a
  small model adds keys until `max_tokens`. `additionalProperties: true` keeps one open.
- `rebased` / `has_ref`: a schema embedded below another's root keeps its references (`$ref`)
  pointing where they did (tool calls embed each function's parameters).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMAS = (
    "items",  # a schema, or (before 2020-12) a list of them
    "additionalItems",
    "unevaluatedItems",
    "contains",
    "additionalProperties",
    "unevaluatedProperties",
    "propertyNames",
    "not",
    "if",
    "then",
    "else",
)
# Schemas that describe part of the same instance as the schema they are in (which a closed object
# would refuse the rest of): allOf's members and the conditionals always; anyOf's and oneOf's where
# the schema lists properties of its own too.
_PARTS = frozenset({"allOf", "not", "if", "then", "else", "dependentSchemas"})

Rewrite = Callable[[dict[str, Any], bool], dict[str, Any]]  # (a schema, is it a part of another) -> schema


def _walk(schema: Any, rewrite: Rewrite, is_part: bool = False) -> Any:
    """`schema` with `rewrite` applied to every schema in it, innermost first."""
    if isinstance(schema, list):  # `items` as a list
        return [_walk(s, rewrite) for s in schema]
    if not isinstance(schema, dict):  # true, false
        return schema
    node = dict(schema)
    has_properties = isinstance(node.get("properties"), dict)
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            node[key] = {name: _walk(s, rewrite, key in _PARTS) for name, s in node[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            part = key in _PARTS or (key in ("anyOf", "oneOf") and has_properties)
            node[key] = [_walk(s, rewrite, part) for s in node[key]]
    for key in _SCHEMAS:
        if key in node:
            node[key] = _walk(node[key], rewrite, key in _PARTS)
    return rewrite(node, is_part)


_COMBINED = ("allOf", "anyOf", "oneOf", "if", "then", "else", "dependentSchemas", "$ref")


def _close(node: dict[str, Any], is_part: bool) -> dict[str, Any]:
    if is_part or not isinstance(node.get("properties"), dict):
        return node
    if "additionalProperties" in node or "unevaluatedProperties" in node:
        return node
    if any(key in node for key in _COMBINED):  # properties from elsewhere may complete it: left open
        return node
    return {**node, "additionalProperties": False}


def closed(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` on each object that lists `properties` and does
    not say whether others may come, unless it describes only part of an object (allOf's members,
    conditionals, anyOf's and oneOf's beside properties of their own)."""
    return _walk(schema, _close)


def rebased(schema: Any, root: str) -> Any:
    """`schema` with each local reference ("#", "#/...") resolved from the JSON pointer `root` of
    the schema it is embedded in."""

    def rebase(node: dict[str, Any], _: bool) -> dict[str, Any]:
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            return {**node, "$ref": "#" + root + ref[1:]}
        return node

    return _walk(schema, rebase)


def has_ref(schema: Any) -> bool:
    found = []

    def note(node: dict[str, Any], _: bool) -> dict[str, Any]:
        if isinstance(node.get("$ref"), str):
            found.append(node)
        return node

    _walk(schema, note)
    return bool(found)
