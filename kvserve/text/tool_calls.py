"""Tool calls: OpenAI `tools` through the model's chat template, and the model's calls parsed back.

Three formats, chosen from the chat template:

- **hermes** (Qwen2.5, Qwen3, Hermes): the template renders `tools`; a call is
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, several in a row when parallel.
- **llama3** (Llama 3.1-3.3): the template renders `tools`; a call is the whole answer,
  `{"name": ..., "parameters": {...}}`; one call per answer.
- **generic** (a template without tools, like the bundled SmolLM2's): kvserve describes the tools in
  a system message, and the answer is JSON, `{"tool_calls": [{"name": ..., "arguments": {...}}]}`,
  or `{"content": "..."}` when the model may answer instead (`auto`); always constrained.

`tool_choice` `required` or a named function constrains the answer with a grammar made from the
functions' parameter schemas (so the arguments validate); `auto` leaves the hermes and llama3 formats
free (the model decides; its calls are parsed, its arguments are what it wrote); `none` renders no
tools and parses nothing. A parser turns the model's text, as it arrives, into content deltas and
tool-call deltas (the call's id and name first, then pieces of its arguments' JSON text), so a
streamed answer and a whole one are made by the same code.
"""

from __future__ import annotations

import enum
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvserve.errors import InvalidRequestError
from kvserve.json_schemas import MAX_DEPTH, closed, depth, has_ref, is_reference, rebased
from kvserve.structured_output import JSON_OPTIONS, StructuredOutput
from kvserve.text.chat_template import ChatTemplateError
from kvserve.text.tokenizer import Tokenizer

MAX_TOOLS = 128  # OpenAI's limit
# OpenAI's rule for a function's or a response format's name; used with match: \Z, as $ also matches
# before a last newline
OPENAI_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}\Z")
HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
_FIRST_KEY = re.compile(r'\s*(?:<\|python_tag\|>)?\s*\{\s*(?:"([^"]*)("?))?')  # an object's first key, closed or not
_CALL_KEYS = ("name", "parameters", "arguments")


class ToolFormat(enum.StrEnum):
    HERMES = "hermes"
    LLAMA3 = "llama3"
    GENERIC = "generic"


def detect_format(tokenizer: Tokenizer) -> ToolFormat:
    """The tool-call format the model's chat template speaks (generic when it renders no tools)."""
    template = tokenizer.chat_template
    source = template.source if template is not None else ""
    if "tools" not in source:
        return ToolFormat.GENERIC
    if HERMES_START in source:
        return ToolFormat.HERMES
    if "<|start_header_id|>" in source:
        return ToolFormat.LLAMA3
    return ToolFormat.GENERIC  # a template of another format: kvserve describes the tools itself


# ----- the request's side -------------------------------------------------------------------------
@dataclass(frozen=True)
class Function:
    name: str
    description: str | None
    parameters: dict[str, Any]


@dataclass
class ToolChoice:
    """A request's tools and how it may use them, checked (InvalidRequestError names the field)."""

    functions: list[Function]
    tools: list[dict[str, Any]]  # as sent (what the template renders, as transformers passes it)
    choice: str  # "none", "auto", "required", or "function" (the one in `functions` when named)
    parallel: bool

    @classmethod
    def from_request(cls, tools: list[Any] | None, tool_choice: Any, parallel: bool | None) -> ToolChoice | None:
        """None when the request has no tools (and then tool_choice may only be absent or "none")."""
        if tools is not None and not tools:
            raise InvalidRequestError("tools is empty; send at least one function, or leave tools out.", "tools")
        if not tools:
            if tool_choice not in (None, "none"):
                raise InvalidRequestError("tool_choice needs tools; send the functions in `tools`.", "tool_choice")
            if tools is not None and not isinstance(tools, list):
                raise InvalidRequestError("tools must be a list of functions.", "tools")
            return None
        if not isinstance(tools, list):
            raise InvalidRequestError("tools must be a list of functions.", "tools")
        if len(tools) > MAX_TOOLS:
            raise InvalidRequestError(f"tools has {len(tools)} functions; at most {MAX_TOOLS} are accepted.", "tools")
        functions = [_function(tool, i) for i, tool in enumerate(tools)]
        names = [f.name for f in functions]
        duplicate = next((n for n in names if names.count(n) > 1), None)
        if duplicate is not None:
            raise InvalidRequestError(f"tools names the function {duplicate!r} twice; names must differ.", "tools")
        choice = "auto" if tool_choice is None else tool_choice
        if isinstance(choice, dict):
            function = choice.get("function")
            name = function.get("name") if isinstance(function, dict) else None
            if choice.get("type") != "function" or not isinstance(name, str):
                raise InvalidRequestError(
                    'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}.',
                    "tool_choice",
                )
            _known_keys(choice, ("type", "function"), "tool_choice")
            _known_keys(function, ("name",), "tool_choice.function")
            if name not in names:
                raise InvalidRequestError(
                    f"tool_choice names the function {name!r}, which is not in tools ({', '.join(names)}).",
                    "tool_choice",
                )
            functions = [f for f in functions if f.name == name]
            choice, parallel = "function", False
        elif choice not in ("none", "auto", "required"):
            raise InvalidRequestError(
                f'tool_choice must be "none", "auto", "required" or a named function, got {choice!r:.80}.',
                "tool_choice",
            )
        if parallel is not None and not isinstance(parallel, bool):
            raise InvalidRequestError("parallel_tool_calls must be true or false.", "parallel_tool_calls")
        return cls(functions, list(tools), choice, True if parallel is None else parallel)

    @property
    def is_constrained(self) -> bool:
        return self.choice in ("required", "function")


def _known_keys(value: dict[str, Any], known: tuple[str, ...], where: str) -> None:
    """A misspelt key (`paramters`) was ignored, and the function called without the arguments it
    meant; refused, as OpenAI refuses it and as response_format's unknown keys are."""
    unknown = next((key for key in value if key not in known), None)
    if unknown is not None:
        raise InvalidRequestError(
            f"{where} has the key {unknown!r:.80}, which is not one of {', '.join(known)}; check its spelling.",
            f"{where}.{unknown:.80}",
        )


def _function(tool: Any, index: int) -> Function:
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise InvalidRequestError(f'{where} must be {{"type": "function", "function": {{...}}}}.', where)
    _known_keys(tool, ("type", "function"), where)
    spec = tool["function"]
    _known_keys(spec, ("name", "description", "parameters", "strict"), f"{where}.function")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise InvalidRequestError(f"{where}.function.strict must be true or false.", f"{where}.function.strict")
    name = spec.get("name")
    if not isinstance(name, str) or not OPENAI_NAME.match(name):
        raise InvalidRequestError(
            f"{where}.function.name must be 1-64 letters, digits, underscores or dashes, got {name!r:.80}.",
            f"{where}.function.name",
        )
    description = spec.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidRequestError(f"{where}.function.description must be a string.", f"{where}.function.description")
    parameters = spec.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}, "additionalProperties": False}
    where = f"{where}.function.parameters"
    if not isinstance(parameters, dict):
        raise InvalidRequestError(f"{where} must be a JSON schema object.", where)
    if parameters.get("type", "object") != "object":
        raise InvalidRequestError(f"{where} must describe an object (type 'object').", where)
    StructuredOutput.json_schema(_arguments(parameters), param=where)  # refuses what the grammar cannot take
    return Function(name, description, parameters)


# ----- rendering --------------------------------------------------------------------------------
def conversation(messages: list[dict[str, Any]], fmt: ToolFormat, tokenizer: Tokenizer) -> list[dict[str, Any]]:
    """OpenAI messages as the template takes them: assistant tool calls with their arguments as
    objects (as transformers' templates expect), tool results as `tool` messages with their
    tool_call_id; for the generic format, calls as the JSON the model writes and results as `tool`
    messages where the template renders them, else as user messages."""
    names: dict[str, str] = {}
    out = []
    for i, message in enumerate(messages):
        calls = message.get("tool_calls")
        if message["role"] == "assistant" and calls:
            parsed = [_parse_call(call, f"messages[{i}].tool_calls[{j}]") for j, call in enumerate(calls)]
            for call in parsed:
                names[call["id"]] = call["function"]["name"]
            if fmt is ToolFormat.GENERIC:
                text = json.dumps(
                    {
                        "tool_calls": [
                            {"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in parsed
                        ]
                    },
                    ensure_ascii=False,
                )
                out.append({"role": "assistant", "content": text})
            else:
                out.append({"role": "assistant", "content": message.get("content") or None, "tool_calls": parsed})
        elif message["role"] == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str):
                raise InvalidRequestError(
                    f"messages[{i}] (a tool result) needs its tool_call_id.", f"messages[{i}].tool_call_id"
                )
            if call_id not in names:  # as OpenAI: a result answers a call an earlier assistant message made
                raise InvalidRequestError(
                    f"messages[{i}] is a tool result for {call_id!r:.80}, which no earlier assistant message's "
                    "tool_calls has: send the assistant message with that call before its result.",
                    f"messages[{i}].tool_call_id",
                )
            if fmt is ToolFormat.GENERIC:
                result = {"tool_call_id": call_id, "name": names.get(call_id), "content": message["content"]}
                if _renders_tool_role(tokenizer):
                    out.append({"role": "tool", "content": json.dumps(result, ensure_ascii=False)})
                else:
                    out.append({"role": "user", "content": json.dumps({"tool_result": result}, ensure_ascii=False)})
            else:
                out.append(
                    {"role": "tool", "content": message["content"], "tool_call_id": call_id, "name": names.get(call_id)}
                )
        else:
            out.append({"role": message["role"], "content": message["content"]})
    return out


def _too_deep(where: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"{where}.function.arguments nests objects and arrays more than {MAX_DEPTH} levels deep; flatten them.",
        f"{where}.function.arguments",
    )


def _parse_call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidRequestError(
            f'{where} must be {{"id", "type": "function", "function": {{"name", "arguments"}}}}.', where
        )
    arguments = function.get("arguments", "{}")
    if arguments == "":  # some clients send it for a call without arguments
        arguments = "{}"
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            arguments = None
        except RecursionError:  # deeper than Python's stack (it was a 500)
            raise _too_deep(where) from None
    if isinstance(arguments, dict) and depth(arguments) > MAX_DEPTH:  # the chat template's rendering recurses
        raise _too_deep(where)
    if not isinstance(arguments, dict):  # a function's arguments are an object, as its parameters say
        raise InvalidRequestError(
            f'{where}.function.arguments must be a JSON object\'s text, such as \'{{"city": "Paris"}}\'.',
            f"{where}.function.arguments",
        )
    return {
        "id": str(call.get("id") or ""),
        "type": "function",
        "function": {"name": function["name"], "arguments": arguments},
    }


def _renders_tool_role(tokenizer: Tokenizer) -> bool:
    """Whether the chat template renders a `tool` message (SmolLM2's renders any role)."""
    probe = "kvserve-probe-7f3a"
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "x"}, {"role": "tool", "content": probe}])
    except ChatTemplateError:
        return False
    return probe in text


def generic_instructions(choice: ToolChoice) -> str:
    """The system text that describes the tools to a model whose template cannot."""
    functions = [
        {"name": f.name, **({"description": f.description} if f.description else {}), "parameters": f.parameters}
        for f in choice.functions
    ]
    call = '{"tool_calls": [{"name": "<function name>", "arguments": {<its arguments>}}]}'
    lines = [
        "You can call these functions (their parameters as JSON schemas):",
        json.dumps(functions, ensure_ascii=False),
    ]
    if choice.choice == "auto":
        lines.append(
            f'Answer with JSON only: to call functions, {call}; to answer directly, {{"content": "<your answer>"}}.'
        )
    else:
        lines.append(f"Answer with JSON only, calling {'a function' if len(functions) == 1 else 'functions'}: {call}.")
    return "\n".join(lines)


def render_inputs(
    messages: list[dict[str, Any]], choice: ToolChoice | None, fmt: ToolFormat, tokenizer: Tokenizer
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, template variables) for the chat template: `tools` where the template renders them."""
    converted = conversation(messages, fmt, tokenizer)
    if choice is None or choice.choice == "none":
        return converted, {}
    if fmt is not ToolFormat.GENERIC:
        return converted, {"tools": choice.tools}
    text = generic_instructions(choice)
    if converted and converted[0]["role"] == "system":
        converted[0] = {"role": "system", "content": f"{converted[0]['content']}\n\n{text}"}
    else:
        converted.insert(0, {"role": "system", "content": text})
    return converted, {}


# ----- grammars ---------------------------------------------------------------------------------
def _call_schema(function: Function, arguments_key: str, defs: dict[str, Any]) -> dict[str, Any]:
    """A call of `function`. Parameters with references (`$ref`, as pydantic writes nested models)
    go into `defs`, the root's `$defs`, rebased there, so that what they point to is found."""
    parameters = _arguments(function.parameters)
    if has_ref(parameters):
        defs[function.name] = rebased(parameters, f"/$defs/{function.name}")
        parameters = {"$ref": f"#/$defs/{function.name}"}
    return {
        "type": "object",
        "properties": {"name": {"const": function.name}, arguments_key: parameters},
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }


def _arguments(parameters: dict[str, Any]) -> dict[str, Any]:
    """What a call's arguments must be: an object even where the schema does not say so (`{}`
    included). Its keys are closed with the whole grammar's schema, as a response_format schema's are
    (StructuredOutput.json_schema; the hermes format's, embedded in Lark, here). A schema that is only
    a `$ref` (pydantic's for a model with a recursive part) is its definition: a type beside the
    reference made that definition a part of an object, left open to other keys."""
    return parameters if is_reference(parameters) else {"type": "object", **parameters}


def _calls(choice: ToolChoice, arguments_key: str, defs: dict[str, Any]) -> dict[str, Any]:
    """A call of any of the choice's functions."""
    schemas = [_call_schema(f, arguments_key, defs) for f in choice.functions]
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def _with_defs(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "$defs": defs} if defs else schema


def grammar(choice: ToolChoice | None, fmt: ToolFormat, tokenizer: Tokenizer) -> StructuredOutput | None:
    """The grammar the answer must follow: for `required` and a named function (every format), and
    for `auto` in the generic format; None where the model answers freely."""
    if choice is None or choice.choice == "none" or (choice.choice == "auto" and fmt is not ToolFormat.GENERIC):
        return None
    param, defs = "tools", {}
    if fmt is ToolFormat.HERMES:
        call = json.dumps({**closed(_with_defs(_calls(choice, "arguments", defs), defs)), "x-guidance": JSON_OPTIONS})
        start, end = (_lark_literal(tokenizer, HERMES_START), _lark_literal(tokenizer, HERMES_END))
        repeat = ' ("\\n" call)*' if choice.parallel else ""
        lark = f'start: call{repeat}\ncall: {start} "\\n" body "\\n" {end}\nbody: %json {call}\n'
        return StructuredOutput.lark(lark, param=param, kind="tool_calls")
    if fmt is ToolFormat.LLAMA3:
        return StructuredOutput.json_schema(_with_defs(_calls(choice, "parameters", defs), defs), param, "tool_calls")
    calls = {
        "type": "array",
        "items": _calls(choice, "arguments", defs),
        "minItems": 1,
        **({} if choice.parallel else {"maxItems": 1}),
    }
    schema = {
        "type": "object",
        "properties": {"tool_calls": calls},
        "required": ["tool_calls"],
        "additionalProperties": False,
    }
    if choice.choice == "auto":
        content = {
            "type": "object",
            "properties": {"content": {"type": "string"}},
            "required": ["content"],
            "additionalProperties": False,
        }
        schema = {"anyOf": [schema, content]}
    return StructuredOutput.json_schema(_with_defs(schema, defs), param, "tool_calls")


def _added_token(tokenizer: Tokenizer, text: str):
    token_id = tokenizer.token_to_id(text)
    return tokenizer.backend.get_added_tokens_decoder().get(token_id) if token_id is not None else None


def _lark_literal(tokenizer: Tokenizer, text: str) -> str:
    """`text` in a Lark grammar: the token by id where the tokenizer has it as an added token (as
    Qwen has <tool_call>: the model writes that one token, and the grammar engine sees added tokens
    apart from the bytes of their text), else a string."""
    return f"<[{tokenizer.token_to_id(text)}]>" if _added_token(tokenizer, text) is not None else json.dumps(text)


def needs_special_tokens(fmt: ToolFormat, tokenizer: Tokenizer) -> bool:
    """Whether the call markers are special tokens, which the text must then keep."""
    token = _added_token(tokenizer, HERMES_START) if fmt is ToolFormat.HERMES else None
    return token is not None and token.special


# ----- parsing ----------------------------------------------------------------------------------
@dataclass
class Delta:
    """A piece of an answer: content text, or a tool call's start (index, id, name) or a piece of its
    arguments' JSON text."""

    content: str | None = None
    index: int | None = None
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedAnswer:
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class _JsonScanner:
    """Follows JSON text as it arrives. Reports ("chars", path, text) for the characters of each
    member's value (path: the keys and indices from the root; a container's brackets belong to the
    member it is the value of) and ("end", path) when that value is complete. Keys, colons, commas
    and whitespace between members are reported as nothing. `done` once the root value is complete;
    `feed` returns how many characters it took (none after the root's end)."""

    def __init__(self) -> None:
        # [bracket, key or index, state]; state: key, colon, value, first (an array's, or its "]"), next
        self.frames: list[list[Any]] = []
        self.in_string = self.escape = self.string_is_key = self.in_scalar = False
        self.key = ""
        self.started = self.done = False

    def path(self) -> tuple:
        return tuple(frame[1] for frame in self.frames)

    def feed(self, text: str, events: list) -> int:
        for taken, char in enumerate(text):
            if self.done:
                return taken
            self._char(char, events)
        return len(text)

    @staticmethod
    def _chars(events: list, path: tuple, char: str) -> None:
        if events and events[-1][0] == "chars" and events[-1][1] == path:
            events[-1] = ("chars", path, events[-1][2] + char)
        else:
            events.append(("chars", path, char))

    def _value_ended(self, events: list) -> None:
        events.append(("end", self.path()))
        if self.frames:
            self.frames[-1][2] = "next"
        else:
            self.done = True

    def _char(self, char: str, events: list) -> None:
        if self.in_string:
            self._string_char(char, events)
            return
        if self.in_scalar:
            if char not in ",}]" and not char.isspace():
                self._chars(events, self.path(), char)
                return
            self.in_scalar = False
            self._value_ended(events)
            if self.done:
                return
        state = self.frames[-1][2] if self.frames else ("done" if self.started else "value")
        container = self.path()[:-1]  # the member whose value is the innermost container
        if char.isspace():
            if self.frames:
                self._chars(events, container, char)
            return
        if state == "first" and char == "]":
            self._close(events, char)
        elif state in ("value", "first"):
            self.started = True
            self._chars(events, self.path(), char)
            if char == "{":
                self.frames.append(["{", None, "key"])
            elif char == "[":
                self.frames.append(["[", 0, "first"])
            elif char == '"':
                self.in_string, self.string_is_key = True, False
            else:
                self.in_scalar = True
        elif state == "key" and char == '"':
            self._chars(events, container, char)
            self.in_string, self.string_is_key, self.key = True, True, ""
        elif state == "key" and char == "}":
            self._close(events, char)
        elif state == "colon" and char == ":":
            self._chars(events, container, char)
            self.frames[-1][2] = "value"
        elif state == "next" and char == ",":
            self._chars(events, container, char)
            frame = self.frames[-1]
            if frame[0] == "[":
                frame[1], frame[2] = frame[1] + 1, "value"
            else:
                frame[2] = "key"
        elif state == "next" and char in "}]":
            self._close(events, char)

    def _string_char(self, char: str, events: list) -> None:
        closing = char == '"' and not self.escape
        self.escape = not self.escape and char == "\\"
        if self.string_is_key:
            self._chars(events, self.path()[:-1], char)
            if closing:
                self.in_string = False
                try:
                    key = json.loads(f'"{self.key}"')
                except ValueError:
                    key = self.key
                self.frames[-1][1], self.frames[-1][2] = key, "colon"
            else:
                self.key += char
            return
        self._chars(events, self.path(), char)
        if closing:
            self.in_string = False
            self._value_ended(events)

    def _close(self, events: list, char: str) -> None:
        self.frames.pop()
        self._chars(events, self.path(), char)
        self._value_ended(events)


class _StringDecoder:
    """Decodes a JSON string value as its raw text (from its opening quote) arrives, never cutting
    an escape or a surrogate pair."""

    def __init__(self) -> None:
        self.body: str | None = None  # the raw text after the opening quote
        self.num_decoded = 0

    def add(self, raw: str) -> str:
        self.body = raw[1:] if self.body is None else self.body + raw
        end, i = self.num_decoded, self.num_decoded
        while i < len(self.body):
            char = self.body[i]
            if char == '"':
                break
            if char != "\\":
                i += 1
                end = i
                continue
            size = 6 if self.body[i + 1 : i + 2] == "u" else 2
            if i + size > len(self.body):
                break
            if size == 6 and 0xD800 <= int(self.body[i + 2 : i + 6], 16) <= 0xDBFF:
                size = 12  # the high half of a surrogate pair: decoded with its low half
                if i + size > len(self.body):
                    break
            i += size
            end = i
        if end == self.num_decoded:
            return ""
        try:
            text = json.loads(f'"{self.body[self.num_decoded : end]}"')
        except ValueError:
            return ""
        self.num_decoded = end
        return text


class _Calls:
    """Tool-call deltas from JSON scanner events: `locate(path)` says which call a value belongs to
    (any key) and which field it is ("name" or "arguments"), or None. A call's id and name go out
    once its name is complete; its arguments' text as it arrives after that (held until then)."""

    def __init__(self, locate: Callable[[tuple], tuple[Any, str] | None]) -> None:
        self.locate = locate
        self.calls: dict[Any, dict[str, Any]] = {}
        self.num_started = 0

    def events(self, events: list, out: list[Delta]) -> list:
        """Handle the events that belong to calls; return the others."""
        rest = []
        for event in events:
            located = self.locate(event[1])
            if located is None:
                rest.append(event)
                continue
            key, what = located
            call = self.calls.setdefault(
                key, {"name_raw": "", "index": None, "arguments": "", "sent": 0, "ended": False}
            )
            if what == "name" and event[0] == "chars":
                call["name_raw"] += event[2]
            elif what == "name" and call["index"] is None:
                self._named(call)
            elif what == "arguments" and event[0] == "chars":
                call["arguments"] += event[2]
            elif what == "arguments" and event[1] == self._arguments_path(event[1]):
                call["ended"] = True
            self._send(call, out)
        return rest

    @staticmethod
    def _arguments_path(path: tuple) -> tuple:
        """The path of the arguments' value itself (its end, not the end of a value inside it)."""
        for i, part in enumerate(path):
            if part in ("arguments", "parameters"):
                return path[: i + 1]
        return path

    def _named(self, call: dict) -> None:
        try:
            name = json.loads(call["name_raw"])
        except ValueError:
            return
        if isinstance(name, str):
            call["name"], call["index"], call["id"] = name, self.num_started, new_call_id()
            self.num_started += 1
            call["announce"] = True

    def _send(self, call: dict, out: list[Delta]) -> None:
        if call["index"] is None:
            return
        if call.pop("announce", False):
            out.append(Delta(index=call["index"], id=call["id"], name=call["name"], arguments=""))
        text = call["arguments"]
        if text.startswith('"'):  # arguments written as a JSON string that holds JSON: sent decoded, once whole
            if call["ended"] and not call["sent"]:
                call["sent"] = len(text)
                decoded = json.loads(text) if _is_json(text) else text
                if decoded:
                    out.append(Delta(index=call["index"], arguments=str(decoded)))
            return
        if len(text) > call["sent"]:
            out.append(Delta(index=call["index"], arguments=text[call["sent"] :]))
            call["sent"] = len(text)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


class ToolCallParser:
    """Turns a model's answer, fed as it arrives, into Deltas. `finish()` at the end."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self.buffer = ""
        self.state = "content" if fmt is ToolFormat.HERMES else "start"
        self.held_space = ""  # whitespace not sent yet: sent only before more content
        self.has_content = False
        self.scanner: _JsonScanner | None = None
        self.raw = ""  # llama3/generic: everything, for when it is not a call after all
        self.content_decoder: _StringDecoder | None = None
        self.calls = _Calls(self._locate)
        self.block = 0  # hermes: which <tool_call> block the scanner reads

    @property
    def num_calls(self) -> int:
        return self.calls.num_started

    def _locate(self, path: tuple) -> tuple[Any, str] | None:
        if self.fmt is ToolFormat.GENERIC:
            if (
                len(path) >= 3
                and path[0] == "tool_calls"
                and isinstance(path[1], int)
                and path[2] in ("name", "arguments")
            ):
                return path[1], path[2]
            return None
        if path == ("name",):
            return self.block, "name"
        if path and path[0] in ("arguments", "parameters"):
            return self.block, "arguments"
        return None

    def feed(self, text: str) -> list[Delta]:
        out: list[Delta] = []
        self.buffer += text
        if self.fmt is ToolFormat.HERMES:
            self._hermes(out)
        else:
            self._json_answer(out)
        return _merged(out)

    def finish(self) -> list[Delta]:
        out: list[Delta] = []
        if self.fmt is ToolFormat.HERMES:
            if self.state == "content":
                self._content(self.buffer, out)
            self.buffer = ""
        elif self.state == "start" and self.buffer.strip():
            self._content(self.buffer, out)
        elif self.state == "json" and self.num_calls == 0 and self.content_decoder is None and not self._cut_call():
            self._content(self.raw, out)  # JSON that held no call: the model's answer as written
        return out

    def _cut_call(self) -> bool:
        """Whether the JSON, unfinished, is a call whose name was cut (at max_tokens), never content:
        kvserve's generic wrapper always is; in Llama 3's format, JSON whose first key is a call's (or,
        cut within it, begins one). Other JSON, whole or not, is the model's answer."""
        if self.scanner.done:
            return False
        if self.fmt is ToolFormat.GENERIC:
            return True
        first = _FIRST_KEY.match(self.raw)
        if first is None:
            return False
        key, closed = first.group(1) or "", first.group(2)
        return key in _CALL_KEYS if closed else any(k.startswith(key) for k in _CALL_KEYS)

    def _content(self, text: str, out: list[Delta]) -> None:
        if not text:
            return
        stripped = text.rstrip()
        if not stripped.strip():
            if self.has_content:
                self.held_space += text
            return
        if not self.has_content:
            stripped = stripped.lstrip()
        out.append(Delta(content=self.held_space + stripped))
        self.has_content = True
        self.held_space = text[len(text.rstrip()) :]

    # hermes: content around <tool_call>...</tool_call> blocks
    def _hermes(self, out: list[Delta]) -> None:
        while True:
            if self.state == "content":
                at = self.buffer.find(HERMES_START)
                if at >= 0:
                    self._content(self.buffer[:at], out)
                    self.buffer = self.buffer[at + len(HERMES_START) :]
                    self.state, self.scanner = "call", _JsonScanner()
                    continue
                keep = _partial_suffix(self.buffer, HERMES_START)
                self._content(self.buffer[: len(self.buffer) - keep], out)
                self.buffer = self.buffer[len(self.buffer) - keep :]
                return
            if self.state == "call":
                events: list = []
                taken = self.scanner.feed(self.buffer, events)
                self.calls.events(events, out)
                self.buffer = self.buffer[taken:]
                if not self.scanner.done:
                    return
                self.block += 1
                self.state = "after"
                continue
            at = self.buffer.find(HERMES_END)
            if at < 0:
                keep = _partial_suffix(self.buffer, HERMES_END)
                self.buffer = self.buffer[len(self.buffer) - keep :]
                return
            self.buffer = self.buffer[at + len(HERMES_END) :]
            self.state = "content"

    # llama3 and generic: the whole answer is one JSON object (else it is content)
    def _json_answer(self, out: list[Delta]) -> None:
        if self.state == "start":
            text = self.buffer.lstrip()
            if text.startswith("<|python_tag|>"):
                text = text[len("<|python_tag|>") :].lstrip()
            if not text or "<|python_tag|>".startswith(text):
                return
            if not text.startswith("{"):
                self.state = "content"
                self._content(self.buffer, out)
                self.buffer = ""
                return
            self.state, self.scanner, self.buffer = "json", _JsonScanner(), text
        if self.state == "content":
            self._content(self.buffer, out)
            self.buffer = ""
            return
        if self.scanner.done:
            self.buffer = ""
            return
        events: list = []
        self.raw += self.buffer
        self.scanner.feed(self.buffer, events)
        self.buffer = ""
        rest = self.calls.events(events, out)
        if self.fmt is ToolFormat.GENERIC:
            for event in rest:
                if event[1] == ("content",) and event[0] == "chars":
                    self.content_decoder = self.content_decoder or _StringDecoder()
                    self._content(self.content_decoder.add(event[2]), out)


def _merged(deltas: list[Delta]) -> list[Delta]:
    """Adjacent pieces of one kind (content, or one call's arguments) as one Delta."""
    out: list[Delta] = []
    for d in deltas:
        last = out[-1] if out else None
        if last is not None and d.content is not None and last.content is not None:
            last.content += d.content
        elif (
            last is not None and d.id is None and d.arguments is not None and last.index == d.index and last.id is None
        ):
            last.arguments += d.arguments
        else:
            out.append(d)
    return out


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` (held back until it is decided)."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


def parse(text: str, fmt: ToolFormat) -> ParsedAnswer:
    """A whole answer: its content (None if only calls) and its tool calls."""
    return assemble([*(parser := ToolCallParser(fmt)).feed(text), *parser.finish()])


def assemble(deltas: list[Delta]) -> ParsedAnswer:
    content = "".join(d.content for d in deltas if d.content)
    calls: dict[int, ToolCall] = {}
    for d in deltas:
        if d.index is None:
            continue
        if d.id is not None:
            calls[d.index] = ToolCall(d.id, d.name or "", "")
        if d.arguments:
            calls[d.index].arguments += d.arguments
    return ParsedAnswer(content or None, [calls[i] for i in sorted(calls)])
