"""Bounds on what a caller may ask of a session, in one light module (the command line's --help
states them without importing the engine)."""

from __future__ import annotations

import numbers

from kvserve.errors import InvalidRequestError

# A session's idle lifetime: below a second an id could be gone before its creator reads it; past
# 30 days it is a leak the store keeps.
MIN_SESSION_TTL = 1.0
MAX_SESSION_TTL = 30 * 86400.0
TTL_BOUNDS = f"{MIN_SESSION_TTL:g} s to {MAX_SESSION_TTL:.0f} s (30 days)"


def check_ttl(ttl: float | None, param: str = "ttl") -> float | None:
    """`ttl` if it is None (no expiry) or within [MIN_SESSION_TTL, MAX_SESSION_TTL] seconds (NaN is
    not), else InvalidRequestError saying the bounds."""
    if ttl is None or (
        isinstance(ttl, numbers.Real) and not isinstance(ttl, bool) and MIN_SESSION_TTL <= ttl <= MAX_SESSION_TTL
    ):
        return ttl
    raise InvalidRequestError(f"{param} must be from {TTL_BOUNDS}, got {ttl!r}.", param)


# A message's text may take this many UTF-8 bytes per token of --max-session-tokens by default: far
# more than any tokenizer packs into a token (about 4 for English), so only text that could never
# fit is refused by its size, before it is tokenized.
BYTES_PER_TOKEN = 16


def check_text_bytes(text: str, limit: int, param: str) -> str:
    """`text` if its UTF-8 encoding is at most `limit` bytes, else InvalidRequestError saying so."""
    if len(text) > limit // 4 and len(text.encode()) > limit:  # a character is at most 4 bytes
        raise InvalidRequestError(
            f"{param} is {len(text.encode())} bytes, more than the {limit} one message may carry "
            "(--max-message-bytes); shorten it, or start a new session for it.",
            param,
        )
    return text
