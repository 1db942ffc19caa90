"""Bounds on what a caller may ask of a session, in one light module (the command line's --help
states them without importing the engine)."""

from __future__ import annotations

from kvserve.errors import InvalidRequestError

# A session's idle lifetime: below a second an id could be gone before its creator reads it; past
# 30 days it is a leak the store keeps.
MIN_SESSION_TTL = 1.0
MAX_SESSION_TTL = 30 * 86400.0
TTL_BOUNDS = f"{MIN_SESSION_TTL:g} s to {MAX_SESSION_TTL:.0f} s (30 days)"


def check_ttl(ttl: float | None, param: str = "ttl") -> float | None:
    """`ttl` if it is None (no expiry) or within [MIN_SESSION_TTL, MAX_SESSION_TTL] seconds (NaN is
    not), else InvalidRequestError saying the bounds."""
    if ttl is None or (not isinstance(ttl, bool) and MIN_SESSION_TTL <= ttl <= MAX_SESSION_TTL):
        return ttl
    raise InvalidRequestError(f"{param} must be from {TTL_BOUNDS}, got {ttl!r}.", param)
