"""StructuredOutput: what a request's output must match, carried to the engine as a grammar's text.

Made from a JSON schema, "any JSON object", a regular expression or a Lark grammar (llguidance's
dialect, which may embed JSON schemas as `%json {...}`), and checked when it is made: a schema the
grammar engine cannot honour raises InvalidRequestError naming the field, before any engine work.
The engine compiles the grammar off its thread (engine/grammar.py) and masks the request's tokens
with it, so the output parses; llguidance is the grammar engine (docs/structured-output.md says why).

JSON is written compactly but readably (`{"a": 1, "b": [2, 3]}`): no free whitespace, which a model
could otherwise fill until its token limit.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import llguidance

from kvserve.errors import InvalidRequestError
from kvserve.json_schemas import MAX_DEPTH, closed, depth, inexact_number_bound, reference_loop

MAX_SCHEMA_BYTES = 64 << 10  # a schema's JSON text; bounds compile time (bench/results/structured.json)
MAX_GRAMMAR_BYTES = 512 << 10  # a whole grammar (a tool list embeds each function's schema)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def parser_limits() -> llguidance.LLParserLimits:
    """The grammar engine's fuel: bounds on a grammar's size and on the work of compiling it and of
    each token's mask (past them the grammar is refused, or its request fails)."""
    return llguidance.LLParserLimits(max_grammar_size=200_000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000)


@dataclass(frozen=True)
class StructuredOutput:
    """A checked grammar. `grammar` is llguidance's grammar text (what the engine compiles, and the
    key its compiled form is cached under); `kind` says what it was made from."""

    grammar: str
    kind: str  # "json_schema", "json_object", "regex", "lark" or "tool_calls"

    @classmethod
    def json_schema(
        cls, schema: dict[str, Any] | bool | str, param: str = "response_format", kind: str = "json_schema"
    ) -> StructuredOutput:
        """Output valid against `schema` (a dict, its JSON text, or `true` for any JSON value). A
        schema made of several (kind "tool_calls": every function's) is bounded as a grammar only."""
        max_bytes = MAX_GRAMMAR_BYTES if kind == "tool_calls" else MAX_SCHEMA_BYTES
        return cls.from_grammar(json_schema_grammar(schema, param, max_bytes), kind, param)

    @classmethod
    def json_object(cls) -> StructuredOutput:
        """Any JSON object (OpenAI's `{"type": "json_object"}`)."""
        return cls.json_schema({"type": "object"})

    @classmethod
    def regex(cls, pattern: str, param: str = "regex") -> StructuredOutput:
        if not isinstance(pattern, str):
            raise InvalidRequestError(f"{param} must be a string (a regular expression).", param)
        return cls.from_grammar(llguidance.LLMatcher.grammar_from_regex(pattern), "regex", param)

    @classmethod
    def lark(cls, grammar: str, param: str = "grammar", kind: str = "lark") -> StructuredOutput:
        """A Lark grammar in llguidance's dialect (`start: ...`; `%json {...}` embeds a JSON schema)."""
        if not isinstance(grammar, str):
            raise InvalidRequestError(f"{param} must be a string (a Lark grammar).", param)
        return cls.from_grammar(llguidance.LLMatcher.grammar_from_lark(grammar), kind, param)

    @classmethod
    def from_grammar(cls, grammar: str, kind: str, param: str) -> StructuredOutput:
        if len(grammar) > MAX_GRAMMAR_BYTES:
            raise InvalidRequestError(
                f"{param}: the grammar is {len(grammar)} bytes, more than the {MAX_GRAMMAR_BYTES} kvserve compiles; "
                "send a smaller schema (fewer properties or tools).",
                param,
            )
        problem = _grammar_problem(grammar)
        if problem:
            raise InvalidRequestError(f"{param}: {problem}", param)
        return cls(grammar, kind)


def json_schema_grammar(
    schema: dict[str, Any] | bool | str, param: str = "response_format", max_bytes: int = MAX_SCHEMA_BYTES
) -> str:
    """llguidance's grammar text for a JSON schema (not yet checked: StructuredOutput.from_grammar does)."""
    if isinstance(schema, str):
        if len(schema) > max_bytes:
            raise _too_large(len(schema), param, max_bytes)
        try:
            schema = json.loads(schema)
        except RecursionError:
            raise _too_deep(param) from None
        except ValueError as exc:
            raise InvalidRequestError(f"{param}: the schema is not valid JSON ({exc}).", param) from None
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise InvalidRequestError(
            f"{param}: a JSON schema must be an object (or true); got {type(schema).__name__}"
            + (" false, which no output matches" if schema is False else "")
            + ".",
            param,
        )
    if depth(schema) > MAX_DEPTH:  # before anything walks it
        raise _too_deep(param)
    text = json.dumps(schema, separators=(",", ":"))
    if len(text) > max_bytes:  # the client's schema, as sent
        raise _too_large(len(text), param, max_bytes)
    problem = inexact_number_bound(schema) or reference_loop(schema)
    if problem:
        raise InvalidRequestError(f"{param}: {problem}", param)
    text = json.dumps(closed(schema), separators=(",", ":"))
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(text, overrides=JSON_OPTIONS)
    except ValueError as exc:
        if "recursion limit" in str(exc):
            raise _too_deep(param) from None
        raise InvalidRequestError(f"{param}: the schema cannot be used: {exc}.", param) from None


def _too_deep(param: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"{param}: the schema nests objects and arrays too deeply for the grammar engine (at most about "
        f"{MAX_DEPTH} levels); flatten it (a recursive structure can refer to itself through $defs and $ref).",
        param,
    )


def _too_large(size: int, param: str, max_bytes: int) -> InvalidRequestError:
    return InvalidRequestError(
        f"{param}: the schema is {size} bytes of JSON, more than the {max_bytes} kvserve compiles; "
        "send a smaller schema (fewer properties or tools).",
        param,
    )


@lru_cache(maxsize=1024)
def _grammar_problem(grammar: str) -> str:
    """Why the grammar engine refuses `grammar` (a sentence), or "" when it takes it. Cached: a
    client usually sends the same few schemas."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None, limits=parser_limits())
    if not is_error:
        return ""
    message = messages[0].strip() if messages else "the grammar is invalid"
    if "coerce_one_of" in message:  # llguidance's advice names an option of its own, not the client's
        return (
            "oneOf is supported only where its alternatives cannot both match (llguidance cannot check that "
            "one and only one does); use anyOf, or make the alternatives exclusive (a const or enum property each)."
        )
    if "Unimplemented keys" in message or "Unknown format" in message:
        return f"this schema uses what kvserve's grammar engine does not support ({message}); remove it."
    if "Failed to generate regex for" in message:  # llguidance's, for a number bound it cannot express
        return f"the grammar engine cannot hold a number bound of this schema ({message}); leave it out, or use a smaller one."
    if "limit" in message.lower() or "too" in message.lower():
        return f"the schema is too large or too deeply nested to compile ({message}); simplify it."
    return f"the schema is invalid or unsatisfiable ({message}); fix it."
