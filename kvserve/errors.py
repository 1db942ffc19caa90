"""Typed errors a user can cause. Each message says what to do about it."""

import functools
import os
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class KVServeError(Exception):
    """Base class of every error kvserve raises on purpose."""


class ModelNotFoundError(KVServeError):
    """The model argument is neither a registered name, a .gguf file nor a Hugging Face folder."""


class ModelFetchError(KVServeError):
    """Fetching a registered model failed or produced a file that does not check out."""


class UnsupportedModelError(KVServeError):
    """The model file describes an architecture or layout kvserve cannot run, or is damaged."""


class UnsupportedTensorTypeError(UnsupportedModelError):
    """A tensor is stored in a quantization type kvserve cannot dequantize."""


class InvalidRequestError(KVServeError, ValueError):
    """A request or one of its parameters is invalid. `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self):  # keeps `param` when the error crosses a process boundary (pickle)
        return (type(self), (str(self), self.param))


class EngineError(KVServeError):
    """The engine failed while running a request (the request is lost; the engine keeps serving)."""


class EngineClosedError(KVServeError):
    """The engine was closed; create a new LLM to submit more requests."""


def check_text(text: str, param: str | None = None) -> str:
    """Return `text` if it is valid Unicode (encodable as UTF-8); a lone UTF-16 surrogate, which JSON
    can carry as an escape, raises InvalidRequestError naming `param`, as does a value that is not a string."""
    if not isinstance(text, str):
        raise InvalidRequestError(f"{param or 'The text'} must be a string, got {type(text).__name__}.", param)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start]
        raise InvalidRequestError(
            f"{param or 'The text'} contains a lone UTF-16 surrogate (U+{ord(bad):04X}) at character {exc.start}, "
            "which is not valid Unicode; send well-formed UTF-8 text.",
            param,
        ) from None
    return text


def check_name(value: object, name: str) -> None:
    """A caller's name for something (a request id, a session id, an owner): None (one is chosen, or
    none is needed) or a non-empty string. An empty one was replaced by a generated id, which the
    caller could then not abort."""
    if value is not None and (not isinstance(value, str) or not value):
        got = "an empty string" if isinstance(value, str) else f"{type(value).__name__} {value!r:.40}"
        raise InvalidRequestError(f"{name} must be a string of one character or more (or None), got {got}.", name)


def first_line(message: str, empty: str, limit: int = 300) -> str:
    """A library's error message cut to its first line and `limit` characters (`empty` when it has none):
    the part a client can read, without the state some libraries append (tens of KB)."""
    line = message.strip().split("\n", 1)[0] or empty
    return line if len(line) <= limit else line[: limit - 3] + "..."


def reads_model_files(fn: F) -> F:
    """For a function that reads a model's files (a path among its arguments): any failure that is not
    already a kvserve error (a damaged config.json, a truncated safetensors file, a tokenizer file that
    does not parse, GGUF metadata that lacks a key) becomes an UnsupportedModelError naming the path
    and the cause, never a traceback from inside a library."""

    @functools.wraps(fn)
    def reading(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except KVServeError:
            raise
        except Exception as exc:
            if not _a_files_fault(exc):  # out of memory, a device's or compiler's error, a file not readable
                raise
            path = next((a for a in (*args, *kwargs.values()) if isinstance(a, str | os.PathLike)), "The model")
            cause = first_line(str(exc), "no detail")
            raise UnsupportedModelError(
                f"{path} cannot be loaded ({type(exc).__name__}: {cause}); its files are damaged, incomplete, or "
                "disagree with its config.json or GGUF metadata. Fetch the model again, or fix those files."
            ) from exc

    return reading  # type: ignore[return-value]


# What a damaged or incomplete file raises while it is parsed: a JSON or struct decoder's error, a missing
# key or a None where a number belongs, a view of the wrong size, safetensors' or tokenizers' own errors.
_PARSING = (ValueError, KeyError, TypeError, AttributeError, IndexError, EOFError)


def _a_files_fault(exc: Exception) -> bool:
    if isinstance(exc, _PARSING) or type(exc).__name__ in ("SafetensorError", "error"):  # struct.error
        return True
    if type(exc) is Exception:  # tokenizers' parse errors are plain Exceptions
        return True
    return type(exc) is RuntimeError and str(exc).startswith("shape '")  # a tensor of the wrong size
