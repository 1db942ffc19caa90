"""Status routes: what a request, a key's sessions and the engine are doing, for the page (GET /) and
for scripts.

    GET /v1/requests/{id}          a request's state, tokens so far, KV blocks held, timings
    GET /v1/requests/{id}/events   the same as server-sent events: its lifecycle as it happens
    GET /v1/engine                 the model and the engine's settings
    GET /v1/engine/events          server-sent events: the engine view (block map, queues, requests,
                                   figures, events) at most every STATUS_INTERVAL_S
    GET /v1/sessions               the key's sessions, live and stored (also from before a restart)

One `StatusFeed` per server reads the engine's state (EngineMonitor.read) while anyone listens, at
most every STATUS_INTERVAL_S however many listen, builds the view once, and hands each listener the
part its key may see: its own requests and sessions in detail, everyone else's only as anonymous
occupancy (blocks, queue places, counts). A request id is the one DELETE /v1/requests/{id} takes (the
response id or the client's X-Request-Id), or one of its engine requests' ids; another key's is 404.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import StreamingResponse

from kvserve.engine.monitor import HOLDER_BASE, IN_USE, MAX_FINISHED, SERIES_SECONDS, build_view
from kvserve.errors import KVServeError
from kvserve.server.engine_client import RemoteLLM
from kvserve.server.state import APIError, ServerState, authorize, server_state
from kvserve.server.status_ops import STATUS_OPERATIONS

logger = logging.getLogger("kvserve.server")
router = APIRouter(prefix="/v1")
STATUS_INTERVAL_S = 0.5  # the engine is read at most this often, whatever the number of listeners (bench/viewers.py)
MAX_REMEMBERED = 4096  # ended requests whose owner and ids are remembered (GET after the end)
KEEPALIVE_S = 15.0  # an SSE comment when a listener has had nothing for this long
SERIES_EVERY = 20  # the whole per-second series goes out every this many reads (and first); else its tail
SERIES_TAIL = 3
_MISSING = object()


class RequestLedger(dict):
    """The server's live requests ((owner, id) -> execution.Running, as `ServerState.requests` holds
    them), which also remembers, for the last MAX_REMEMBERED, who owned each engine request and which
    engine requests an (owner, id) named, after they ended."""

    def __init__(self) -> None:
        super().__init__()
        self.owners: OrderedDict[str, str | None] = OrderedDict()  # engine request id -> owner
        self.named: OrderedDict[tuple[str | None, str], list[str]] = OrderedDict()  # (owner, id) -> engine ids

    def __setitem__(self, key: tuple[str | None, str], running: Any) -> None:
        super().__setitem__(key, running)
        _remember(self.named, key, list(running.engine_ids))
        for engine_id in running.engine_ids:
            _remember(self.owners, engine_id, key[0])

    def engine_ids(self, owner: str | None, request_id: str) -> list[str] | None:
        """The engine requests that `request_id` names for `owner` (live or ended), None if none."""
        named = self.named.get((owner, request_id))
        if named is not None:
            return named
        if self.owners.get(request_id, _MISSING) == owner:  # an engine request's own id
            return [request_id]
        return None

    def owner_of(self, engine_id: str) -> Any:
        return self.owners.get(engine_id, _MISSING)


def _remember(table: OrderedDict, key: Any, value: Any) -> None:
    table[key] = value
    table.move_to_end(key)
    while len(table) > MAX_REMEMBERED:
        table.popitem(last=False)


def install(app: FastAPI, state: ServerState) -> None:
    """Wire the status routes into `app`: the ledger of requests and the feed."""
    state.requests = RequestLedger()
    app.state.status_feed = StatusFeed(state)
    app.include_router(router)


async def call_op(state: ServerState, op: str, *args: Any) -> Any:
    """A status operation (status_ops.py) on the engine, wherever it runs; 503 while loading."""
    llm = state.ready_llm()
    if isinstance(llm, RemoteLLM):
        return await asyncio.to_thread(llm.call, op, *args)
    return await asyncio.to_thread(STATUS_OPERATIONS[op], llm, *args)


# ----- the feed --------------------------------------------------------------------------------
class FeedClosed(Exception):
    """The server is stopping: status streams end (an open page would hold its shutdown open)."""


class Mailbox:
    """One listener's: the latest view, and every event since it last took one (never dropped)."""

    def __init__(self) -> None:
        self.view: dict[str, Any] | None = None
        self.events: list[dict[str, Any]] = []
        self.tick = 0
        self.merged = False  # more than one read's events wait: this listener's message is its own
        self.ready = asyncio.Event()
        self.is_closed = False

    def close(self) -> None:
        self.is_closed = True
        self.ready.set()

    def put(self, view: dict[str, Any], events: list[dict[str, Any]], tick: int) -> None:
        self.merged |= self.ready.is_set()
        self.view, self.tick = view, tick
        self.events.extend(events)
        self.ready.set()

    async def take(self, timeout: float) -> tuple[dict[str, Any], list[dict[str, Any]], int, bool] | None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self.ready.wait()
        if self.is_closed:
            raise FeedClosed
        if not self.ready.is_set():
            return None
        self.ready.clear()
        events, self.events = self.events, []
        merged, self.merged = self.merged, False
        return self.view, events, self.tick, merged


class StatusFeed:
    """Reads the engine while anyone listens, at most every STATUS_INTERVAL_S, and hands each
    listener the view (build_view) and the new events; keeps the last events for late listeners.
    Listeners of one key that are up to date get one encoding of each read's view between them."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.listeners: set[Mailbox] = set()
        self.recent: deque[dict[str, Any]] = deque(maxlen=MAX_REMEMBERED)
        self.last_seq = 0
        self.tick = 0  # reads so far
        self.series: OrderedDict[int, list[float]] = OrderedDict()  # the engine's per-second figures, merged
        self.view: dict[str, Any] | None = None
        self._task: asyncio.Task | None = None
        self._encoded: dict[str | None, str] = {}  # this tick's message per owner
        self._encoded_tick = -1
        self._loop: asyncio.AbstractEventLoop | None = None
        self.is_closed = False

    def close_soon(self) -> None:
        """End every status stream, now and from now on (the server is stopping). Safe from any
        thread and from a signal handler."""
        if self._loop is None:
            self.is_closed = True
        else:
            self._loop.call_soon_threadsafe(self._close)

    def _close(self) -> None:
        self.is_closed = True
        for mailbox in self.listeners:
            mailbox.close()

    @contextlib.asynccontextmanager
    async def listen(self) -> AsyncIterator[Mailbox]:
        self._loop = asyncio.get_running_loop()
        mailbox = Mailbox()
        if self.is_closed:
            mailbox.close()
        self.listeners.add(mailbox)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())
        try:
            yield mailbox
        finally:
            self.listeners.discard(mailbox)

    def encoded(self, tick: int, owner: str | None, encode: Callable[[], str]) -> str:
        """This tick's message for `owner`, encoded once for all its listeners."""
        if tick != self._encoded_tick:
            self._encoded.clear()
            self._encoded_tick = tick
        if owner not in self._encoded:
            self._encoded[owner] = encode()
        return self._encoded[owner]

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while self.listeners:
            started = loop.time()
            try:
                # watch_s: the engine keeps copies fresh until the next read is due, and a little more
                whole = self.tick % SERIES_EVERY == 0  # else only the last seconds travel
                state = await call_op(
                    self.state, "status_read", self.last_seq, 8 * STATUS_INTERVAL_S, None if whole else SERIES_TAIL
                )
            except (APIError, KVServeError) as exc:  # loading, or the engine stopped: try again later
                logger.debug("the status feed could not read the engine: %s", exc)
            else:
                if state["last_seq"] < self.last_seq:  # a new engine (its log starts again)
                    self.recent.clear()
                self.last_seq = state["last_seq"]
                if whole:
                    self.series.clear()
                self.series.update((bucket[0], bucket) for bucket in state["series"])
                while len(self.series) > SERIES_SECONDS:
                    self.series.popitem(last=False)
                state["series"] = list(self.series.values())
                self.view = build_view(state)
                offset = state["offset"]  # the engine's clock is monotonic: events get Unix times
                events = [{**e, "t": e["t"] + offset} for e in self.view.pop("events")]
                self.recent.extend(events)
                self.tick += 1
                for mailbox in list(self.listeners):
                    mailbox.put(self.view, events, self.tick)
            await asyncio.sleep(max(0.0, STATUS_INTERVAL_S - (loop.time() - started)))


def feed(request: Request) -> StatusFeed:
    return request.app.state.status_feed


# ----- what a key may see --------------------------------------------------------------------------
class Visibility:
    """Which requests and sessions a caller (its owner id) sees in detail."""

    def __init__(self, state: ServerState, owner: str | None, view: dict[str, Any]) -> None:
        self.owner = owner
        self.ledger: RequestLedger = state.requests
        self.own_sessions = {s["id"] for s in view["sessions"] if s["owner"] == owner}

    def request(self, engine_id: str | None, session_id: str | None = None) -> bool:
        if engine_id is None:
            return False
        owner = self.ledger.owner_of(engine_id)
        if owner is not _MISSING:
            return owner == self.owner
        # not an HTTP request: a session's own work (its eager prefill), or one made in-process
        return session_id in self.own_sessions if session_id is not None else self.owner is None

    def holder(self, holder: dict[str, Any]) -> bool:
        if holder["kind"] == "session":
            return holder["id"] in self.own_sessions
        return self.request(holder["id"], holder.get("session"))


def view_for(
    view: dict[str, Any], events: list[dict[str, Any]], visible: Visibility, full_series: bool = True
) -> dict[str, Any]:
    """The engine view as one key sees it: its requests and sessions by id, the rest anonymous. The
    per-second series whole, or (`full_series` false) its last SERIES_TAIL seconds."""
    holders = view["holders"]
    shown: list[dict[str, Any]] = []
    codes: dict[int, int] = {}  # old holder index -> new code

    def code_of(index: int) -> int:
        if index not in codes:
            holder = holders[index]
            if holder["kind"] == "shared":
                members = [m for m in holder["members"] if visible.holder(holders[m])]
                if len(members) > 1:
                    new_members = [code_of(m) - HOLDER_BASE for m in members]
                    shown.append({"kind": "shared", "members": new_members})
                    codes[index] = HOLDER_BASE + len(shown) - 1
                else:
                    codes[index] = code_of(members[0]) if members else IN_USE
            elif visible.holder(holder):
                shown.append({k: v for k, v in holder.items() if k != "owner"})
                codes[index] = HOLDER_BASE + len(shown) - 1
            else:
                codes[index] = IN_USE
        return codes[index]

    runs: list[list[int]] = []
    for code, count in view["map"]:
        code = code_of(code - HOLDER_BASE) if code >= HOLDER_BASE else code
        if runs and runs[-1][0] == code:
            runs[-1][1] += count
        else:
            runs.append([code, count])
    requests = []
    for status in view["requests"]:
        if visible.request(status["id"], status.get("session")):
            requests.append(status)
        else:
            requests.append({"id": None, "state": status["state"], "kv_blocks": status["kv_blocks"]})
    sessions = [{k: v for k, v in s.items() if k != "owner"} for s in view["sessions"] if s["owner"] == visible.owner]
    others = [s for s in view["sessions"] if s["owner"] != visible.owner]
    return {
        "object": "engine.view",
        "time": view["time"],
        "pool": view["pool"],
        "map": runs,
        "holders": shown,
        "running": [rid if visible.request(rid) else None for rid in view["running"]],
        "waiting": [rid if visible.request(rid) else None for rid in view["waiting"]],
        "requests": requests,
        "sessions": sessions,
        "other_sessions": {"count": len(others), "kv_blocks": sum(s["kv_blocks"] for s in others)},
        "events": [_event_for(e, visible) for e in events],
        "series": view["series"] if full_series else view["series"][-SERIES_TAIL:],
        "series_full": full_series,
        "step_time_s": view["step_time_s"],
        "counters": view["counters"],
        "num_missed_events": view["num_missed_events"],
    }


def _event_for(event: dict[str, Any], visible: Visibility) -> dict[str, Any]:
    if event["request_id"] is not None and not visible.request(event["request_id"]):
        return {"seq": event["seq"], "t": event["t"], "kind": event["kind"], "request_id": None}
    return event


# ----- routes --------------------------------------------------------------------------------------
def _sse(name: str, data: Any) -> str:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


def _engine_ids(state: ServerState, owner: str | None, request_id: str) -> list[str]:
    ids = state.requests.engine_ids(owner, request_id)
    if ids is None:  # also another key's request: it is not this caller's to see
        raise APIError(404, f"No request with id {request_id!r}.", "not_found_error", "request_id")
    return ids


_ORDER = ("queued", "preempted", "prefill", "decoding", "aborted", "failed", "finished")
FINAL_STATES = _ORDER[4:]


def _request_object(request_id: str, statuses: dict[str, dict[str, Any]], engine_ids: list[str]) -> dict[str, Any]:
    """A request's status, its choices (one engine request each) together."""
    choices = [{"index": i, **statuses[eid]} for i, eid in enumerate(engine_ids) if eid in statuses]
    if not choices:
        raise APIError(
            404,
            f"The engine does not know the request {request_id!r}: it ended too long ago (the engine keeps the last "
            f"{MAX_FINISHED} finished), or was refused before it started (its response was an error). Read a "
            "request's status while it runs, or soon after.",
            "not_found_error",
            "request_id",
        )
    first = choices[0]
    return {
        "object": "request.status",
        "id": request_id,
        "state": min((c["state"] for c in choices), key=_ORDER.index),
        "num_prompt_tokens": first["num_prompt_tokens"],
        "num_output_tokens": sum(c["num_output_tokens"] for c in choices),
        "kv_blocks": sum(c["kv_blocks"] for c in choices),
        "timings": first["timings"],
        "choices": choices,
    }


async def _statuses(state: ServerState, owner: str | None, request_id: str, engine_ids: list[str]) -> dict:
    """The engine requests' statuses. While the response is in flight, one the engine has not taken
    in yet (its headers can reach the client first) is queued: not a 404 saying it ended long ago."""
    statuses = await call_op(state, "status_requests", engine_ids)
    running = state.requests.get((owner, request_id))
    for engine_id in running.engine_ids if running is not None else ():
        statuses.setdefault(engine_id, _on_its_way(engine_id))
    return statuses


def _on_its_way(engine_id: str) -> dict[str, Any]:
    """The status of an engine request on its way into the engine: as the monitor's, known fields only."""
    timings = ("queued_at", "scheduled_at", "first_token_at", "finished_at", "queue_s", "ttft_s", "e2e_s")
    return {
        "id": engine_id,
        "state": "queued",
        "num_prompt_tokens": None,
        "num_computed_tokens": 0,
        "num_cached_tokens": 0,
        "num_output_tokens": 0,
        "max_tokens": None,
        "kv_blocks": 0,
        "num_blocks_freed": None,
        "num_preemptions": 0,
        "finish_reason": None,
        "internal": False,
        "timings": {**dict.fromkeys(timings), "tokens_per_s": None},
    }


@router.get("/requests/{request_id}")
async def request_status(request_id: str, request: Request, owner: str | None = Depends(authorize)) -> dict:
    state = server_state(request)
    engine_ids = _engine_ids(state, owner, request_id)
    return _request_object(request_id, await _statuses(state, owner, request_id, engine_ids), engine_ids)


async def _until_closed(messages: AsyncIterator[str]) -> AsyncIterator[str]:
    """An SSE stream's messages until the status feed closes (the server stops)."""
    with contextlib.suppress(FeedClosed):
        async for message in messages:
            yield message


@router.get("/requests/{request_id}/events")
async def request_events(request_id: str, request: Request, owner: str | None = Depends(authorize)):
    """The request's lifecycle events as server-sent events: `status` (as GET /v1/requests/{id}) first
    and whenever it changes, each lifecycle event (queued, scheduled, first_token, preempted, finished,
    freed) as it happens, and `end` once every choice's blocks are freed."""
    state = server_state(request)
    engine_ids = _engine_ids(state, owner, request_id)
    first = _request_object(request_id, await _statuses(state, owner, request_id, engine_ids), engine_ids)
    status_feed = feed(request)

    async def follow() -> AsyncIterator[str]:
        async with status_feed.listen() as mailbox:
            wanted = set(engine_ids)
            seen: set[int] = set()
            last = first
            yield _sse("status", first)
            for event in list(status_feed.recent):  # what happened before this listener came
                if event["request_id"] in wanted:
                    seen.add(event["seq"])
                    yield _sse(event["kind"], event)
            while True:
                taken = await mailbox.take(KEEPALIVE_S)
                if taken is None:
                    yield ": keepalive\n\n"
                    continue
                view, events, _, _ = taken
                for event in events:
                    if event["request_id"] in wanted and event["seq"] not in seen:
                        seen.add(event["seq"])
                        yield _sse(event["kind"], event)
                rows = {row["id"]: row for row in view["requests"] if row["id"] in wanted}
                if rows:  # a view's row has the status's fields but the Unix times: merged into the last
                    known = {c["id"]: c for c in last["choices"]}
                    for engine_id, row in rows.items():
                        before = known.get(engine_id, {"timings": {}})
                        known[engine_id] = {**before, **row, "timings": {**before["timings"], **row["timings"]}}
                    now = _request_object(request_id, known, engine_ids)
                    if _progress(now) != _progress(last):
                        yield _sse("status", now)
                    last = now
                # Finished and freed happen together: once every choice is over, its events are out.
                if all(c["state"] in FINAL_STATES for c in last["choices"]):
                    break
            yield _sse("end", {"id": request_id})

    return StreamingResponse(
        _until_closed(follow()), media_type="text/event-stream", headers={"Cache-Control": "no-store"}
    )


def _progress(status: dict[str, Any]) -> tuple:
    return tuple(
        (c["state"], c["num_computed_tokens"], c["num_output_tokens"], c["kv_blocks"]) for c in status["choices"]
    )


@router.get("/engine")
async def engine(request: Request, owner: str | None = Depends(authorize)) -> dict:
    state = server_state(request)
    info = await call_op(state, "engine_info")
    return {"object": "engine", "model": state.model_name, "status_interval_s": STATUS_INTERVAL_S, **info}


@router.get("/engine/events")
async def engine_events(request: Request, owner: str | None = Depends(authorize)):
    """The engine view as server-sent events (`engine`), at most every STATUS_INTERVAL_S, as the
    caller's key may see it; its first carries the recent events too."""
    state = server_state(request)
    state.ready_llm()
    status_feed = feed(request)

    async def follow() -> AsyncIterator[str]:
        async with status_feed.listen() as mailbox:
            backlog = list(status_feed.recent)
            first = True
            while True:
                taken = await mailbox.take(KEEPALIVE_S)
                if taken is None:
                    yield ": keepalive\n\n"
                    continue
                view, events, tick, merged = taken
                if first or merged:  # a message of its own: the backlog, or more than one read's events
                    known = {e["seq"] for e in events}
                    events = [e for e in backlog if e["seq"] not in known] + events if first else events
                    yield _sse("engine", view_for(view, events, Visibility(state, owner, view)))
                    first = False
                    continue
                yield status_feed.encoded(
                    tick,
                    owner,
                    lambda view=view, events=events, tick=tick: _sse(
                        "engine", view_for(view, events, Visibility(state, owner, view), tick % SERIES_EVERY == 0)
                    ),
                )

    return StreamingResponse(
        _until_closed(follow()), media_type="text/event-stream", headers={"Cache-Control": "no-store"}
    )


@router.get("/sessions")
async def list_sessions(request: Request, owner: str | None = Depends(authorize)) -> dict:
    state = server_state(request)
    return {"object": "list", "data": await call_op(state, "sessions_list", owner)}
