"""Session: the caller's handle on a conversation the engine thread owns.

Any thread may call any method at any time. Operations on one session apply in the order they
were called: `append` / `add_message` during a turn wait behind it (nothing is lost), a second
`stream` waits for the first to finish, and `stream(interrupt=True)` or `interrupt()` aborts the
running turn first. `fork` needs the session idle (SessionBusyError during a turn).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from kvserve.engine.client import EngineClient
from kvserve.errors import InvalidRequestError, check_name, check_text
from kvserve.outputs import RequestOutput, StreamChunk
from kvserve.sampling_params import SamplingParams, checked_params
from kvserve.sessions.limits import check_text_bytes
from kvserve.sessions.manager import SessionManager, SessionState, Turn

ROLES = ("system", "user", "assistant")


class Session:
    def __init__(
        self, client: EngineClient, manager: SessionManager, session_id: str, owner: str | None = None
    ) -> None:
        self.client = client
        self._manager = manager  # lives on the engine thread: only touched through client.call / post
        self.id = session_id
        self.owner = owner
        self._closed = False  # by this object's close()

    def _call(self, fn) -> Any:
        """Run fn(manager, state) on the engine thread, in order with this session's other calls."""
        manager, owner, sid = self._manager, self.owner, self.id
        return self.client.call(lambda: fn(manager, manager.get(sid, owner)))

    def add_message(self, role: str, content: str) -> None:
        if role not in ROLES:
            raise InvalidRequestError(f"role must be one of {', '.join(ROLES)}, got {role!r}.", "role")
        content = check_text_bytes(check_text(content, "content"), self._manager.max_message_bytes, "content")
        self._call(lambda m, s: m.add_message(s, role, content))

    def append(self, text: str) -> None:
        """Streaming input: joins the open user message (or opens one after an assistant turn)."""
        text = check_text_bytes(check_text(text, "text"), self._manager.max_message_bytes, "text")
        self._call(lambda m, s: m.append(s, text))

    def start_turn(
        self, params: SamplingParams | None, interrupt: bool, request_id: str | None, announce: bool = False
    ):
        """(request id, start): `start(sink)` queues the turn, its chunks going to `sink`. `stream`
        and `astream` read the sink here; the engine process sends it to its front end. With
        `announce`, an empty chunk comes first, once the turn has started (its checks passed)."""
        params = checked_params(params, SamplingParams(max_tokens=256))
        check_name(request_id, "request_id")
        request_id = request_id or f"{self.id}-turn-{uuid.uuid4().hex[:8]}"
        manager, owner, sid = self._manager, self.owner, self.id

        def start(sink) -> None:
            turn = Turn(request_id, params, sink, interrupt, announce)
            self.client.post(lambda: manager.start_turn(manager.get(sid, owner), turn), sink)

        return request_id, start

    def stream(
        self, params: SamplingParams | None = None, *, interrupt: bool = False, request_id: str | None = None
    ) -> Iterator[StreamChunk]:
        """The assistant's turn, streamed; kept in the history when it completes. Leaving early aborts it."""
        return self.client.stream_with(*self.start_turn(params, interrupt, request_id), own=True)

    def astream(
        self,
        params: SamplingParams | None = None,
        *,
        interrupt: bool = False,
        request_id: str | None = None,
        announce: bool = False,
    ) -> AsyncIterator[StreamChunk]:
        """asyncio twin of `stream`. With `announce`, an empty chunk comes first once the turn has
        started, or the reason it cannot start is raised (the server answers before the first token)."""
        return self.client.astream_with(*self.start_turn(params, interrupt, request_id, announce), own=True)

    def generate(self, params: SamplingParams | None = None, *, interrupt: bool = False) -> RequestOutput:
        return RequestOutput.from_chunks(list(self.stream(params, interrupt=interrupt)))

    def interrupt(self) -> None:
        def run(manager: SessionManager, state: SessionState) -> None:
            if state.turn_request_id is not None:
                manager.abort([state.turn_request_id])

        self._call(run)

    def fork(self) -> Session:
        """An independent copy of the session, sharing its computed prefix. While a turn runs (or input
        queued behind one applies) it raises SessionBusyError: fork once the turn has ended."""
        child = self._call(lambda m, s: m.fork(s))
        return Session(self.client, self._manager, child.session_id, self.owner)

    def info(self) -> dict[str, Any]:
        return self._call(lambda m, s: m.info(s))

    def close(self) -> None:
        """End the session (its blocks freed, its rows deleted); closing it again here does nothing."""
        if not self._closed:
            self._call(lambda m, s: m.close(s))
            self._closed = True

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
