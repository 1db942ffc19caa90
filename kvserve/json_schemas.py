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
from urllib.parse import unquote

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

Rewrite = Callable[[dict[str, Any], bool, str], dict[str, Any]]  # (a schema, is it a part, its path) -> schema


def _walk(
    schema: Any, rewrite: Rewrite, is_part: bool = False, parts: frozenset[str] = frozenset(), path: str = "#"
) -> Any:
    """`schema` with `rewrite` applied to every schema in it, innermost first. `parts`: references
    ("#/$defs/Name") to schemas that are parts where they are referred to; `path` is this one's."""
    if not isinstance(schema, dict):  # true, false
        return schema
    node = dict(schema)
    has_properties = isinstance(node.get("properties"), dict)

    def inner(child: Any, key: str, part: bool) -> Any:
        where = f"{path}/{key}"
        if isinstance(child, list):  # `items` as a list
            return [_walk(s, rewrite, part, parts, f"{where}/{i}") for i, s in enumerate(child)]
        return _walk(child, rewrite, part or where in parts, parts, where)

    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            node[key] = {name: inner(s, f"{key}/{_escaped(name)}", key in _PARTS) for name, s in node[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            part = key in _PARTS or (key in ("anyOf", "oneOf") and has_properties)
            node[key] = [inner(s, f"{key}/{i}", part) for i, s in enumerate(node[key])]
    for key in _SCHEMAS:
        if key in node:
            node[key] = inner(node[key], key, key in _PARTS)
    return rewrite(node, is_part, path)


def _escaped(name: str) -> str:
    """A JSON pointer's reference token (RFC 6901)."""
    return name.replace("~", "~0").replace("/", "~1")


_COMBINED = ("allOf", "anyOf", "oneOf", "if", "then", "else", "dependentSchemas", "$ref")
# What may sit beside a `$ref` without extending what it refers to (the root's definitions, for one).
_ANNOTATIONS = frozenset(
    {
        "$ref",
        "description",
        "title",
        "$comment",
        "default",
        "examples",
        "deprecated",
        "$defs",
        "definitions",
        "$schema",
        "$id",
    }
)


def is_reference(schema: Any) -> bool:
    """Whether `schema` is a `$ref` and nothing more (annotations and definitions beside it): what it
    refers to says all of what it allows."""
    return isinstance(schema, dict) and isinstance(schema.get("$ref"), str) and all(k in _ANNOTATIONS for k in schema)


def _close(node: dict[str, Any], is_part: bool, _: str) -> dict[str, Any]:
    properties = node.get("properties")
    if is_part or not isinstance(properties, dict):
        return node
    if "additionalProperties" in node or "unevaluatedProperties" in node:
        return node
    if any(key in node for key in _COMBINED):  # properties from elsewhere may complete it: left open
        return node
    required = node.get("required")
    if isinstance(required, list) and any(key not in properties for key in required):
        return node  # it names keys it does not list: others are meant to come
    return {**node, "additionalProperties": False}


def _referred_as_parts(schema: dict[str, Any]) -> frozenset[str]:
    """The references to be read as parts of another schema: from a part, or beside other keywords
    (a definition extended there). Their definitions are then parts too, and what they refer to:
    one walk, then the references' chain (a walk per link was quadratic in a chain's length)."""
    found: set[str] = set()
    refers: dict[str, str] = {}  # a schema's path -> the reference it holds

    def note(node: dict[str, Any], is_part: bool, path: str) -> dict[str, Any]:
        ref = node.get("$ref")
        if isinstance(ref, str):
            refers[path] = unquote(ref)  # "#/$defs/A%20B" names the path "#/$defs/A B"
            if is_part or any(key not in _ANNOTATIONS for key in node):
                found.add(refers[path])
        return node

    _walk(schema, note)
    todo = list(found)
    while todo:  # a part's own reference names a part too
        ref = refers.get(todo.pop())
        if ref is not None and ref not in found:
            found.add(ref)
            todo.append(ref)
    return frozenset(found)


def closed(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` on each object that lists `properties` and does
    not say whether others may come, unless it describes only part of an object (allOf's members,
    conditionals, anyOf's and oneOf's beside properties of their own, a definition one of those
    refers to) or names required keys it does not list."""
    if not isinstance(schema, dict):
        return schema
    return _walk(schema, _close, parts=_referred_as_parts(schema))


def rebased(schema: Any, root: str) -> Any:
    """`schema` with each local reference ("#", "#/...") resolved from the JSON pointer `root` of
    the schema it is embedded in."""

    def rebase(node: dict[str, Any], _: bool, __: str) -> dict[str, Any]:
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            return {**node, "$ref": "#" + root + ref[1:]}
        return node

    return _walk(schema, rebase)


def has_ref(schema: Any) -> bool:
    found = []

    def note(node: dict[str, Any], _: bool, __: str) -> dict[str, Any]:
        if isinstance(node.get("$ref"), str):
            found.append(node)
        return node

    _walk(schema, note)
    return bool(found)


def reference_loop(schema: Any) -> str | None:
    """A sentence on the first definition that is only a reference leading back to itself (`"A": {"$ref":
    "#/$defs/A"}`, or A to B to A): it allows no value at all, and the grammar engine failed on reaching
    it, mid-answer (a 500). None where there is none; a recursion through properties or items is fine."""
    refers: dict[str, str] = {}  # a schema's path -> the reference it is, for those that are nothing more

    def note(node: dict[str, Any], _: bool, path: str) -> dict[str, Any]:
        if is_reference(node):
            refers[path] = unquote(node["$ref"])
        return node

    _walk(schema, note)
    for start in refers:
        chain = [start]
        while (at := refers.get(chain[-1])) is not None and at not in chain:
            chain.append(at)
        if at is not None:  # back at a reference of the chain
            loop = " -> ".join([*chain[chain.index(at) :], at])
            return (
                f"{loop} is a loop of references with nothing else in it: no value matches it. Give the "
                "definition a type, properties or items of its own."
            )
    return None


MAX_DEPTH = 128  # a schema's JSON nesting the grammar engine reads (its JSON parser's recursion limit)
LARGEST_BOUND = 2**63 - 1  # the grammar engine holds integer bounds as 64-bit integers


def depth(value: Any) -> int:
    """How deeply `value`'s objects and arrays nest (without recursion: a client's schema may nest
    deeper than Python's stack)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        node, level = todo.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is not None:
            deepest = max(deepest, level)
            todo.extend((child, level + 1) for child in children)
    return deepest


def inexact_number_bound(schema: Any) -> str | None:
    """A sentence on the first number bound the grammar engine would not hold, or None: one beyond
    64-bit integers, and, as llguidance 1.9 lets through the excluded integer N of a range with no
    integer in it, `exclusiveMinimum` N >= 0 with every value below N + 1 (it allows "N" itself; and
    `exclusiveMaximum` N <= 0 with every value above N - 1, "N", or "-0" for 0)."""
    found: list[tuple[str, str]] = []  # (where, the excluded value it lets through)
    beyond: list[str] = []

    def note(node: dict[str, Any], _: bool, path: str) -> dict[str, Any]:
        for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            value = node.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) > LARGEST_BOUND:
                beyond.append(f"{path}: {key} {value}")
        kind = node.get("type")
        if kind == "integer" or (isinstance(kind, list) and "number" not in kind):
            return node  # integers are held exactly
        low, low_excluded = _bound(node, "minimum", "exclusiveMinimum", max)
        high, high_excluded = _bound(node, "maximum", "exclusiveMaximum", min)
        if low is None or high is None:
            return node
        if low_excluded and _is_whole(low) and low >= 0 and high < low + 1:
            found.append((f"{path}: exclusiveMinimum {low:g} with a maximum below {low + 1:g}", f"{low:g}"))
        elif high_excluded and _is_whole(high) and high <= 0 and low > high - 1:
            excluded = f"{high:g}" if high else "-0"
            found.append((f"{path}: exclusiveMaximum {high:g} with a minimum above {high - 1:g}", excluded))
        return node

    _walk(schema, note)
    if beyond:  # it was held at 2**63 - 1 (an output outside the schema's range), or refused as "unsatisfiable"
        return (
            f"{beyond[0]} is beyond the bounds kvserve's grammar engine holds (-{LARGEST_BOUND} to {LARGEST_BOUND}); "
            "leave the bound out, or send such numbers as strings with a pattern."
        )
    if not found:
        return None
    where, excluded = found[0]
    return (
        f"{where} cannot be held exactly: kvserve's grammar engine would let {excluded} itself through; use "
        "minimum or maximum a little inside the bound instead (0.000001 inside it, say)."
    )


def _is_whole(value: float) -> bool:
    """Whether a bound is a whole number, without float() (a JSON integer may exceed a float's range)."""
    return isinstance(value, int) or value.is_integer()


def _bound(node: dict[str, Any], inclusive: str, exclusive: str, stricter: Callable) -> tuple[float | None, bool]:
    """A schema's effective bound on one side from its two keywords: (value, excluded), or (None, False)."""
    bounds = [
        (node[key], key == exclusive)
        for key in (inclusive, exclusive)
        if isinstance(node.get(key), (int, float)) and not isinstance(node.get(key), bool)
    ]
    if not bounds:
        return None, False
    value = stricter(b for b, _ in bounds)
    return value, any(excluded for b, excluded in bounds if b == value)
