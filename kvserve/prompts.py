"""Turning a prompt into a checked engine Request. Shared by the in-process API (`LLM`) and the
HTTP front end of an engine in another process (server/engine_client.py), so both refuse the same
prompts with the same typed errors before any engine work."""

from __future__ import annotations

import itertools
import operator
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from kvserve.engine.request import Request
from kvserve.errors import InvalidRequestError, check_name, check_text
from kvserve.sampling_params import SamplingParams, checked_params
from kvserve.text.tokenizer import Tokenizer

Prompt = str | Sequence[int]
Messages = list[dict[str, Any]]


class RequestBuilder:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int) -> None:
        self.tokenizer, self.vocab_size, self.max_model_len = tokenizer, vocab_size, max_model_len
        self._ids = itertools.count()
        self._id_prefix = uuid.uuid4().hex[:8]

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """A prompt's token ids: text is encoded, token ids are checked against the vocabulary."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        prompt_ids = _token_ids(prompt)
        vocab = self.vocab_size
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            shown = bad if bad.bit_length() <= 64 else f"of {bad.bit_length()} bits"
            raise InvalidRequestError(f"Token id {shown} is outside the vocabulary (0..{vocab - 1}).", "prompt")
        return prompt_ids

    def check_params(self, params: SamplingParams) -> None:
        """What of `params` needs the model to check: logit_bias's token ids are in the vocabulary."""
        bad = next((t for t, _ in params.logit_bias if t >= self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(
                f"logit_bias names token id {bad}, outside the vocabulary (0..{self.vocab_size - 1}).", "logit_bias"
            )

    def build(self, prompt: Prompt, params: SamplingParams | None, request_id: str | None) -> Request:
        """A Request for `prompt`, or InvalidRequestError naming the field that is wrong."""
        params = checked_params(params)
        check_name(request_id, "request_id")
        prompt_ids = self.encode_prompt(prompt)
        if not prompt_ids:
            raise InvalidRequestError("The prompt is empty; send at least one token of text.", "prompt")
        limit = self.max_model_len
        if len(prompt_ids) >= limit:
            raise InvalidRequestError(
                f"The prompt has {len(prompt_ids)} tokens; the context is {limit} (the model's, or less where the KV "
                "cache or max_model_len is smaller). Shorten the prompt.",
                "prompt",
            )
        self.check_params(params)
        if len(prompt_ids) + params.max_tokens > limit:
            raise InvalidRequestError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context of "
                f"{limit} tokens; lower max_tokens to at most {limit - len(prompt_ids)}.",
                "max_tokens",
            )
        return Request(
            request_id=request_id or f"req-{self._id_prefix}-{next(self._ids)}",
            prompt_token_ids=prompt_ids,
            params=params,
            eos_token_ids=self.tokenizer.stop_token_ids,
        )


def _token_ids(prompt: Any) -> list[int]:
    """A prompt given as token ids, as ints: integers of any kind (numpy's too), never bools, floats or
    bytes (whose iteration would pass for token ids)."""
    shape = "A prompt is a string or a list of token ids (integers)"
    if isinstance(prompt, bytes | bytearray) or not isinstance(prompt, Iterable):
        raise InvalidRequestError(f"{shape}; got {type(prompt).__name__}.", "prompt")
    ids = []
    for token in prompt:
        try:
            if isinstance(token, bool):
                raise TypeError
            ids.append(operator.index(token))
        except TypeError:
            raise InvalidRequestError(f"{shape}; got {token!r:.40} among them.", "prompt") from None
    return ids


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "ipython")  # OpenAI's, and Llama 3.1's tool role


def check_messages(messages: Any) -> Messages:
    """`messages` for a chat template, checked: a non-empty list of dicts, each with one of OpenAI's
    roles and text content (OpenAI's text parts are joined into it, as the server does; an assistant's
    tool calls may stand without content)."""
    if not isinstance(messages, list | tuple) or not messages:
        raise InvalidRequestError(
            'messages must be a non-empty list of {"role": ..., "content": ...} dicts.', "messages"
        )
    messages = [_joined_parts(m, i) for i, m in enumerate(messages)]
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in CHAT_ROLES:
            raise InvalidRequestError(
                f"messages[{i}] needs a role, one of {', '.join(CHAT_ROLES)}; got {role!r:.40}.", f"messages[{i}].role"
            )
        content = message.get("content")
        if isinstance(content, str):
            check_text(content, f"messages[{i}].content")
        elif not (content is None and message.get("tool_calls")):
            raise InvalidRequestError(
                f"messages[{i}].content must be text, got {type(content).__name__}.", f"messages[{i}].content"
            )
    return messages


def _joined_parts(message: Any, index: int) -> Any:
    """A message whose content is OpenAI's list of text parts, with that text as its content."""
    if not isinstance(message, dict) or not isinstance(message.get("content"), list):
        return message
    return {**message, "content": joined_text_parts(message["content"], index)}


def joined_text_parts(parts: list, index: int) -> str:
    """The text of messages[index]'s content given as OpenAI's parts; a part that is not text is refused."""
    texts = []
    for j, part in enumerate(parts):
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise InvalidRequestError(
                f"messages[{index}].content[{j}] has type {kind!r}; only text parts are supported.",
                f"messages[{index}].content[{j}].type",
            )
        texts.append(part["text"])
    return "".join(texts)
