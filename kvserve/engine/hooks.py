"""EngineHooks: what the engine tells a component that keeps state across requests (sessions).

The engine knows nothing else about such a component. Every call runs on the engine thread.
"""

from __future__ import annotations

from typing import Any, Protocol

from kvserve.engine.request import Request


class EngineHooks(Protocol):
    def reclaim(self, num_blocks: int) -> None:
        """The scheduler needs `num_blocks` free blocks: release blocks held for later, if any."""

    def wants_ticks(self) -> bool:
        """Whether `tick` should run even while the engine is idle (about once a second)."""

    def tick(self, now: float) -> None:
        """Periodic work (expiry), at most about once a second; `now` is time.monotonic()."""

    def on_finished(self, request: Request, text: str = "") -> None:
        """A request left the scheduler (any reason); `text` is its output text when it completed."""

    def drop_pending(self, request_ids: set[str], sink: Any = None) -> None:
        """These ids were aborted before reaching the scheduler: forget any that wait with the hooks
        (with `sink`, only one streaming into it)."""

    def shutdown(self) -> None:
        """The engine is stopping: tell whatever waits with the hooks; start nothing new."""

    def stats(self) -> dict[str, Any]:
        """Counters merged into the engine's stats snapshot."""
