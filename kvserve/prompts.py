"""Turning a prompt into a checked engine Request. Shared by the in-process API (`LLM`) and the
HTTP front end of an engine in another process (server/engine_client.py), so both refuse the same
prompts with the same typed errors before any engine work."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Sequence
from typing import Any

from kvserve.engine.request import Request
from kvserve.errors import InvalidRequestError
from kvserve.sampling_params import SamplingParams
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
        prompt_ids = [int(t) for t in prompt]
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
        params = params or SamplingParams()
        prompt_ids = self.encode_prompt(prompt)
        if not prompt_ids:
            raise InvalidRequestError("The prompt is empty; send at least one token of text.", "prompt")
        limit = self.max_model_len
        if len(prompt_ids) >= limit:
            raise InvalidRequestError(
                f"The prompt has {len(prompt_ids)} tokens; this model's context is {limit}. Shorten the prompt.",
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
