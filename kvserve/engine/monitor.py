"""EngineMonitor: what the engine is doing, for status readers (the page, GET /v1/requests/{id}, scripts).

It runs on the engine thread as one of the engine's observers: it hears each request admitted and each
that leaves, and after every loop turn notes each live request's transitions (scheduled, preempted,
first token) and the step's timing. That bookkeeping is a few attribute reads per live request per
turn. Everything larger (the block map, each request's progress) is built only when a reader asks
(`snapshot`, `statuses`, both through `EngineCore.call`, so on the engine thread between steps): its
cost follows the readers' rate, which the server bounds, not the number of readers or of steps.

A request's life, as events in the log (`kind`): queued -> scheduled (with the tokens its prefix hit
covered) -> first_token (TTFT) -> finished (stop, length, abort, error) -> freed (how many of its
blocks went back to the pool, how many stay held by a session or a request sharing them); preempted
(its blocks freed, back to the queue) may come between. Engine-wide: evicted (cached blocks taken for
new work) and reclaimed (sessions let their pinned blocks go under memory pressure).
"""

from __future__ import annotations

import itertools
import operator
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvserve.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from kvserve.engine.core import EngineCore

MAX_EVENTS = 4096  # the log readers catch up from; a reader further behind is told how many it missed
MAX_FINISHED = 1024  # finished requests whose status can still be read
RECENT_FINISHED_S = 5.0  # finished requests a read still shows (their last row on the page)...
MAX_RECENT_FINISHED = 8  # ...at most this many, the latest
WATCH_S = 2.0  # a reader counts as watching this long after a read
CAPTURE_INTERVAL_S = 0.1  # while watched, the engine copies its state at most this often without an event
SERIES_SECONDS = 300  # the per-second figures a snapshot carries: the last five minutes

# Codes of the block map (a snapshot's "map" is run-length encoded: [code, count] pairs); a code from
# HOLDER_BASE on is holders[code - HOLDER_BASE].
FREE, CACHED, IN_USE, HOLDER_BASE = 0, 1, 2, 3


@dataclass
class SessionHolder:
    """What the monitor is told of a session (by its owner, through `holders`): who it belongs to and
    the KV blocks it pins between turns."""

    session_id: str
    owner: str | None
    block_ids: list[int]
    is_generating: bool
    request_ids: tuple[str, ...] = ()  # its turn or eager prefill running now


@dataclass(eq=False)
class Track:
    """One request's lifecycle as the monitor saw it."""

    request_id: str
    request: Request | None  # None once finished
    num_prompt_tokens: int
    is_internal: bool  # a session's eager prefill: no output, nobody streams it
    admitted_at: float
    max_tokens: int | None = None
    status: RequestStatus = RequestStatus.WAITING
    scheduled_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    finish_reason: str | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    block_ids: list[int] = field(default_factory=list)  # the request's list as last seen (kept at the end)
    num_blocks_freed: int | None = None
    _row: dict[str, Any] | None = field(default=None, repr=False)  # a finished request's view row

    @property
    def state(self) -> str:
        """queued, prefill, decoding, preempted, or finished / aborted / failed."""
        if self.finished_at is not None:
            return {"abort": "aborted", "error": "failed"}.get(self.finish_reason or "", "finished")
        if self.status == RequestStatus.PREEMPTED:
            return "preempted"
        if self.status == RequestStatus.WAITING:
            return "queued"
        request = self.request
        if request is not None and request.num_computed_tokens < request.num_tokens - 1:
            return "prefill"  # its prompt (or, after a preemption, its prompt and output so far)
        return "decoding"

    @property
    def num_output(self) -> int:
        return self.request.num_output_tokens if self.request is not None else self.num_output_tokens

    def row(self) -> dict[str, Any]:
        """The engine view's row: the status without the Unix times (a finished one's is kept)."""
        if self._row is not None:
            return self._row
        status = self.status_dict(0.0)
        timings = status["timings"]
        ttft_s, tokens_per_s = timings["ttft_s"], timings["tokens_per_s"]
        row = {
            **status,
            "timings": {
                "ttft_s": round(ttft_s, 4) if ttft_s is not None else None,
                "tokens_per_s": round(tokens_per_s, 1) if tokens_per_s is not None else None,
            },
        }
        if self.finished_at is not None:
            self._row = row
        return row

    def status_dict(self, offset: float) -> dict[str, Any]:
        """As readers get it; `offset` turns monotonic times into Unix times."""
        request = self.request
        end = self.finished_at if self.finished_at is not None else time.monotonic()
        num_output = self.num_output
        tokens_per_s = None
        if self.first_token_at is not None and num_output > 1 and end > self.first_token_at:
            tokens_per_s = (num_output - 1) / (end - self.first_token_at)
        return {
            "id": self.request_id,
            "state": self.state,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_computed_tokens": request.num_computed_tokens if request is not None else None,
            "num_cached_tokens": self.num_cached_tokens,
            "num_output_tokens": num_output,
            "max_tokens": self.max_tokens,
            "kv_blocks": len(request.block_ids) if request is not None else 0,
            "num_blocks_freed": self.num_blocks_freed,
            "num_preemptions": self.num_preemptions,
            "finish_reason": self.finish_reason,
            "internal": self.is_internal,
            "timings": {
                "queued_at": self.admitted_at + offset,
                "scheduled_at": _shift(self.scheduled_at, offset),
                "first_token_at": _shift(self.first_token_at, offset),
                "finished_at": _shift(self.finished_at, offset),
                "queue_s": _since(self.admitted_at, self.scheduled_at),
                "ttft_s": _since(self.admitted_at, self.first_token_at),
                "e2e_s": _since(self.admitted_at, self.finished_at),
                "tokens_per_s": tokens_per_s,
            },
        }


class EngineMonitor:
    """Built on the engine thread (`engine.call(lambda: EngineMonitor(engine, holders))`), which then
    calls it; readers call `read` and `statuses` from any thread. `holders` returns the sessions'
    pins (called on the engine thread)."""

    def __init__(self, engine: EngineCore, holders: Callable[[], list[SessionHolder]] | None = None) -> None:
        self.engine = engine
        self.holders = holders or list
        self.live: dict[str, Track] = {}
        self.finished: OrderedDict[str, Track] = OrderedDict()
        self.events: deque[dict[str, Any]] = deque(maxlen=MAX_EVENTS)
        self._seq = itertools.count(1)
        self.last_seq = 0
        # per second: [second, generated tokens, steps, step seconds, TTFT seconds, TTFTs]
        self.series: deque[list[float]] = deque(maxlen=SERIES_SECONDS)
        self.step_time_s: float | None = None  # the last step's, as the engine's cadence shows it
        self.num_reclaimed_blocks_total = 0
        self.monitor_seconds_total = 0.0  # engine-thread time spent here (bench/viewers.py reports it)
        self._steps = engine.steps_total
        self._tokens = engine.scheduler.stats.generation_tokens_total
        self._evictions = engine.pool.num_evictions_total
        self._last_turn_at = time.monotonic()
        self._had_work = False  # at the end of the last turn: another turn comes without a message
        self._watched_until = 0.0
        self._watch_started = 0.0  # when readers last came back after nobody watched
        self._capture_taken: dict[str, Any] | None = None
        self._captured_at, self._captured_seq = 0.0, 0
        reclaim = engine.scheduler.reclaim
        if reclaim is not None:  # the sessions' memory-pressure hook: note what it gives back
            engine.scheduler.reclaim = lambda num_blocks: self._reclaim(reclaim, num_blocks)
        engine.observers.append(self)
        engine.after_turn.append(self.after_turn)

    # ----- engine thread: what the engine tells it ----------------------------------------------
    def on_admit(self, request: Request) -> None:
        now = time.monotonic()
        track = Track(
            request.request_id,
            request,
            request.num_prompt_tokens,
            request.prefill_only,
            now,
            request.params.max_tokens,
            block_ids=request.block_ids,
        )
        self.live[request.request_id] = track
        self._event("queued", track, now, num_prompt_tokens=track.num_prompt_tokens)

    def on_finished(self, request: Request) -> None:
        start = time.perf_counter()
        track = self.live.pop(request.request_id, None)
        if track is None or track.request is not request:
            return
        now = time.monotonic()
        self._observe(track, now, keep_blocks=True)  # its list is empty now: keep the one seen last
        track.request, track.finished_at = None, now
        track.status, track.num_output_tokens = request.status, request.num_output_tokens
        track.finish_reason = request.finish_reason.value if request.finish_reason is not None else "abort"
        self._event("finished", track, now, reason=track.finish_reason, num_output_tokens=track.num_output_tokens)
        # Its blocks were freed as it left: those whose last reference it held are free (or cached)
        # now; the others stay with a session or a request that shares them.
        ref_cnt = self.engine.pool.ref_cnt
        freed = sum(1 for b in track.block_ids if ref_cnt[b] == 0)
        track.num_blocks_freed = freed
        self._event("freed", track, now, num_blocks=freed, num_kept=len(track.block_ids) - freed)
        self.finished[track.request_id] = track
        if len(self.finished) > MAX_FINISHED:
            self.finished.popitem(last=False)
        self.monitor_seconds_total += time.perf_counter() - start

    def after_turn(self) -> None:
        """After every loop turn: transitions of live requests, step timing, evictions."""
        start = time.perf_counter()
        now = time.monotonic()
        engine = self.engine
        steps = engine.steps_total
        if steps != self._steps:
            tokens = engine.scheduler.stats.generation_tokens_total
            step_s = (now - self._last_turn_at) / (steps - self._steps) if self._had_work else None
            self._count(now, tokens - self._tokens, steps - self._steps, step_s)
            self.step_time_s = step_s if step_s is not None else self.step_time_s
            self._steps, self._tokens = steps, tokens
        evictions = engine.pool.num_evictions_total
        if evictions != self._evictions:
            self._event("evicted", None, now, num_blocks=evictions - self._evictions)
            self._evictions = evictions
        for track in self.live.values():
            self._observe(track, now)
        self._last_turn_at = now
        self._had_work = engine.scheduler.has_ready_work
        self._maybe_capture(now)
        self.monitor_seconds_total += time.perf_counter() - start

    def _observe(self, track: Track, now: float, keep_blocks: bool = False) -> None:
        request = track.request
        if not keep_blocks:  # the list object: a free rebinds the request's, so this one keeps its blocks
            track.block_ids = request.block_ids
        status = request.status
        if status != track.status:
            if status == RequestStatus.RUNNING:
                if track.scheduled_at is None:
                    track.scheduled_at = now
                    track.num_cached_tokens = request.num_cached_tokens
                    self._event("scheduled", track, now, num_cached_tokens=request.num_cached_tokens)
            elif status == RequestStatus.PREEMPTED:
                track.num_preemptions += 1
                self._event("preempted", track, now)
            track.status = status
        if track.first_token_at is None and request.num_output_tokens:
            track.first_token_at = now
            ttft = now - track.admitted_at
            self._event("first_token", track, now, ttft_s=ttft)
            bucket = self._bucket(now)
            bucket[4] += ttft
            bucket[5] += 1

    def _reclaim(self, reclaim: Callable[[int], None], num_blocks: int) -> None:
        before = self.engine.pool.num_free_blocks
        reclaim(num_blocks)
        released = self.engine.pool.num_free_blocks - before
        if released:
            self.num_reclaimed_blocks_total += released
            self._event("reclaimed", None, time.monotonic(), num_blocks=released)

    def _event(self, kind: str, track: Track | None, now: float, **data: Any) -> None:
        self.last_seq = next(self._seq)
        event = {"seq": self.last_seq, "t": now, "kind": kind, "request_id": None, **data}
        if track is not None:
            event["request_id"] = track.request_id
            if track.is_internal:
                event["internal"] = True
        self.events.append(event)

    def _bucket(self, now: float) -> list[float]:
        second = int(now)
        if not self.series or self.series[-1][0] != second:
            self.series.append([second, 0, 0, 0.0, 0.0, 0])
        return self.series[-1]

    def _count(self, now: float, tokens: int, steps: int, step_s: float | None) -> None:
        bucket = self._bucket(now)
        bucket[1] += tokens
        if step_s is not None:
            bucket[2] += steps
            bucket[3] += step_s * steps

    # ----- readers (any thread) ----------------------------------------------------------------
    def statuses(self, request_ids: list[str]) -> dict[str, dict[str, Any]]:
        """The status of each of these requests that is live or finished recently, by id. Reads
        single fields of the engine's objects: each value is one the engine held at some moment."""
        offset = time.time() - time.monotonic()
        found = {}
        for request_id in request_ids:
            track = self.live.get(request_id) or self.finished.get(request_id)
            if track is not None:
                found[request_id] = track.status_dict(offset)
        return found

    def read(
        self,
        since_seq: int = 0,
        watch_s: float = WATCH_S,
        series_seconds: int | None = None,
        timeout: float | None = 30.0,
    ) -> dict[str, Any]:
        """The engine's state as of its last turn (`build_view` turns it into the block map): the
        pool's reference counts, who holds which blocks, the queues, live and recently finished
        requests, the log's events after `since_seq`, figures per second (the last `series_seconds`
        of them, or all).

        A reader is "watching" for `watch_s` after each read: meanwhile the engine copies its state at
        the end of a turn that logged an event, and at most every CAPTURE_INTERVAL_S otherwise (list
        copies, no per-block Python); an idle engine is asked for a fresh copy at once. So what a
        read costs the engine follows the readers' rate and not their number, and a read never waits
        for a step in progress (the state it returns is the one that step started from), except the
        first after nobody watched, which waits for the step boundary rather than return a stale copy."""
        started = time.monotonic()
        if started >= self._watched_until:  # nobody watched: the engine copied nothing since the last read
            self._watch_started = started
        self._watched_until = max(self._watched_until, started + watch_s)
        if since_seq > self.last_seq:  # a reader of an earlier engine
            since_seq = 0
        capture = self._capture_taken
        # Idle, nothing will end a turn soon; a copy from before this watch began (this reader's, or
        # another's arriving with it) is as old as the last watch: ask for a copy.
        if capture is None or not self._had_work or capture["now"] < self._watch_started:
            capture = self.engine.call(self._capture, timeout)
        offset = time.time() - time.monotonic()
        now = capture["now"]
        recent = []
        for track in reversed(list(self.finished.values())):  # the latest first
            if len(recent) == MAX_RECENT_FINISHED or now - track.finished_at > RECENT_FINISHED_S:
                break
            if track.finished_at <= now:  # after the capture: not yet
                recent.append(track)
        logged = list(self.events)  # consecutive numbers: the ones after since_seq are a slice
        events = logged[max(0, since_seq - logged[0]["seq"] + 1) :] if logged else []
        num_missed = events[0]["seq"] - since_seq - 1 if events and since_seq else 0
        series = list(self.series)
        return {
            **{k: v for k, v in capture.items() if k not in ("now", "tracks")},
            "time": now + offset,
            "offset": offset,
            "requests": [track.row() for track in [*capture["tracks"], *reversed(recent)]],
            "events": events,
            "last_seq": events[-1]["seq"] if events else since_seq,
            "num_missed_events": max(num_missed, 0),
            "series": [list(bucket) for bucket in series[-series_seconds if series_seconds else 0 :]],
            "step_time_s": self.step_time_s,
        }

    # ----- engine thread: copies for readers ----------------------------------------------------
    def _maybe_capture(self, now: float) -> None:
        if now < self._watched_until and (
            self.last_seq != self._captured_seq or now - self._captured_at >= CAPTURE_INTERVAL_S
        ):
            self._capture_taken = self._capture()

    def _capture(self) -> dict[str, Any]:
        """The engine's state, copied (engine thread; list copies, no loop over blocks in Python)."""
        engine, pool, scheduler = self.engine, self.engine.pool, self.engine.scheduler
        now = time.monotonic()
        self._captured_at, self._captured_seq = now, self.last_seq
        return {
            "now": now,
            "num_blocks": pool.num_blocks,
            "block_size": pool.block_size,
            "ref_cnt": pool.ref_cnt[:],
            "is_cached": bytes(map(operator.is_not, pool.block_hash, itertools.repeat(None))),
            "request_blocks": [(rid, r.block_ids[:]) for rid, r in scheduler.requests.items() if r.block_ids],
            "sessions": [  # a session's pinned list is replaced, never changed in place
                (h.session_id, h.owner, h.block_ids, h.is_generating, h.request_ids) for h in self.holders()
            ],
            "running": [r.request_id for r in scheduler.running],
            "waiting": [r.request_id for r in scheduler.waiting],
            "tracks": list(self.live.values()),
            "counters": {
                "steps_total": engine.steps_total,
                "generation_tokens_total": scheduler.stats.generation_tokens_total,
                "num_preemptions_total": scheduler.stats.num_preemptions_total,
                "num_evictions_total": pool.num_evictions_total,
                "num_reclaimed_blocks_total": self.num_reclaimed_blocks_total,
                "num_aborted_total": engine.num_aborted_total,
                "monitor_seconds_total": self.monitor_seconds_total,
            },
        }


def build_view(state: dict[str, Any]) -> dict[str, Any]:
    """From `EngineMonitor.read`'s state: the block map (run-length encoded `map`: [code, count] pairs,
    codes FREE, CACHED, IN_USE, or HOLDER_BASE + an index into `holders`), the holders (requests,
    sessions, and groups of those that share blocks), the pool's counts, and each request's session.
    Pure: runs wherever the state arrives (the server's front end)."""
    holders: list[dict[str, Any]] = []
    ref_cnt, is_cached = state["ref_cnt"], state["is_cached"]
    codes = list(is_cached)  # FREE or CACHED (0, 1); C-level passes over the blocks from here on
    for block_id in itertools.compress(range(len(codes)), ref_cnt):
        codes[block_id] = IN_USE  # until a holder claims it; else held by something the monitor was not told of
    groups: dict[tuple[int, ...], int] = {}

    def hold(index: int, block_ids: list[int]) -> None:
        code = HOLDER_BASE + index
        for b in block_ids:
            current = codes[b]
            if current < HOLDER_BASE:
                codes[b] = code
            elif current != code:  # shared: a group of holders of its own
                members = holders[current - HOLDER_BASE].get("members") or (current - HOLDER_BASE,)
                key = tuple(sorted({*members, index}))
                if key not in groups:
                    groups[key] = len(holders)
                    holders.append({"kind": "shared", "members": key})
                codes[b] = HOLDER_BASE + groups[key]

    session_of = {rid: sid for sid, _, _, _, request_ids in state["sessions"] for rid in request_ids}
    for request_id, block_ids in state["request_blocks"]:
        holders.append({"kind": "request", "id": request_id, "session": session_of.get(request_id)})
        hold(len(holders) - 1, block_ids)
    for session_id, owner, block_ids, _, _ in state["sessions"]:
        if block_ids:
            holders.append({"kind": "session", "id": session_id, "owner": owner})
            hold(len(holders) - 1, block_ids)
    num_cached = sum(itertools.compress(is_cached, map(operator.not_, ref_cnt)))
    num_used = len(ref_cnt) - ref_cnt.count(0)
    for request in state["requests"]:
        request["session"] = session_of.get(request["id"])
    return {
        **{k: v for k, v in state.items() if k not in ("ref_cnt", "is_cached", "request_blocks")},
        "pool": {
            "num_blocks": state["num_blocks"],
            "block_size": state["block_size"],
            "num_used": num_used,
            "num_cached": num_cached,
            "num_free": state["num_blocks"] - num_used - num_cached,
        },
        "map": _runs(codes),
        "holders": holders,
        "sessions": [
            {"id": sid, "owner": owner, "kv_blocks": len(blocks), "state": "generating" if busy else "idle"}
            for sid, owner, blocks, busy, _ in state["sessions"]
        ],
    }


def _runs(codes: list[int]) -> list[list[int]]:
    """Run-length encoding: [[code, count], ...]."""
    return [[code, len(list(run))] for code, run in itertools.groupby(codes)]


def _shift(t: float | None, offset: float) -> float | None:
    return t + offset if t is not None else None


def _since(start: float, end: float | None) -> float | None:
    return end - start if end is not None else None
