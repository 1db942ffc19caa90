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

Rewrite = Callable[[dict[str, Any], bool], dict[str, Any]]  # (a schema, is it a member of allOf) -> schema


def _walk(schema: Any, rewrite: Rewrite, in_all_of: bool = False) -> Any:
    """`schema` with `rewrite` applied to every schema in it, innermost first."""
    if isinstance(schema, list):  # `items` as a list
        return [_walk(s, rewrite) for s in schema]
    if not isinstance(schema, dict):  # true, false
        return schema
    node = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            node[key] = {name: _walk(s, rewrite) for name, s in node[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            node[key] = [_walk(s, rewrite, key == "allOf") for s in node[key]]
    for key in _SCHEMAS:
        if key in node:
            node[key] = _walk(node[key], rewrite)
    return rewrite(node, in_all_of)


def _close(node: dict[str, Any], in_all_of: bool) -> dict[str, Any]:
    # A member of allOf is left open: closed, it would refuse the properties its siblings list.
    if in_all_of or not isinstance(node.get("properties"), dict):
        return node
    if "additionalProperties" in node or "unevaluatedProperties" in node:
        return node
    return {**node, "additionalProperties": False}


def closed(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` on each object that lists `properties` and does
    not say whether others may come."""
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
