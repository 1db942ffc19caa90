"""OpenAI request shapes (pydantic) and their translation to SamplingParams.

Every field kvserve does not support is refused by name (400), never silently ignored. Types are
strict, as OpenAI's API is: `"max_tokens": "3"`, `true` for an integer, `0` for a boolean, `"0.5"`
for a number, or floats as token ids are a 400 naming the field; an integer where a number is
expected (`"temperature": 1`) is a number.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from kvserve.errors import InvalidRequestError
from kvserve.prompts import joined_text_parts
from kvserve.sampling_params import MAX_LOGPROBS, SamplingParams
from kvserve.structured_output import StructuredOutput
from kvserve.text.tool_calls import OPENAI_NAME, ToolChoice


class UnsupportedFieldError(InvalidRequestError):
    pass


STRICT = ConfigDict(extra="forbid", strict=True)  # strict: no "3" for 3, no 0 for false, no 1.0 for 1


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False
    include_obfuscation: bool = True  # OpenAI pads its stream's events against length analysis; kvserve sends none


class _Base(BaseModel):
    """Fields common to both routes, including kvserve's extra sampling fields."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    # kvserve (and vLLM) extras
    top_k: int | None = None  # left out (None): the model's recommended value, else no limit
    min_p: float | None = None
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False

    response_format: dict[str, Any] | None = None
    logit_bias: dict[str, float] | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        """A top-level null means the field is not set, as in OpenAI's API (`"n": null` is n's default,
        and `"suffix": null` asks for nothing kvserve lacks), so clients that send every field work; so
        does an OpenAI field's value that asks for nothing (`"store": false`, `"best_of": 1`)."""
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if v is not None and not _asks_nothing(k, v)}

    def check_supported(self) -> None:
        """Refuse, by name, every field kvserve does not implement (raises UnsupportedFieldError)."""
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed with stream: true.", "stream_options")
        kind = self.response_format.get("type") if self.response_format is not None else "text"
        if kind not in ("text", "json_object", "json_schema"):
            raise UnsupportedFieldError(
                f"response_format {kind!r:.80} is not supported; send 'text', 'json_object' or 'json_schema'.",
                "response_format.type",
            )
        extra = sorted((self.model_extra or {}).keys())
        if extra:
            raise UnsupportedFieldError(
                f"Unsupported field(s): {', '.join(extra)}. kvserve does not implement "
                f"{'it' if len(extra) == 1 else 'them'} yet; remove {'it' if len(extra) == 1 else 'them'} "
                "from the request.",
                extra[0],
            )

    def num_requests(self) -> int:
        """The engine requests this body creates (what admission counts)."""
        return self.n

    def sent_names(self) -> dict[str, str]:
        """The engine's names for fields this body sent under another name (see `as_sent`)."""
        return {}

    def as_sent(self, error: InvalidRequestError) -> InvalidRequestError:
        """`error` naming the fields as this body sent them: a chat body's max_completion_tokens is the
        engine's max_tokens."""
        names = self.sent_names()
        if error.param not in _LENGTH_PARAMS or not names:  # others may quote the client's text (a tool's name)
            return error
        message = str(error)
        for engine_name, name in names.items():
            message = re.sub(rf"\b{engine_name}\b", name, message)
        param = names.get(error.param, error.param)
        return type(error)(message, param)  # as it is unpickled (InvalidRequestError.__reduce__)

    def structured_output(self) -> StructuredOutput | None:
        """The grammar response_format asks for (400 for a schema the grammar engine refuses)."""
        format_ = self.response_format or {"type": "text"}
        _refuse_unknown(
            format_, {"type", "json_schema"} if format_["type"] == "json_schema" else {"type"}, "response_format"
        )
        if format_["type"] == "json_object":
            return StructuredOutput.json_object()
        if format_["type"] != "json_schema":
            return None
        spec = format_.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise InvalidRequestError(
                'response_format.json_schema must be {"name": ..., "schema": {...}, "strict": true}.',
                "response_format.json_schema",
            )
        _refuse_unknown(spec, {"name", "schema", "strict", "description"}, "response_format.json_schema")
        if not OPENAI_NAME.match(spec["name"]):
            raise InvalidRequestError(
                "response_format.json_schema.name must be 1-64 letters, digits, underscores or dashes.",
                "response_format.json_schema.name",
            )
        if "strict" in spec and not isinstance(spec["strict"], bool | None):
            raise InvalidRequestError(
                "response_format.json_schema.strict must be true or false.", "response_format.json_schema.strict"
            )
        # strict or not, the output follows the schema, its objects closed (kvserve/json_schemas.py)
        return StructuredOutput.json_schema(spec.get("schema", True), "response_format.json_schema.schema")

    def token_bias(self) -> dict[int, float]:
        """logit_bias with its keys (token ids written as strings, as OpenAI takes them) as integers."""
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            if not key.isascii() or not key.isdigit() or len(key) > 10:
                raise InvalidRequestError(f"logit_bias keys must be token ids, got {key!r:.80}.", "logit_bias")
            bias[int(key)] = value
        return bias

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, default_max_tokens: int, defaults: dict[str, float]
    ) -> SamplingParams:
        """The request's values; where it leaves one out, the model's recommended one (`defaults`: its
        file's or model card's, as vLLM takes a model's generation_config.json), else OpenAI's."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        given = {name: getattr(self, name) for name in ("temperature", "top_p", "top_k", "min_p")}
        sampling = {**{"temperature": 1.0, "top_p": 1.0}, **defaults}
        sampling.update({name: value for name, value in given.items() if value is not None})
        return SamplingParams(
            max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
            **sampling,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            stop=tuple(stop),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            logit_bias=self.token_bias(),
            structured_output=self.structured_output(),
        )


_LENGTH_PARAMS = ("max_tokens", "min_tokens")  # the errors `as_sent` renames in: their text is the engine's
# OpenAI fields kvserve does not implement, and the values of each that ask for nothing it lacks
_NOTHING_ASKED: dict[str, tuple[Any, ...]] = {
    "store": (False,),  # OpenAI keeps no copy; neither does kvserve
    "service_tier": ("auto", "default"),
    "modalities": (["text"],),
    "best_of": (1,),
}


def _asks_nothing(field: str, value: Any) -> bool:
    return any(type(value) is type(v) and value == v for v in _NOTHING_ASKED.get(field, ()))


class CompletionRequest(_Base):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_form(cls, value: Any) -> Any:
        """One error naming `prompt` (rather than one per member of the union), and never a bool or
        a float taken as a token id."""
        if isinstance(value, str) or (
            isinstance(value, list)
            and (
                all(isinstance(x, str) for x in value)
                or all(_is_token_id(x) for x in value)
                or all(isinstance(x, list) and all(_is_token_id(t) for t in x) for x in value)
            )
        ):
            return value
        raise PydanticCustomError(
            "prompt_type",
            "prompt must be a string, a list of strings, a list of token ids (integers) or a list of lists of "
            "token ids; got {got}",
            {"got": _describe(value)},
        )

    def num_requests(self) -> int:
        return len(self.prompts()) * self.n

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise InvalidRequestError("prompt is empty; send a string, a list of strings or token ids.", "prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


def _refuse_unknown(fields: dict[str, Any], known: set[str], where: str) -> None:
    """A field this object does not have is refused by name, as the body's own unknown fields are."""
    unknown = sorted(set(fields) - known)
    if unknown:
        raise InvalidRequestError(
            f"{where}.{unknown[0]} is not a field of {where} here; it takes {', '.join(sorted(known))}.",
            f"{where}.{unknown[0]}",
        )


def _is_token_id(value: Any) -> bool:
    return type(value) is int  # not a bool, not a float


def _describe(value: Any) -> str:
    if isinstance(value, list):
        kinds = sorted({type(x).__name__ for x in value})
        return f"a list holding {', '.join(kinds)}"
    return type(value).__name__


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool's result: which call it answers
    # The rest of an assistant message as the API answers it, which clients send back as it is
    # (`message.model_dump()`): a refusal is the assistant's text; citations change nothing.
    refusal: str | None = None
    annotations: list[dict[str, Any]] | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None

    def as_dict(self, index: int) -> dict[str, Any]:
        """The message as the chat template takes it (tool calls and results as text/tool_calls.py reads them)."""
        message: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": self.text(index),
        }
        if self.tool_calls:
            if self.role != "assistant":
                raise InvalidRequestError(
                    f"messages[{index}]: only an assistant message has tool_calls.", f"messages[{index}].tool_calls"
                )
            message["tool_calls"] = self.tool_calls
        if self.role == "tool":
            message["tool_call_id"] = self.tool_call_id
        return message

    def text(self, index: int) -> str:
        for name, why in (
            ("audio", "(a spoken reply) is not supported; send the reply's text as content"),
            ("function_call", "is the deprecated form of a call; send it in tool_calls"),
        ):
            if getattr(self, name) is not None:
                raise UnsupportedFieldError(f"messages[{index}].{name} {why}.", f"messages[{index}].{name}")
        if (self.refusal is not None or self.annotations is not None) and self.role != "assistant":
            field = "refusal" if self.refusal is not None else "annotations"
            raise InvalidRequestError(
                f"messages[{index}].{field}: only an assistant message has one.", f"messages[{index}].{field}"
            )
        if self.content is None:
            return self.refusal or ""
        if isinstance(self.content, str):
            return self.content
        return joined_text_parts(self.content, index)


class ChatCompletionRequest(_Base):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def conversation(self) -> list[dict[str, Any]]:
        return [m.as_dict(i) for i, m in enumerate(self.messages)]

    def tool_choice_spec(self) -> ToolChoice | None:
        """The request's tools and tool_choice, checked; a response_format needs tool_choice none."""
        choice = ToolChoice.from_request(self.tools, self.tool_choice, self.parallel_tool_calls)
        format_ = (self.response_format or {}).get("type", "text")
        if choice is not None and choice.choice != "none" and format_ != "text":
            raise InvalidRequestError(
                f"response_format {format_!r} cannot be combined with tools the model may call; send "
                'tool_choice "none", or leave response_format out (a required tool call is constrained by '
                "the functions' parameter schemas already).",
                "response_format",
            )
        return choice

    def chat_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs=true.", "top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:  # else "logprobs" is named
            raise InvalidRequestError(
                f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got {self.top_logprobs}.", "top_logprobs"
            )
        return (self.top_logprobs or 0) if self.logprobs else None

    def sent_names(self) -> dict[str, str]:
        # max_completion_tokens is the one used when both are sent
        return {"max_tokens": "max_completion_tokens"} if self.max_completion_tokens is not None else {}


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def error_body(message: str, type_: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class SessionCreateRequest(BaseModel):
    model_config = STRICT
    model: str | None = None
    system: str | None = None
    messages: list[ChatMessage] = Field(default_factory=list)
    ttl: float | None = None  # its bounds, 1 s to 30 days, checked (and said) by the session manager

    def conversation(self) -> list[dict[str, str]]:
        for i, m in enumerate(self.messages):
            if m.role == "tool" or m.tool_calls:
                raise UnsupportedFieldError(
                    f"messages[{i}]: a session holds text messages only; tool calls and results are not supported "
                    "in sessions (use /v1/chat/completions with tools).",
                    f"messages[{i}].role",
                )
        return [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text(i)}
            for i, m in enumerate(self.messages)
        ]


class SessionForkRequest(BaseModel):
    """A fork's body, which may be empty: nothing to set but the model's name, checked as elsewhere."""

    model_config = STRICT
    model: str | None = None


class SessionMessageRequest(BaseModel):
    model_config = STRICT
    role: Literal["system", "user", "assistant"]
    content: str


class SessionAppendRequest(BaseModel):
    model_config = STRICT
    text: str


class SessionCompletionRequest(_Base):
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    interrupt: bool = False

    chat_logprobs = ChatCompletionRequest.chat_logprobs
    sent_names = ChatCompletionRequest.sent_names
