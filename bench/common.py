"""Helpers shared by the benchmark scripts (run as `python bench/NAME.py`, which puts bench/ on the path)."""

from __future__ import annotations

import socket

WORDS = "river stone cloud paper engine garden window silver orange music planet coffee winter bridge".split()  # noqa: SIM905


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100), as numpy's default; NaN for no values."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
