"""Chat templates rendered with jinja2 the way transformers renders them.

Same environment (sandboxed, trim_blocks, lstrip_blocks, loop controls), same helpers
(`raise_exception`, `strftime_now`, a `tojson` that does not escape HTML), and the special
tokens (`bos_token`, `eos_token`, ...) passed as template variables.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvserve.errors import KVServeError


class ChatTemplateError(KVServeError):
    """The conversation does not fit the model's chat template (the template said why)."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"The model's chat template rejected the conversation: {message}")


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str | None]) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self.source = source
        self.template = env.from_string(source)
        self.special_tokens = {k: v for k, v in special_tokens.items() if v is not None}

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        try:
            return self.template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                **{**self.special_tokens, **kwargs},
            )
        except (jinja2.TemplateError, TypeError) as exc:  # TypeError: the template's code on a message it cannot read
            raise ChatTemplateError(f"The model's chat template failed on this conversation: {exc}") from exc
