"""Sessions: conversations whose KV blocks stay pinned between turns. Owned by the engine thread.

A session keeps its history (messages), an open user message that streaming input (`append`)
grows, and references on the KV blocks of the tokens it has computed ("pinned" blocks: full blocks
registered in the prefix cache). A turn is an ordinary request whose prompt is the rendered
history; the pinned blocks make the scheduler's prefix lookup skip everything already computed.
While text streams in, an eager prefill request computes the part of the prompt that can no
longer change. Under memory pressure sessions are unpinned least recently used first, idle ones
before those with a turn queued; their next turn simply recomputes. Operations arriving while a turn
runs wait behind it, in order.

Every operation a caller is told succeeded is in the store first: a new session, a message, an
append (written as the history reads once the operations queued behind a turn apply), and a turn's
reply, whose last chunk is an error instead when it cannot be stored (the history stays as before
the turn). A session holds at most `max_session_tokens` tokens (the context by default): an
operation that would exceed it is refused, never applied.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvserve.engine.block_pool import BlockPool
from kvserve.engine.request import Request
from kvserve.errors import EngineClosedError, InvalidRequestError, KVServeError
from kvserve.outputs import StreamChunk, Usage
from kvserve.sampling_params import SamplingParams
from kvserve.sessions.limits import BYTES_PER_TOKEN, check_ttl
from kvserve.sessions.store import SessionStore, SessionStoreError
from kvserve.text.tokenizer import Tokenizer

SWEEP_SECONDS = 60.0  # how often tick deletes the stored sessions past their TTL
EAGER_HOLDBACK_TOKENS = 3  # tokens at the open end of streamed input that may still re-tokenize
_SENTINEL = "\u2063kvserve-open-end\u2063"
logger = logging.getLogger("kvserve.sessions.manager")


class SessionNotFoundError(KVServeError):
    """No session with that id (or not one this caller may see)."""


class SessionBusyError(KVServeError):
    """A call that needs the session idle (a fork) while a turn runs: 409, try again once it ends."""


class SessionLimitError(KVServeError):
    """The maximum number of sessions is reached; close or let some expire first."""


class SessionsOffError(KVServeError):
    """The engine was made to keep no sessions (max_sessions=0): no new one opens, whatever is closed."""


@dataclass
class Turn:
    request_id: str
    params: SamplingParams
    sink: Any
    interrupt: bool = False
    announce: bool = False  # put an empty chunk in the sink when the turn starts (its checks passed)


class _ReplySink:
    """A turn's sink: its last chunk becomes `failed` where the reply could not be stored (set by
    on_finished, which runs before the engine delivers that chunk)."""

    __slots__ = ("failed", "sink")

    def __init__(self, sink: Any) -> None:
        self.sink, self.failed = sink, None

    @property
    def wraps(self) -> Any:  # an abort scoped to the caller's sink finds the turn through this
        return self.sink

    def put(self, item: Any) -> None:
        if self.failed is not None and isinstance(item, StreamChunk) and item.finish_reason is not None:
            item = self.failed
        self.sink.put(item)


Row = tuple[str, str, bool]  # a stored message: role, content, is_open (the user message being streamed in)


@dataclass
class SessionState:
    session_id: str
    owner: str | None
    ttl: float | None
    messages: list[dict[str, str]]
    open_user: str | None = None  # user text being streamed in, not yet part of a turn
    stored: list[Row] = field(default_factory=list)  # what the store holds of it
    pinned_block_ids: list[int] = field(default_factory=list)
    turn_request_id: str | None = None  # the running turn
    prefill_request_id: str | None = None  # the running eager prefill
    pending: deque = field(default_factory=deque)  # operations waiting for the running turn
    last_used: float = field(default_factory=time.monotonic)
    turn_sink: _ReplySink | None = None  # the running turn's

    @property
    def is_generating(self) -> bool:
        return self.turn_request_id is not None

    @property
    def is_busy(self) -> bool:
        """A turn or an eager prefill runs: new operations wait behind it, in order."""
        return self.turn_request_id is not None or self.prefill_request_id is not None

    def conversation(self) -> list[dict[str, str]]:
        """History plus the open user message: what the next turn's prompt renders."""
        if self.open_user is None:
            return list(self.messages)
        return [*self.messages, {"role": "user", "content": self.open_user}]


class SessionManager:
    """Engine-thread side of sessions. Every method runs on the engine thread."""

    def __init__(
        self,
        pool: BlockPool,
        tokenizer: Tokenizer,
        submit: Callable[[Request, Any], bool],
        abort: Callable[[list[str]], None],
        store: SessionStore | None,
        max_sessions: int,
        default_ttl: float | None,
        max_model_len: int,
        max_sessions_per_owner: int | None = None,
        max_session_tokens: int | None = None,
        max_message_bytes: int | None = None,
    ) -> None:
        self.pool = pool
        self.max_sessions_per_owner = max_sessions_per_owner
        self.max_model_len = max_model_len
        # A session beyond the context could never take a turn: the context bounds the bound.
        self.max_session_tokens = min(max_session_tokens or max_model_len, max_model_len)
        self.max_message_bytes = max_message_bytes or BYTES_PER_TOKEN * self.max_session_tokens
        self.tokenizer = tokenizer
        self.submit = submit  # hands a Request (and its sink) to the scheduler
        self.abort = abort
        self.store = store
        self.max_sessions = max_sessions
        self.default_ttl = check_ttl(default_ttl, "session_ttl")
        self.sessions: dict[str, SessionState] = {}
        self.by_request: dict[str, str] = {}  # turn or prefill request id -> session id
        self._num_pinned: int | None = None  # num_pinned_blocks, until pins change
        self._next_sweep = 0.0  # when tick next deletes the stored sessions past their TTL (monotonic)

    # ----- lifecycle ------------------------------------------------------------------------
    def create(
        self, owner: str | None, messages: list[dict[str, str]], ttl: float | None, open_user: str | None = None
    ) -> SessionState:
        """A new session, stored; raises SessionLimitError when full, InvalidRequestError beyond
        max_session_tokens, SessionStoreError when it cannot be stored."""
        check_ttl(ttl)
        self._check_room(owner)
        self._check_size(list(messages), open_user, "messages")
        session_id = f"sess-{uuid.uuid4().hex}"
        state = SessionState(session_id, owner, ttl if ttl is not None else self.default_ttl, list(messages))
        state.open_user = open_user
        if self.store is not None:
            self.store.create(session_id, owner, state.ttl, state.messages, open_user)
            state.stored = _rows(state.messages, open_user)
            self.store.claim(session_id)  # a new id: no other LLM of this process has it
        self.sessions[session_id] = state
        return state

    def get(self, session_id: str, owner: str | None) -> SessionState:
        state = self.sessions.get(session_id)
        if state is None and self.store is not None:
            if self.store.expired(time.time(), session_id):  # idle past its TTL while nobody had it open
                self._delete_stored([session_id])
            loaded = self.store.load(session_id)
            if loaded is not None:
                stored_owner, ttl, rows = loaded
                if stored_owner == owner:  # already counted by the limits, as every stored session is
                    if not self.store.claim(session_id):  # else two live copies would write one history
                        raise SessionBusyError(
                            f"Session {session_id!r} is open in another LLM of this process, on the same session "
                            "store; use it there, or close that LLM first."
                        )
                    is_open = bool(rows) and rows[-1][2]  # only the last message can still be open
                    messages = [{"role": role, "content": content} for role, content, _ in rows[: len(rows) - is_open]]
                    state = SessionState(session_id, stored_owner, ttl, messages, stored=rows)
                    state.open_user = rows[-1][1] if is_open else None
                    self.sessions[session_id] = state
        if state is None or state.owner != owner:
            raise SessionNotFoundError(f"No session {session_id!r}.")
        state.last_used = time.monotonic()
        return state

    def _check_room(self, owner: str | None) -> None:
        """Room for one more session: the stored ones count (those of earlier runs too), else those here."""
        if self.max_sessions == 0:
            raise SessionsOffError(
                "Sessions are off here (--max-sessions 0, or LLM(max_sessions=0)); send the whole conversation "
                "to /v1/chat/completions (LLM.chat) instead, or start it with a --max-sessions above 0."
            )
        self.drop_expired_stored()  # an expired session holds no place, also before the next sweep
        total = self.store.count(everyone=True) if self.store is not None else len(self.sessions)
        if total >= self.max_sessions:
            raise SessionLimitError(
                f"There are already {self.max_sessions} sessions; close some (or raise --max-sessions) first."
            )
        # Without API keys every caller is the one owner None, and the limit holds for it as for a key.
        limit = self.max_sessions_per_owner
        if self.store is not None:
            held = self.store.count(owner) if limit is not None else 0
        else:
            held = sum(s.owner == owner for s in self.sessions.values())
        if limit is not None and held >= limit:
            who = "This API key holds" if owner is not None else "Callers without an API key (no --api-key) hold"
            raise SessionLimitError(
                f"{who} {limit} sessions already (stored ones included), the most one key may hold; close some first."
            )

    def close(self, state: SessionState) -> None:
        """Delete its stored transcript, then abort its work and release its blocks. If the store
        cannot delete it (SessionStoreError), the session stays as it was."""
        if self.store is not None:
            self.store.delete(state.session_id)
            self.store.unclaim(state.session_id)
        waiting = [op for op in state.pending if isinstance(op, Turn)]
        state.pending.clear()
        self.sessions.pop(state.session_id, None)  # from here on, finishing requests ignore it
        self.abort([i for i in (state.turn_request_id, state.prefill_request_id) if i])
        for turn in waiting:
            turn.sink.put(SessionNotFoundError(f"Session {state.session_id!r} was closed."))
        self._unpin(state)

    def shutdown(self) -> None:
        """The engine is stopping: turns that never started are told so; nothing new starts."""
        for state in self.sessions.values():
            for op in state.pending:
                if isinstance(op, Turn):
                    op.sink.put(EngineClosedError("The engine closed before this turn started."))
            state.pending.clear()

    def fork(self, state: SessionState) -> SessionState:
        """An independent copy sharing the computed prefix (the pinned blocks get one more reference).
        Refused (SessionBusyError) while a turn runs or operations wait behind one:
        calls apply in the order made, so a copy taken then would lack what was asked for before it, and
        waiting here would hold the caller's thread for a whole turn."""
        if state.is_generating or state.pending:  # (an eager prefill alone changes no history)
            raise SessionBusyError(
                f"Session {state.session_id!r} is running a turn (or applying input queued behind one); "
                "fork it once that has ended."
            )
        child = self.create(state.owner, state.messages, state.ttl, state.open_user)
        child.pinned_block_ids = list(state.pinned_block_ids)
        self._num_pinned = None
        self.pool.touch(child.pinned_block_ids)
        return child

    # ----- operations (ordered behind a running turn) ---------------------------------------
    def add_message(self, state: SessionState, role: str, content: str) -> None:
        """Checked and stored now (InvalidRequestError, SessionStoreError: nothing changes); applied
        now, or after the running turn."""
        op = ("add_message", role, content)
        self._record(state, op, "content")
        if state.is_busy:
            state.pending.append(op)
            return
        self._add_message(state, role, content)

    def append(self, state: SessionState, text: str) -> None:
        """As add_message, for streamed input: joins the open user message (or opens one)."""
        op = ("append", text)
        self._record(state, op, "text")
        if state.is_busy:
            state.pending.append(op)
            return
        self._append(state, text)

    def _add_message(self, state: SessionState, role: str, content: str) -> None:
        if state.open_user is not None:  # a whole message closes the streamed one first
            state.messages.append({"role": "user", "content": state.open_user})
            state.open_user = None
        state.messages.append({"role": role, "content": content})

    def _append(self, state: SessionState, text: str) -> None:
        state.open_user = (state.open_user or "") + text
        self._eager_prefill(state)

    def start_turn(self, state: SessionState, turn: Turn) -> None:
        if turn.interrupt and state.turn_request_id is not None:
            self.abort([state.turn_request_id])
        if state.is_busy:  # behind a running turn, or an eager prefill whose blocks this turn will reuse
            state.pending.append(turn)
            return
        conversation = state.conversation()
        if not conversation or conversation[-1]["role"] != "user":
            turn.sink.put(InvalidRequestError("The session has no new user message to answer.", "messages"))
            self._drain(state)
            return
        prompt_ids = self.tokenizer.encode_chat(conversation)
        if len(prompt_ids) + turn.params.max_tokens > self.max_session_tokens:
            limit = (
                f"the context of {self.max_model_len}"
                if self.max_session_tokens == self.max_model_len
                else f"the session's limit of {self.max_session_tokens} (--max-session-tokens)"
            )
            room = self.max_session_tokens - len(prompt_ids)  # what a reply may still take
            advice = (
                f"lower max_tokens to at most {room}, or start a new session"
                if room > 0
                else "no reply fits: start a new session"
            )
            turn.sink.put(
                InvalidRequestError(
                    f"The conversation has {len(prompt_ids)} tokens; with max_tokens={turn.params.max_tokens} it "
                    f"exceeds {limit}: {advice}.",
                    "max_tokens",
                )
            )
            self._drain(state)
            return
        request = Request(turn.request_id, prompt_ids, turn.params, eos_token_ids=self.tokenizer.stop_token_ids)
        sink = _ReplySink(turn.sink)
        if not self.submit(request, sink):  # its id is another request's: refused, the error is in the sink
            self._drain(state)
            return
        state.messages, state.open_user = conversation, None
        self._persist(state)  # the open message is closed now: a failure is mended by the next write
        state.turn_request_id, state.turn_sink = turn.request_id, sink
        self.by_request[turn.request_id] = state.session_id
        if turn.announce:  # after the admission: whoever hears it can ask the engine about the request
            turn.sink.put(StreamChunk(turn.request_id, "", []))

    # ----- engine hooks (kvserve.engine.hooks.EngineHooks) -------------------------------------
    def on_finished(self, request: Request, text: str = "") -> None:
        """A session's turn or prefill request finished (any reason); `text` is a completed turn's
        reply. Pin, record, run what waits."""
        session_id = self.by_request.pop(request.request_id, None)
        state = self.sessions.get(session_id) if session_id else None
        if state is None:
            return
        state.last_used = time.monotonic()
        if request.request_id == state.prefill_request_id:
            state.prefill_request_id = None
            if request.status.name == "FINISHED_STOPPED":
                self._pin(state, request)
            self._drain(state)
            return
        if request.request_id != state.turn_request_id:
            return
        state.turn_request_id = None
        reason = request.finish_reason.value if request.finish_reason else "abort"
        if reason in ("stop", "length"):
            state.messages.append({"role": "assistant", "content": text})
            error = self._persist(state)
            if error is None:
                self._pin(state, request)
            else:  # not acknowledged: the turn fails, and the history stays as it was before it
                state.messages.pop()
                state.turn_sink.failed = SessionStoreError(
                    f"{error} The reply was not kept; the session's history is as it was before this turn."
                )
        self._drain(state)

    def drop_pending(self, request_ids: set[str], sink: Any = None) -> None:
        """Forget turns aborted before they started (with `sink`, only one streaming into it). Each ends
        as any aborted request does, with a last chunk of finish_reason "abort": its caller may still
        wait (another connection's DELETE aborted it)."""
        if not request_ids:
            return
        for state in self.sessions.values():
            dropped = [
                op
                for op in state.pending
                if isinstance(op, Turn) and op.request_id in request_ids and (sink is None or op.sink is sink)
            ]
            if dropped:
                state.pending = deque(op for op in state.pending if all(op is not d for d in dropped))
            for turn in dropped:
                if turn.announce:  # the server reads its first chunk as "started": the end must come after
                    turn.sink.put(StreamChunk(turn.request_id, "", []))
                turn.sink.put(StreamChunk(turn.request_id, "", [], "abort", usage=Usage(0, 0)))

    def reclaim(self, num_blocks: int) -> None:
        """Memory pressure: unpin sessions, least recently used first, until enough is free. Idle ones
        go first, then those with a turn: a queued turn's pins must give way too, or a request ahead of
        it that they crowd out waits for a turn that waits behind it, and nothing runs. That turn finds
        its blocks in the prefix cache if they are still there, or computes them again; a running
        turn holds its blocks itself (unpinning them frees nothing, and its end pins them again)."""
        pinned = sorted(
            (s for s in self.sessions.values() if s.pinned_block_ids), key=lambda s: (s.is_busy, s.last_used)
        )
        for state in pinned:
            if self.pool.num_free_blocks >= num_blocks:
                return
            self._unpin(state)

    def wants_ticks(self) -> bool:
        # sessions alive: expire them even while the engine is idle; and once, the store's from before
        return bool(self.sessions) or (self.store is not None and self._next_sweep == 0.0)

    def tick(self, now: float) -> None:
        """Close the sessions idle for longer than their TTL; every SWEEP_SECONDS, delete the stored
        ones nobody has open whose last write is older than their TTL (those of earlier runs)."""
        for state in list(self.sessions.values()):
            if state.ttl is not None and not state.is_generating and now - state.last_used > state.ttl:
                try:
                    self.close(state)
                except SessionStoreError as exc:  # kept, and tried again next tick; /health reports the store
                    logger.debug("session %s expired but %s", state.session_id, exc)
        if self.store is not None and now >= self._next_sweep:
            self._next_sweep = now + SWEEP_SECONDS
            self.drop_expired_stored(time.time() + now - time.monotonic())  # `now` on the wall clock

    def drop_expired_stored(self, wall_now: float | None = None) -> None:
        """Delete the stored sessions nobody has open whose last write is older than their TTL at Unix
        time `wall_now` (default: now): every SWEEP_SECONDS, and before the stored sessions are counted
        or listed (one query when none is)."""
        if self.store is None:
            return
        try:
            expired = self.store.expired(time.time() if wall_now is None else wall_now)
            self._delete_stored([i for i in expired if i not in self.sessions])
        except SessionStoreError as exc:
            logger.debug("stored sessions past their TTL stay: %s", exc)

    def _delete_stored(self, session_ids: list[str]) -> None:
        """Delete stored sessions that are not open here, in one transaction, but for those another LLM
        of this process has open."""
        claimed = [i for i in session_ids if self.store.claim(i)]
        try:
            if claimed:
                self.store.delete_many(claimed)
        finally:
            for session_id in claimed:
                self.store.unclaim(session_id)

    # ----- queries --------------------------------------------------------------------------
    def info(self, state: SessionState) -> dict[str, Any]:
        messages = self._projected_messages(state)
        prompt_ids = self.tokenizer.encode_chat(messages, add_generation_prompt=False) if messages else []
        return {
            "id": state.session_id,
            "state": "generating" if state.is_generating else "idle",
            "num_messages": len(messages),
            "num_tokens": len(prompt_ids),
            "num_cached_tokens": len(state.pinned_block_ids) * self.pool.block_size,
            "kv_blocks": len(state.pinned_block_ids),
            # the assistant replies in the history, so a reopened or forked session counts what it holds
            "num_turns": sum(m["role"] == "assistant" for m in messages),
            "ttl": state.ttl,
            "messages": messages,
        }

    @staticmethod
    def _projected_messages(state: SessionState) -> list[dict[str, str]]:
        """The history as it reads once the queued messages and appends apply (queued turns aside)."""
        messages, open_user = SessionManager._projection(state)
        return messages + ([{"role": "user", "content": open_user}] if open_user is not None else [])

    @staticmethod
    def _projection(state: SessionState, extra: tuple | None = None) -> tuple[list[dict[str, str]], str | None]:
        """(messages, open user message) once the queued operations, and `extra`, apply."""
        messages, open_user = list(state.messages), state.open_user
        for op in [*state.pending, extra]:
            if op is None or isinstance(op, Turn):
                continue
            if op[0] == "append":
                open_user = (open_user or "") + op[1]
            else:
                if open_user is not None:
                    messages.append({"role": "user", "content": open_user})
                    open_user = None
                messages.append({"role": op[1], "content": op[2]})
        return messages, open_user

    @property
    def num_pinned_blocks(self) -> int:
        """Distinct blocks (a fork and its parent share theirs): counted again only after pins changed,
        not on every engine step."""
        if self._num_pinned is None:
            self._num_pinned = len({b for s in self.sessions.values() for b in s.pinned_block_ids})
        return self._num_pinned

    def stats(self) -> dict[str, Any]:
        return {"num_sessions": len(self.sessions), "session_kv_blocks": self.num_pinned_blocks}

    # ----- internals ------------------------------------------------------------------------
    def _record(self, state: SessionState, op: tuple, param: str) -> None:
        """Before an operation is acknowledged: check the session's size with it applied, and store
        the history as it then reads. Raises (InvalidRequestError, SessionStoreError) having changed
        nothing."""
        messages, open_user = self._projection(state, op)
        self._check_size(messages, open_user, param)
        self._store(state, messages, open_user)

    def _check_size(self, messages: list[dict[str, str]], open_user: str | None, param: str) -> None:
        if open_user is not None:
            messages = [*messages, {"role": "user", "content": open_user}]
        if not messages:
            return
        num_tokens = len(self.tokenizer.encode_chat(messages, add_generation_prompt=False))
        if num_tokens > self.max_session_tokens:
            raise InvalidRequestError(
                f"The session would hold {num_tokens} tokens, more than its limit of {self.max_session_tokens} "
                "(--max-session-tokens); this was not applied. Send less, or start a new session.",
                param,
            )

    def _store(self, state: SessionState, messages: list[dict[str, str]], open_user: str | None) -> None:
        """Make the store hold `messages` and `open_user` for the session: the rows from the first
        that differs from what it holds on. Raises SessionStoreError (the store keeps what it had)."""
        if self.store is None:
            return
        rows = _rows(messages, open_user)
        first = next((i for i, (a, b) in enumerate(zip(rows, state.stored, strict=False)) if a != b), None)
        if first is None:
            first = min(len(rows), len(state.stored))
            if len(rows) == len(state.stored):
                return
        self.store.write_tail(state.session_id, first, rows[first:])
        state.stored = rows

    def _persist(self, state: SessionState) -> str | None:
        """Store the session as it reads now; the failure's text, if it fails (logged)."""
        try:
            self._store(state, *self._projection(state))
        except SessionStoreError as exc:
            logger.error("session %s: %s", state.session_id, exc)
            return str(exc)
        return None

    def _drain(self, state: SessionState) -> None:
        """Apply what waited behind the turn, in order, until the next turn starts (each was
        checked and stored when it was asked for)."""
        while state.pending and not state.is_busy:
            op = state.pending.popleft()
            if isinstance(op, Turn):
                self.start_turn(state, op)
            elif op[0] == "add_message":
                self._add_message(state, op[1], op[2])
            else:
                self._append(state, op[1])

    def _pin(self, state: SessionState, request: Request) -> None:
        """Take references on the request's computed full blocks (still cached: same step)."""
        blocks = self.pool.find_cached_prefix(request.block_hashes)
        self.pool.touch(blocks)
        self._unpin(state)
        state.pinned_block_ids = blocks
        self._num_pinned = None

    def _unpin(self, state: SessionState) -> None:
        if state.pinned_block_ids:
            self.pool.free(state.pinned_block_ids)
            state.pinned_block_ids = []
            self._num_pinned = None

    def _eager_prefill(self, state: SessionState) -> None:
        """Compute the streamed prompt's stable part now, so the turn has little left to do."""
        marked = [*state.messages, {"role": "user", "content": (state.open_user or "") + _SENTINEL}]
        try:
            text = self.tokenizer.apply_chat_template(marked, add_generation_prompt=False)
        except KVServeError:
            return
        cut = text.find(_SENTINEL)
        if cut < 0:
            return
        stable = self.tokenizer.encode(text[:cut], add_special_tokens=False)[:-EAGER_HOLDBACK_TOKENS]
        computed = len(state.pinned_block_ids) * self.pool.block_size
        if len(stable) < computed + self.pool.block_size or len(stable) >= self.max_model_len:
            return  # not even one new full block yet, or past the context (the turn will say so)
        request_id = f"{state.session_id}-prefill-{uuid.uuid4().hex[:8]}"
        request = Request(request_id, stable, SamplingParams(max_tokens=1, temperature=0), prefill_only=True)
        state.prefill_request_id = request_id
        self.by_request[request_id] = state.session_id
        self.submit(request, None)


def _rows(messages: list[dict[str, str]], open_user: str | None) -> list[Row]:
    rows = [(m["role"], m["content"], False) for m in messages]
    return [*rows, ("user", open_user, True)] if open_user is not None else rows
