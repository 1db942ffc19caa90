"""Hypothesis strategies for request bodies of kvserve's HTTP API, and the property every response
must have. Shared by tests/test_fuzz.py (a short, fixed-seed run) and bench/fuzz.py (a long run).

A generated `Case` is one HTTP request: method, route, auth, headers and the raw body bytes. Bodies
are mostly well-formed-ish JSON objects whose fields are drawn from valid, edge and hostile values;
hostile numbers and tokens (2**64, 5,000-digit integers, NaN, Infinity, 100k-deep nesting) are
written as raw JSON text (`Raw`), and lone UTF-16 surrogates reach the server as `\\ud800` escapes.

The property (`Fuzzer.execute`), for every response, including the probes that follow a request:
  * the status is below 500, and the transport did not fail;
  * every non-2xx response is `application/json` with the OpenAI error body
    {"error": {"message": non-empty str, "type": str, "param": str|None, "code": str|int|None}}
    (exactly those keys);
  * a 2xx JSON body is strict JSON (no NaN/Infinity); a 2xx stream is SSE whose data lines are strict
    JSON and whose last one is `data: [DONE]`; an error event inside a stream has the error shape and
    is not a `server_error` (a 500 in disguise), nor the first thing the stream says (what fails before
    any output must be a 4xx status, not 200 and an error event);
  * a session the request touched still answers (GET, a 2-token turn, DELETE: all < 500, OpenAI
    errors), and /health is 200 after every case (the engine still serves).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import httpx
from hypothesis import strategies as st

KEYS = ("k1", "k2")
MODEL = "tiny"
SESSION = "@SESSION"  # placeholder: a fresh session owned by k1, created for the case
BACKGROUND = "@BG"  # placeholder: the response id of the background stream (owned by k1)


# ----- raw JSON text -----------------------------------------------------------------------------
class Raw(str):
    """JSON text sent verbatim (numbers Python's json cannot write, NaN, deep nesting, ...)."""


def to_json(value: Any, abbreviate: bool = False) -> str:
    """JSON text of `value`; `Raw` parts verbatim, lone surrogates as \\uXXXX escapes (ensure_ascii).
    With `abbreviate`, long strings are shown as <N chars: start...> (for reports, not for sending)."""

    def short(text: str) -> str | None:
        if abbreviate and len(text) > 120:
            return f"<{len(text)} chars: {text[:40]!a}...>"
        return None

    if isinstance(value, Raw):
        return short(str(value)) or str(value)
    if isinstance(value, str):
        return short(value) or json.dumps(value)
    if isinstance(value, dict):
        return "{" + ",".join(f"{to_json(k, abbreviate)}:{to_json(v, abbreviate)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        if abbreviate and len(value) > 12:
            return "[" + ",".join(to_json(v, abbreviate) for v in value[:4]) + f",...({len(value)} items)]"
        return "[" + ",".join(to_json(v, abbreviate) for v in value) + "]"
    return json.dumps(value)


BODY_LIMIT = 200_000  # the max_body_bytes the fuzzed servers run with
DIGITS_5000 = Raw("1" + "0" * 5000)
HOSTILE_INTS = [
    2**31 - 1,
    2**31,
    2**32,
    2**53 + 1,
    2**63 - 1,
    2**63,
    2**64,
    -(2**63) - 1,
    -1,
    -(2**31),
    Raw("9" * 4300),  # the longest integer Python's json converts
    DIGITS_5000,
    Raw("-" + "9" * 5000),
    Raw("1e400"),
    Raw("-0"),
    Raw("NaN"),
    Raw("Infinity"),
    Raw("-Infinity"),
    1.5,
    0.0,
    1e300,
]
HOSTILE_FLOATS = [
    Raw("NaN"),
    Raw("Infinity"),
    Raw("-Infinity"),
    Raw("1e309"),
    Raw("-1e309"),
    Raw("1" * 400 + ".5"),
    1e308,
    -1e308,
    5e-324,
    -0.0,
    -1.0,
    2**64,
    DIGITS_5000,
    Raw("-" + "9" * 5000),
]
WRONG_TYPES = [None, True, False, "5", "", [], [1], {}, {"a": 1}]


def deep_list(depth: int) -> Raw:
    return Raw("[" * depth + "]" * depth)


def deep_object(depth: int) -> Raw:
    return Raw('{"a":' * depth + "1" + "}" * depth)


DEEP = [deep_list(d) for d in (50, 900, 2000, 99_000)] + [deep_object(d) for d in (900, 39_000)]

TEXT_PIECES = [
    "a",
    "hello",
    " ",
    "\n",
    "\ud800",
    "\udfff",
    "\udbff\udc00",  # a valid pair: U+10FC00 (not a lone surrogate)
    "\x00",
    "é",
    "😀",
    "<|im_end|>",
    "<|endoftext|>",
    "<|im_start|>",
    '"',
    "\\",
    "\u2028",
    "\ufeff",
    "\uffff",
]
short_text = st.one_of(
    st.lists(st.sampled_from(TEXT_PIECES), max_size=6).map("".join),
    st.text(max_size=12),
)
long_text = st.sampled_from([1_000, 20_000, BODY_LIMIT - 400, BODY_LIMIT + 100]).flatmap(
    lambda n: st.sampled_from(["a", "é", "\ud800", "<|im_end|>"]).map(lambda unit: (unit * n)[: max(n, 1)])
)
text = st.one_of(short_text, short_text, short_text, long_text)


def pick(valid: list | st.SearchStrategy, hostile: list | st.SearchStrategy, p_valid: int = 93) -> st.SearchStrategy:
    """A field value: from `valid` with probability about p_valid %, else from `hostile`, wrong
    types or deep nesting."""
    valid_s = valid if isinstance(valid, st.SearchStrategy) else st.sampled_from(valid)
    hostile_s = hostile if isinstance(hostile, st.SearchStrategy) else st.sampled_from(hostile)
    anything = st.one_of(
        *[hostile_s] * 6, st.sampled_from(WRONG_TYPES), st.sampled_from(WRONG_TYPES), st.sampled_from(DEEP)
    )
    return st.integers(0, 99).flatmap(lambda r: valid_s if r < p_valid else anything)


def ints(valid: list[int]) -> st.SearchStrategy:
    return pick(valid, HOSTILE_INTS)


def floats(valid: list[float]) -> st.SearchStrategy:
    return pick(valid, HOSTILE_FLOATS)


def bools() -> st.SearchStrategy:
    return pick([True, False], [0, 1, "true", "yes", 2.0, Raw("NaN")])


UNKNOWN_FIELDS = st.dictionaries(
    st.sampled_from(["foo", "tools", "functions", "logit_bias", "suffix", "best_of", "\ud800", "", "prompt_ids"]),
    st.one_of(st.sampled_from(WRONG_TYPES), st.sampled_from(HOSTILE_INTS)),
    max_size=2,
)

SAMPLING = {
    "model": pick([MODEL, None], ["other", "", "\ud800", 5, "tiny\x00"]),
    "temperature": floats([0, 0, 0.5, 1.0, 2.0, 100.0]),
    "top_p": floats([1.0, 0.9, 0.5, 1e-9]),
    "top_k": ints([-1, 0, 1, 5, 300, 2**31 - 1]),
    "min_p": floats([0.0, 0.1, 1.0]),
    "repetition_penalty": floats([1.0, 1.2, 10.0, 0.1]),
    "presence_penalty": floats([0.0, 2.0, -2.0, 0.5]),
    "frequency_penalty": floats([0.0, 2.0, -2.0, 0.5]),
    "seed": ints([0, 1, 42, 2**63 - 1, 2**32]),
    "n": ints([1, 1, 1, 2, 3, 16]),
    "stream": bools(),
    "stream_options": pick(
        [{"include_usage": True}, {"include_usage": False}, None], [{"x": 1}, "a", {"include_usage": "x"}]
    ),
    "stop": pick(
        st.one_of(st.none(), short_text, st.lists(short_text, max_size=4)),
        [[], [""], ["\ud800"], [5], [None], ["a"] * 100, "\ud800", "a" * 5000],
    ),
    "user": pick(st.one_of(st.none(), short_text), [5, ["u"]]),
    "min_tokens": ints([0, 1, 3]),
    "ignore_eos": bools(),
    "response_format": pick(
        [{"type": "text"}, None, {"type": "json_object"}],
        [
            {"type": "json_schema"},
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}},
            {},
            "x",
            {"type": "\ud800"},
        ],
    ),
}

MAX_TOKENS = pick([1, 1, 2, 2, 4, 8, 16], [0, None, *HOSTILE_INTS])


def body_of(required: dict, optional: dict) -> st.SearchStrategy:
    """A JSON object with `required` fields, a subset of `optional`, and sometimes unknown fields."""
    return st.tuples(st.fixed_dictionaries(required, optional=optional), UNKNOWN_FIELDS, st.integers(0, 9)).map(
        lambda t: {**t[0], **t[1]} if t[2] == 9 else t[0]
    )


token_ids = st.lists(
    pick(st.integers(0, 299), [300, 2**31 - 1, 2**31, 2**63, 2**64, -1, DIGITS_5000, 1.0, "a"]), min_size=0, max_size=8
)
prompt = pick(
    st.one_of(
        short_text, short_text, st.lists(short_text, min_size=1, max_size=3), token_ids, st.lists(token_ids, max_size=3)
    ),
    st.one_of(
        long_text,
        st.sampled_from([[], [[]], ["a", 1], [[[1]]], ["x"] * 400, [1] * 2000, 5, None, {"text": "a"}]),
    ),
)

COMPLETION = body_of(
    {"prompt": prompt},
    {
        **SAMPLING,
        "max_tokens": MAX_TOKENS,
        "logprobs": ints([None, 0, 1, 5, 20, 21]),
        "echo": bools(),
    },
)

content_parts = st.lists(
    st.one_of(
        st.fixed_dictionaries({"type": st.just("text"), "text": short_text}),
        st.sampled_from(
            [{"type": "image_url", "image_url": {"url": "x"}}, {"type": "text"}, {"type": "text", "text": 5}, {}, 5]
        ),
    ),
    max_size=3,
)
message = pick(
    st.fixed_dictionaries(
        {
            "role": pick(
                ["user", "user", "system", "assistant", "developer"], ["tool", "function", "", "\ud800", 5, None]
            ),
            "content": pick(st.one_of(text, content_parts, st.none()), [5, {"a": 1}, [5]]),
        },
        optional={"name": pick(short_text, [5]), "tool_calls": st.just([])},
    ),
    ["hi", 5, None, [], {"role": "user"}],
)
messages = pick(st.lists(message, min_size=1, max_size=4), st.sampled_from([[], "hi", [[]], [None]]))

CHAT = body_of(
    {"messages": messages},
    {
        **SAMPLING,
        "max_tokens": MAX_TOKENS,
        "max_completion_tokens": MAX_TOKENS,
        "logprobs": bools(),
        "top_logprobs": ints([None, 0, 1, 5, 20, 21]),
    },
)


def with_max_tokens(bodies: st.SearchStrategy) -> st.SearchStrategy:
    """Bodies that nearly always carry max_tokens: without it a chat generates up to the context and
    a completion 16 tokens (kept, rarely: slow by design, not a bug)."""
    return st.tuples(bodies, st.integers(0, 24), MAX_TOKENS).map(
        lambda t: (
            t[0] if t[1] == 24 or not isinstance(t[0], dict) or "max_tokens" in t[0] else {**t[0], "max_tokens": t[2]}
        )
    )


CHAT = with_max_tokens(CHAT)
COMPLETION = with_max_tokens(COMPLETION)

SESSION_CREATE = body_of(
    {},
    {
        "model": pick([MODEL, None], ["other", 5]),
        "system": pick(st.one_of(st.none(), text), [5, ["s"]]),
        "messages": pick(st.lists(message, max_size=3), ["hi", None]),
        "ttl": floats([None, 1, 60, 3600, 0.5, 1e308]),
    },
)
SESSION_MESSAGE = body_of(
    {
        "role": pick(["user", "user", "system", "assistant"], ["developer", "tool", "", "\ud800", None, 5]),
        "content": pick(text, [5, None, [{"type": "text", "text": "a"}]]),
    },
    {},
)
SESSION_APPEND = body_of({"text": pick(text, [5, None, ["a"]])}, {})
SESSION_TURN = body_of(
    {"max_tokens": MAX_TOKENS},
    {
        **SAMPLING,
        "max_completion_tokens": MAX_TOKENS,
        "logprobs": bools(),
        "top_logprobs": ints([None, 0, 1, 5, 20, 21]),
        "interrupt": bools(),
    },
)

# Whole bodies that are not a JSON object (or not JSON at all).
HOSTILE_BODIES = st.sampled_from(
    [
        b"",
        b"null",
        b"[]",
        b"1",
        b'"x"',
        b"{",
        b'{"prompt": "a"',
        b'{"prompt": "\xff\xfe"}',
        b'{"prompt": "a"} trailing',
        b'{"prompt": "a", "prompt": 5}',
        b'\xef\xbb\xbf{"prompt": "a"}',
        b"NaN",
        b'{"\\ud800": 1}',
        b'{"prompt": "\\ud800"}',
        b'{"prompt": "\\udc00\\ud800"}',
        b'{"prompt": "\\u0000"}',
        ("[" * 100_000).encode(),
        ("[" * 99_000 + "]" * 99_000).encode(),
        ('{"a":' * 39_000 + "1" + "}" * 39_000).encode(),
        b'{"prompt": ' + str(DIGITS_5000).encode() + b"}",
        b" " * (BODY_LIMIT + 1),
    ]
)

SESSION_IDS = [SESSION] * 8 + ["nope", "sess-0", "%ff", "%ed%a0%80", "a" * 5000, "..%2F..", "%00", "%F0%9F%98%80"]
REQUEST_IDS = [BACKGROUND] * 4 + ["nope", "cmpl-0", "%ff", "%ed%a0%80", "a" * 5000, "%00"]
AUTHS = ["k1"] * 6 + ["k2", "none", "wrong", "lower", "basic", "bytes", "empty"]

# method, route template, body strategy, path-id choices
ROUTES = [
    ("POST", "/v1/completions", COMPLETION, None),
    ("POST", "/v1/chat/completions", CHAT, None),
    ("POST", "/v1/sessions", SESSION_CREATE, None),
    ("POST", "/v1/sessions/{id}/messages", SESSION_MESSAGE, SESSION_IDS),
    ("POST", "/v1/sessions/{id}/append", SESSION_APPEND, SESSION_IDS),
    ("POST", "/v1/sessions/{id}/completions", SESSION_TURN, SESSION_IDS),
    ("DELETE", "/v1/sessions/{id}", None, SESSION_IDS),
    ("DELETE", "/v1/requests/{id}", None, REQUEST_IDS),
]


@dataclass
class Case:
    method: str
    route: str  # the template, e.g. /v1/sessions/{id}/messages
    path_id: str | None
    auth: str
    content_type: str | None
    request_id: str | None  # an X-Request-Id header
    body: bytes | None
    shown: str  # the body for reports (long strings abbreviated)

    def summary(self) -> dict:
        return {
            "method": self.method,
            "route": self.route,
            "path_id": None if self.path_id is None else self.path_id[:80],
            "auth": self.auth,
            "content_type": self.content_type,
            "x_request_id": self.request_id,
            "body_bytes": None if self.body is None else len(self.body),
            "body": self.shown,
        }


def _case(route, body, path_id, auth, content_type, request_id) -> Case:
    method, template, _, _ = route
    if body is None:
        raw, shown = None, None
    elif isinstance(body, bytes):
        raw = body
        shown = repr(body) if len(body) <= 200 else f"<{len(body)} bytes: {body[:40]!r}...>"
    else:
        raw, shown = to_json(body).encode(), to_json(body, abbreviate=True)
    return Case(method, template, path_id, auth, content_type, request_id, raw, shown)


@st.composite
def cases(draw) -> Case:
    route = draw(st.sampled_from(ROUTES))
    _, _, body_s, ids = route
    if body_s is None:
        body = draw(st.sampled_from([None, None, None, b"{}", b'{"x": 1}']))
    elif draw(st.integers(0, 9)) == 9:
        body = draw(HOSTILE_BODIES)
    else:
        body = draw(body_s)
    path_id = draw(st.sampled_from(ids)) if ids else None
    auth = draw(st.sampled_from(AUTHS))
    content_type = draw(st.sampled_from(["application/json"] * 8 + [None, "text/plain"]))
    request_id = draw(st.sampled_from([None] * 8 + ["mine", "\xff\xfe", "a" * 3000]))
    return _case(route, body, path_id, auth, content_type, request_id)


def explicit_cases() -> list[Case]:
    """Known hostile requests, run before the generated ones in every fuzz (hypothesis @example)."""
    by_route = {r[1]: r for r in ROUTES}
    one = {"prompt": "a", "max_tokens": 2}
    chat = {"messages": [{"role": "user", "content": "a"}], "max_tokens": 2}
    specs = [
        ("/v1/completions", None, {**one, "top_k": 2**63}),
        ("/v1/completions", None, {**one, "top_k": 2**63, "stream": True}),
        ("/v1/completions", None, {**one, "seed": 2**64}),
        ("/v1/completions", None, {**one, "seed": -1}),
        ("/v1/completions", None, {**one, "max_tokens": DIGITS_5000}),
        ("/v1/completions", None, {**one, "temperature": Raw("NaN")}),
        ("/v1/completions", None, {**one, "top_p": Raw("Infinity")}),
        ("/v1/completions", None, {**one, "logprobs": 2**63}),
        ("/v1/completions", None, {**one, "min_tokens": 2**63}),
        ("/v1/completions", None, {"prompt": [[2**63]], "max_tokens": 2}),
        ("/v1/completions", None, {"prompt": [300], "max_tokens": 2}),
        ("/v1/completions", None, {"prompt": "\ud800", "max_tokens": 2}),
        ("/v1/completions", None, {**one, "stop": ["\ud800"]}),
        ("/v1/completions", None, {**one, "n": 2, "seed": 2**63 - 1}),
        ("/v1/completions", None, {"prompt": deep_list(99_000)}),
        ("/v1/completions", None, ("[" * 100_000).encode()),
        ("/v1/chat/completions", None, {"messages": [{"role": "user", "content": "\ud800"}], "max_tokens": 2}),
        ("/v1/chat/completions", None, {**chat, "top_k": 2**63, "stream": True}),
        ("/v1/chat/completions", None, {**chat, "logprobs": True, "top_logprobs": 2**63}),
        ("/v1/sessions", None, {"system": "\ud800"}),
        ("/v1/sessions", None, {"ttl": 1e308}),
        ("/v1/sessions", None, {"ttl": Raw("Infinity")}),
        ("/v1/sessions/{id}/messages", SESSION, {"role": "user", "content": "\ud800"}),
        ("/v1/sessions/{id}/append", SESSION, {"text": "\ud800"}),
        ("/v1/sessions/{id}/completions", SESSION, {"max_tokens": 2, "top_k": 2**63}),
        ("/v1/sessions/{id}/completions", SESSION, {"max_tokens": 2, "seed": 2**64}),
        ("/v1/sessions/{id}/completions", SESSION, {"max_tokens": 2, "stream": True, "seed": 2**64}),
        ("/v1/sessions/{id}/completions", SESSION, {"max_tokens": 100_000, "stream": True}),  # past the context
    ]
    return [_case(by_route[route], body, path_id, "k1", "application/json", None) for route, path_id, body in specs]


# ----- executing a case and checking the property ------------------------------------------------
def auth_headers(auth: str) -> dict:
    return {
        "k1": {"Authorization": "Bearer k1"},
        "k2": {"Authorization": "Bearer k2"},
        "none": {},
        "wrong": {"Authorization": "Bearer nope"},
        "lower": {"Authorization": "bearer k1"},
        "basic": {"Authorization": "Basic azE6"},
        "bytes": {"Authorization": b"Bearer k1\xff"},
        "empty": {"Authorization": "Bearer"},
    }[auth]


class Reply:
    def __init__(self, status: int, headers: httpx.Headers, text: str) -> None:
        self.status, self.headers, self.text = status, headers, text


def _strict_json(text: str) -> Any:
    def refuse(token: str) -> Any:
        raise ValueError(f"non-standard JSON token {token}")

    return json.loads(text, parse_constant=refuse)


def check_error_body(reply: Reply) -> str | None:
    """None if `reply` (non-2xx) is an OpenAI-shaped JSON error, else what is wrong."""
    ctype = reply.headers.get("content-type", "")
    if not ctype.startswith("application/json"):
        return f"error response has content-type {ctype!r}, not application/json"
    try:
        body = _strict_json(reply.text)
    except ValueError as exc:
        return f"error response is not JSON ({exc})"
    return check_error_object(body)


def check_error_object(body: Any) -> str | None:
    if not isinstance(body, dict) or set(body) != {"error"} or not isinstance(body["error"], dict):
        return "error body is not {'error': {...}}"
    error = body["error"]
    if set(error) != {"message", "type", "param", "code"}:
        return f"error object has keys {sorted(error)}, not message/type/param/code"
    if not isinstance(error["message"], str) or not error["message"]:
        return "error.message is not a non-empty string"
    if not isinstance(error["type"], str) or not error["type"]:
        return "error.type is not a non-empty string"
    if error["param"] is not None and not isinstance(error["param"], str):
        return f"error.param is {type(error['param']).__name__}, not str or null"
    if error["code"] is not None and not isinstance(error["code"], str):
        return f"error.code is {type(error['code']).__name__}, not str or null"
    return None


def check_reply(reply: Reply) -> str | None:
    """None if `reply` has the property, else what is wrong."""
    if reply.status >= 500:
        return f"status {reply.status}"
    if not 200 <= reply.status < 300:
        return check_error_body(reply)
    ctype = reply.headers.get("content-type", "")
    if ctype.startswith("text/event-stream"):
        data = [line[6:] for line in reply.text.split("\n") if line.startswith("data: ")]
        if not data or data[-1] != "[DONE]":
            return "stream does not end with 'data: [DONE]'"
        has_output = False
        for payload in data[:-1]:
            try:
                event = _strict_json(payload)
            except ValueError as exc:
                return f"stream event is not JSON ({exc}): {payload[:120]}"
            if isinstance(event, dict) and "error" in event:
                problem = check_error_object(event)
                if problem:
                    return f"stream error event: {problem}"
                if event["error"]["type"] == "server_error":
                    return f"stream error event of type server_error: {event['error']['message'][:200]}"
                if not has_output and event["error"]["code"] != "request_timeout":
                    return f"200 and then an error event before any output: {event['error']['message'][:200]}"
            has_output = has_output or _has_output(event)
        return None
    if ctype.startswith("application/json"):
        try:
            _strict_json(reply.text)
        except ValueError as exc:
            return f"2xx body is not strict JSON ({exc})"
        return None
    return f"2xx response with content-type {ctype!r}"


def _has_output(event: Any) -> bool:
    """Whether a stream event carries generated output (text, tokens, a finish), not just the role."""
    if not isinstance(event, dict):
        return False
    for choice in event.get("choices") or []:
        delta = choice.get("delta") or {}
        if choice.get("text") or delta.get("content") or choice.get("finish_reason") or choice.get("logprobs"):
            return True
    return "usage" in event


def body_features(body: bytes | None) -> tuple[str, ...]:
    """The hostile things a raw body carries (to tell apart failures whose response says nothing)."""
    if body is None:
        return ()
    found = []
    checks = {
        "surrogate": re.compile(rb"\\u[dD][89abAB]|\\u[dD][c-fC-F]"),
        "digits>4300": re.compile(rb"\d{4301}"),
        "deep": re.compile(rb"(\[){500}|(\{\"a\":){500}"),
        "nan/inf": re.compile(rb"NaN|Infinity|\d[eE]\d{3}"),
        "int>=2**63": re.compile(rb"(?<![\d.])-?(9223372036854775808|18446744073709551616|\d{20,4300})(?![\d.])"),
        "not-utf8": re.compile(rb"\xff"),
    }
    for name, pattern in checks.items():
        if pattern.search(body[:300_000]):
            found.append(name)
    return tuple(found)


@dataclass
class Failure:
    step: str  # request, or the probe that failed after it
    problem: str
    status: int | None
    response: str
    case: Case

    def key(self) -> tuple:
        """What makes two failures the same bug (for the list of distinct ones)."""
        kind = self.problem.split(":")[0].split("(")[0][:60]
        etype = ""
        try:
            etype = json.loads(self.response)["error"]["type"]
        except Exception:
            etype = self.response[:40]
        return (self.case.route, self.step, self.status, kind, etype, body_features(self.case.body))

    def as_dict(self) -> dict:
        return {
            "step": self.step,
            "problem": self.problem,
            "status": self.status,
            "response": self.response[:1000],
            "request": self.case.summary(),
        }


@dataclass
class Background:
    """Greedy streamed completions run back to back from a thread until `stop`; each must equal
    the solo run `expected`. The loop runs at least once, whatever the speed of the machine."""

    base: str
    prompt: str
    expected: str
    max_tokens: int = 200
    stop: threading.Event = field(default_factory=threading.Event)
    response_id: str = "cmpl-none"
    runs: int = 0
    problems: list[str] = field(default_factory=list)

    def body(self) -> dict:
        return {
            "model": MODEL,
            "prompt": self.prompt,
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }

    def run(self) -> None:
        with httpx.Client(timeout=300) as client:
            while True:
                try:
                    self._once(client)
                except Exception as exc:  # recorded, the main thread asserts
                    self.problems.append(f"background stream raised {type(exc).__name__}: {exc}")
                self.runs += 1
                if self.stop.is_set():
                    return

    def _once(self, client: httpx.Client) -> None:
        text_parts, lines = [], []
        with client.stream("POST", f"{self.base}/v1/completions", json=self.body(), headers=auth_headers("k1")) as r:
            self.response_id = r.headers.get("x-request-id", self.response_id)
            for line in r.iter_lines():
                lines.append(line)
            status = r.status_code
            reply = Reply(status, r.headers, "\n".join(lines))
        problem = check_reply(reply)
        if problem:
            self.problems.append(f"background stream: {problem}: {reply.text[-500:]}")
            return
        for line in lines:
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if "error" in event:
                    self.problems.append(f"background stream got an error event: {line[:300]}")
                    return
                text_parts.extend(c["text"] for c in event["choices"])
        text = "".join(text_parts)
        if text != self.expected:
            self.problems.append(f"background stream text differs from its solo run: {text!r} != {self.expected!r}")


class Fuzzer:
    """Runs cases against a server at `base`; collects failures and statuses by route."""

    def __init__(self, base: str, background: Background | None = None, timeout: float = 300) -> None:
        self.base = base
        self.background = background
        # A connection per request: a server may close one after an error response, and reusing it
        # would race that close (a transport error that depends on timing, not on the server).
        self.client = httpx.Client(timeout=timeout, limits=httpx.Limits(max_keepalive_connections=0))
        self.failures: list[Failure] = []
        self.statuses: dict[str, Counter] = defaultdict(Counter)
        self.error_params: dict[str, Counter] = defaultdict(Counter)  # route -> the 4xx's error.param
        self.examples = 0
        self.durations: list[tuple[float, Case]] = []  # seconds per case, with its probes

    def slowest(self, n: int = 5) -> str:
        top = sorted(self.durations, key=lambda d: -d[0])[:n]
        return "\n".join(f"{t:6.2f}s {c.method} {c.route} {(c.shown or '')[:160]}" for t, c in top)

    def close(self) -> None:
        self.client.close()

    def _send(self, method: str, path: str, headers: dict, body: bytes | None) -> Reply:
        with self.client.stream(method, f"{self.base}{path}", headers=headers, content=body) as r:
            raw = r.read()
        return Reply(r.status_code, r.headers, raw.decode("utf-8", errors="replace"))

    def _checked(
        self, case: Case, step: str, method: str, path: str, headers: dict, body: bytes | None
    ) -> Reply | None:
        try:
            reply = self._send(method, path, headers, body)
        except httpx.HTTPError as exc:
            self.failures.append(Failure(step, f"transport error {type(exc).__name__}: {exc}", None, "", case))
            return None
        problem = check_reply(reply)
        if problem:
            self.failures.append(Failure(step, problem, reply.status, reply.text[:2000], case))
        return reply

    def execute(self, case: Case) -> None:
        started = time.monotonic()
        try:
            self._execute(case)
        finally:
            self.durations.append((time.monotonic() - started, case))

    def _execute(self, case: Case) -> None:
        self.examples += 1
        k1 = auth_headers("k1")
        session_id = None
        path_id = case.path_id
        if path_id == SESSION:
            setup = b'{"system": "s", "messages": [{"role": "user", "content": "hi"}]}'
            reply = self._checked(case, "setup: create session", "POST", "/v1/sessions", k1, setup)
            if reply is None or reply.status != 200:
                return
            session_id = path_id = json.loads(reply.text)["id"]
        auth = case.auth
        if path_id == BACKGROUND:
            path_id = self.background.response_id if self.background else "cmpl-none"
            if auth in ("k1", "lower"):  # never abort the background stream: another key's DELETE is 404
                auth = "k2"
        headers = dict(auth_headers(auth))
        if case.content_type:
            headers["Content-Type"] = case.content_type
        if case.request_id:
            headers["X-Request-Id"] = case.request_id.encode("latin-1")
        path = case.route.replace("{id}", path_id) if path_id is not None else case.route
        reply = self._checked(case, "request", case.method, path, headers, case.body)
        if reply is not None:
            self.statuses[f"{case.method} {case.route}"][reply.status] += 1
            if 400 <= reply.status < 500:
                try:
                    error = json.loads(reply.text)["error"]
                    why = f"{reply.status} {error['param'] or error['message'][:50]}"
                except Exception:
                    why = f"{reply.status} ?"
                self.error_params[f"{case.method} {case.route}"][why] += 1
            if case.route == "/v1/sessions" and reply.status == 200:
                created = json.loads(reply.text)["id"]
                self._checked(
                    case, "cleanup: delete created session", "DELETE", f"/v1/sessions/{created}", headers, None
                )
        if session_id is not None:  # the session still answers, and is gone after DELETE
            get = self._checked(case, "probe: get session", "GET", f"/v1/sessions/{session_id}", k1, None)
            message = b'{"role": "user", "content": "probe"}'
            self._checked(case, "probe: add message", "POST", f"/v1/sessions/{session_id}/messages", k1, message)
            turn = b'{"max_tokens": 1, "temperature": 0}'
            self._checked(case, "probe: session turn", "POST", f"/v1/sessions/{session_id}/completions", k1, turn)
            gone = self._checked(case, "probe: delete session", "DELETE", f"/v1/sessions/{session_id}", k1, None)
            for step, r in (("probe: get session", get), ("probe: delete session", gone)):
                if r is not None and r.status not in (200, 404):
                    self.failures.append(
                        Failure(step, f"status {r.status} (not 200/404)", r.status, r.text[:2000], case)
                    )
        try:
            health = self.client.get(f"{self.base}/health")
            if health.status_code != 200:
                self.failures.append(
                    Failure("probe: /health", f"status {health.status_code}", health.status_code, health.text, case)
                )
        except httpx.HTTPError as exc:
            self.failures.append(Failure("probe: /health", f"transport error {exc}", None, "", case))

    def distinct_failures(self) -> list[tuple[Failure, int]]:
        """The first failure of each kind, with how many times that kind was seen."""
        first: dict[tuple, Failure] = {}
        counts: Counter = Counter()
        for f in self.failures:
            first.setdefault(f.key(), f)
            counts[f.key()] += 1
        return [(f, counts[k]) for k, f in first.items()]

    def report(self, limit: int = 40) -> str:
        lines = []
        for f, count in self.distinct_failures()[:limit]:
            c = f.case
            lines.append(
                f"- {c.method} {c.route} (id={None if c.path_id is None else c.path_id[:40]!r}, auth={c.auth}) "
                f"[{f.step}] x{count}: {f.problem}\n    body: {(c.shown or '')[:400]}\n"
                f"    response {f.status}: {f.response[:300]!r}"
            )
        return "\n".join(lines)


def solo_text(llm, prompt: str, max_tokens: int) -> str:
    from kvserve.sampling_params import SamplingParams

    return llm.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)).text


def fuzz(
    base: str,
    llm,
    examples: int,
    seed: int | None,
    derandomize: bool,
    background_prompt: str = "The fuzz runs beside me:",
) -> tuple[Fuzzer, Background]:
    """Run `examples` generated cases against `base` with a background greedy stream beside them."""
    from hypothesis import HealthCheck, Phase, example, given, settings
    from hypothesis import seed as hypothesis_seed

    background = Background(base, background_prompt, solo_text(llm, background_prompt, 200))
    thread = threading.Thread(target=background.run, daemon=True)
    thread.start()
    fuzzer = Fuzzer(base, background)
    try:

        @settings(
            max_examples=examples,
            derandomize=derandomize,
            deadline=None,
            database=None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(cases())
        def run(case: Case) -> None:
            fuzzer.execute(case)  # records failures, never raises: one run lists them all

        for case in reversed(explicit_cases()):
            run = example(case)(run)

        if seed is not None and not derandomize:
            run = hypothesis_seed(seed)(run)
        run()
    finally:
        background.stop.set()
        thread.join(600)
        fuzzer.close()
    if thread.is_alive():
        background.problems.append("background stream did not finish")
    return fuzzer, background
