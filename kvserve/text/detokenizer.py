"""Incremental detokenization for streaming.

Each `add(ids)` returns only text that is final: a piece never ends inside a multi-byte
character (a trailing U+FFFD from a partial UTF-8 sequence is held back until the next token
completes it), and the pieces of a stream concatenate to `tokenizer.decode(all_ids)`. Decoding
a short window of recent tokens (rather than each token alone) keeps decoders that look at
neighbouring tokens (leading-space rules) correct, at constant cost per token.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.text.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0  # window start: text before read_offset is already emitted
        self.read_offset = 0

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_token_ids: Sequence[int]) -> str:
        """Append tokens; return the newly final text (possibly empty)."""
        self.token_ids.extend(new_token_ids)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        text = self._decode(self.token_ids[self.prefix_offset :])
        if len(text) <= len(prefix_text) or text.endswith(_REPLACEMENT):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return text[len(prefix_text) :]

    def flush(self) -> str:
        """At the end of a stream: whatever was held back, even if it is an incomplete character."""
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        text = self._decode(self.token_ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.token_ids)
        return text[len(prefix_text) :]
