"""Incremental detokenization for streaming.

Each `add(ids)` returns only text that is final: a piece never ends inside a multi-byte character
(the bytes of a partial UTF-8 sequence are held back until a later token completes it), and the
pieces of a stream concatenate to `tokenizer.decode(all_ids)`.

A byte-level BPE tokenizer (SmolLM2, Llama 3, Qwen2: `Tokenizer.token_bytes`) decodes by joining its
tokens' bytes, so a token costs a table look-up and an incremental UTF-8 decoder's step. Another
(SentencePiece, whose decoder looks at neighbouring tokens for its leading-space rules) decodes a short
window of recent tokens twice per token, at constant cost per token.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from kvserve.text.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []  # the window's tokens (a byte-level tokenizer needs none)
        self.prefix_offset = 0  # window start: text before read_offset is already emitted
        self.read_offset = 0
        self.token_bytes = tokenizer.token_bytes  # None: decode windows
        if self.token_bytes is not None:
            self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
            self.skipped = tokenizer.special_token_ids if skip_special_tokens else frozenset()

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_token_ids: Sequence[int]) -> str:
        """Append tokens; return the newly final text (possibly empty)."""
        table = self.token_bytes
        if table is not None:  # an id past the vocabulary decodes to nothing, as in `decode`
            size, skipped = len(table), self.skipped
            return self.utf8.decode(b"".join(table[i] for i in new_token_ids if i < size and i not in skipped))
        self.token_ids.extend(new_token_ids)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        text = self._decode(self.token_ids[self.prefix_offset :])
        if len(text) <= len(prefix_text) or text.endswith(_REPLACEMENT):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return text[len(prefix_text) :]

    def flush(self) -> str:
        """At the end of a stream: whatever was held back, even if it is an incomplete character."""
        if self.token_bytes is not None:
            return self.utf8.decode(b"", final=True)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        text = self._decode(self.token_ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.token_ids)
        return text[len(prefix_text) :]
