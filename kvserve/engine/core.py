"""EngineCore: the single thread that owns the scheduler, the block pool and the model runner.

Nobody else touches KV state. Callers send messages into the inbox (add, abort, call, shutdown)
and read their own request's sink. The loop: apply every message that arrived, launch one step
(schedule -> execute), and on its result update the scheduler and deliver outputs; sleep on the
inbox when there is no work. Aborts therefore take effect at the next step boundary, at most one
step after they are sent.

A runner (`Runner`) computes a step at once (`ModelRunner`: its result comes back from `execute`)
or, a pipeline of stages (kvserve/pipeline), starts it and hands the result back later through
`step_done`; up to `runner.depth` steps are then in flight, each over other requests. A runner that
runs ahead (`runs_ahead`, async scheduling on a GPU) queues each step on the device and hands it back
through `collect`: the loop launches step n+1, over the same requests where the scheduler lets them go
ahead, before it takes back step n, so that the host's bookkeeping of step n runs while the device
computes step n+1.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol
from weakref import WeakSet

from kvserve.engine.block_pool import BlockPool
from kvserve.engine.burst import BurstGate
from kvserve.engine.grammar import Grammars, grammar_failure, grammar_param
from kvserve.engine.hooks import EngineHooks
from kvserve.engine.model_runner import RunnerOutput
from kvserve.engine.output_processor import RequestTextState
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.scheduler import Scheduler, SchedulerOutput
from kvserve.errors import EngineClosedError, EngineError, InvalidRequestError
from kvserve.text.tokenizer import Tokenizer

logger = logging.getLogger("kvserve.engine")


class Sink(Protocol):
    """Where a request's chunks go: a thread queue or an asyncio queue. Must not block."""

    def put(self, item: Any) -> None: ...


class Runner(Protocol):
    """Computes the engine's steps (ModelRunner in-process, PipelineRunner over stages)."""

    depth: int  # steps that may be in flight at once; 1: execute returns each step's result
    runs_ahead: bool  # execute queues the step, collect() hands back the oldest one (async scheduling)
    num_pending: int  # steps queued, running ahead, that collect() has not handed back

    def execute(self, out: SchedulerOutput, ticket: int = 0) -> RunnerOutput | None:
        """The step's result, or None when it comes back later through EngineCore.step_done(ticket, ...)."""

    def collect(self) -> tuple[int, RunnerOutput | Exception]:
        """Running ahead: the oldest queued step's (ticket, outcome), once the device has it."""

    def release(self, request_ids: list[str]) -> None:
        """Forget per-request state of finished requests."""

    def close(self) -> None: ...


@dataclass
class _Add:
    request: Request
    sink: Sink


@dataclass
class _Abort:
    request_ids: list[str]
    sink: Sink | None = None  # only a request streaming into this sink (not another's of the same id)


def _streams_into(held: Sink, sink: Sink) -> bool:
    """Whether a request's sink is `sink`, or wraps it (a session turn's reply sink)."""
    return held is sink or getattr(held, "wraps", None) is sink


@dataclass
class _Pause:
    request_ids: list[str]
    paused: bool


@dataclass
class _Call:
    fn: Callable[[], Any]
    future: Future


class _Shutdown:
    pass


@dataclass
class _StepDone:
    ticket: int
    outcome: RunnerOutput | Exception  # the result, or why the step failed


@dataclass
class _RunnerDied:
    reason: str


@dataclass
class _GrammarReady:
    request: Request  # its grammar compiled (or failed to): it may be scheduled now


# Every engine of this process: a child forked from it has none of their threads (see _forked).
_ENGINES: WeakSet[EngineCore] = WeakSet()


def _forked() -> None:
    """In a child made by fork(): an engine's thread did not come along, and a request queued for it
    would wait forever. Each is marked stopped, so that every call says so at once."""
    for engine in list(_ENGINES):
        engine._door = threading.Lock()  # another thread may have held it at the fork
        engine.death = (
            "this process was forked from the one whose LLM this is, and its engine thread runs only there; "
            "create the LLM in this process"
        )
        engine.is_closed = True


os.register_at_fork(after_in_child=_forked)


class EngineCore:
    def __init__(
        self,
        scheduler: Scheduler,
        build_runner: Callable[[EngineCore], Runner],
        tokenizer: Tokenizer,
        make_hooks: Callable[[EngineCore], EngineHooks] | None = None,
        gather: float = 0.0,
    ) -> None:
        self.scheduler = scheduler
        self.pool: BlockPool = scheduler.pool
        self.runner: Runner | None = None  # built on the engine thread by `build_runner`
        self.in_flight: dict[int, SchedulerOutput] = {}  # steps launched whose results are not back, by ticket
        self._tickets = itertools.count()
        self._stalled = False  # nothing could be scheduled beside the steps in flight: wait for a message
        # From idle, the first step waits until no request arrived for `gather` s (at most 8x): a burst of
        # requests then shares one prefill (engine/burst.py); 0 launches at once.
        self.burst = BurstGate(gather, 8 * gather)
        self.tokenizer = tokenizer
        self.grammars: Grammars | None = None  # structured output's grammars, once the runner is built
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.states: dict[str, tuple[RequestTextState, Sink]] = {}
        self.num_aborted_total = 0
        self.num_failed_total = 0
        self.steps_total = 0
        self.is_closed = False
        self.death: str | None = None  # why the engine thread stopped, if it did not stop on request
        # Held to check `is_closed` and queue a message, and to close: nothing is queued after the engine
        # thread's last look at its inbox, where nobody would answer it.
        self._door = threading.Lock()
        _ENGINES.add(self)
        self.on_death: Callable[[str], None] | None = None  # told why, on the engine thread (serve exits 1)
        # Called on the engine thread after every loop turn, once that turn's outputs are in their sinks
        # (the engine process sends one message per turn from here: outputs batched per step).
        self.after_turn: list[Callable[[], None]] = []
        # Told of every request admitted (on_admit) and every one that leaves (on_finished), on the engine
        # thread: the status monitor (engine/monitor.py).
        self.observers: list[Any] = []
        # State kept across requests (sessions) rides on the engine only through these hooks.
        self.hooks = make_hooks(self) if make_hooks is not None else None
        if self.hooks is not None:
            scheduler.reclaim = self.hooks.reclaim
        self._stats: dict[str, Any] = {}
        self._publish_stats()
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(build_runner,), name="kvserve-engine", daemon=True)
        self.thread.start()
        self._ready.wait()
        if self._start_error is not None:
            self.thread.join()
            raise self._start_error

    # ----- called from any thread ---------------------------------------------------------
    def add(self, request: Request, sink: Sink) -> None:
        with self._door:
            self._check_open()
            self.inbox.put(_Add(request, sink))

    def _check_open(self) -> None:
        if self.death is not None:
            raise EngineClosedError(f"The engine stopped ({self.death}); it cannot serve requests.")
        if self.is_closed:
            raise EngineClosedError("The engine is closed; create a new LLM to submit requests.")

    def abort(self, request_ids: list[str], sink: Sink | None = None) -> None:
        """Abort these requests; with `sink`, only where it is the request's own (a stream left before
        its refusal as a duplicate id arrived aborts nothing, not the request that holds the id)."""
        if not self.is_closed:
            self.inbox.put(_Abort(list(request_ids), sink))

    def pause(self, request_ids: list[str], paused: bool = True) -> None:
        """Hold requests out of the batch (their reader is not keeping up) or let them back
        (Scheduler.pause); unknown or finished ids are ignored."""
        if not self.is_closed:
            self.inbox.put(_Pause(list(request_ids), paused))

    def call(self, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        """Run `fn` on the engine thread at the next step boundary and return its result."""
        return self.post(fn).result(timeout)

    def post(self, fn: Callable[[], Any]) -> Future:
        """Queue `fn` for the engine thread; its result or exception arrives in the Future."""
        future: Future = Future()
        with self._door:
            self._check_open()
            self.inbox.put(_Call(fn, future))
        return future

    def stats(self) -> dict[str, Any]:
        return dict(self._stats)  # a snapshot the engine thread replaces after every step

    def problem(self) -> str | None:
        """Why this engine cannot serve (its thread died or was shut down), or None while it can."""
        if self.death is not None:
            return self.death
        if self.is_closed or not self.thread.is_alive():
            return "the engine is closed"
        return None

    def step_done(self, ticket: int, outcome: RunnerOutput | Exception) -> None:
        """A runner hands back a step it launched (any thread): its result, or why it failed."""
        self.inbox.put(_StepDone(ticket, outcome))

    def runner_died(self, reason: str) -> None:
        """A runner can compute no more steps (any thread): every request fails, the engine stops."""
        self.inbox.put(_RunnerDied(reason))

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Abort what runs and stop the engine thread (waiting up to `timeout`; not when called on it)."""
        if self.thread.is_alive():
            self.inbox.put(_Shutdown())
            if threading.current_thread() is not self.thread:
                self.thread.join(timeout)
        self.is_closed = True

    # ----- engine thread ------------------------------------------------------------------
    def _run(self, build_runner: Callable[[EngineCore], Runner]) -> None:
        try:
            self.runner = build_runner(self)
            self.grammars = Grammars(self.tokenizer, self.runner.model.config.vocab_size)
        except BaseException as exc:  # reported to the constructor's caller
            self._start_error = exc
            self.is_closed = True
            self._ready.set()
            return
        self.scheduler.run_ahead = self._runs_ahead
        self._ready.set()
        next_tick = 0.0  # the hooks' periodic work (session expiry) at most once a second, not every step
        try:
            while True:
                now = time.monotonic()
                holding = self.burst.holding(now)  # a first step after idle, waiting for the burst to gather
                block = holding or not (self._can_launch() or self._pending())
                # Idle: wake up now and then if the hooks have periodic work (sessions to expire).
                timeout = 1.0 if block and self.hooks is not None and self.hooks.wants_ticks() else None
                if holding:
                    timeout = min(timeout or math.inf, self.burst.deadline() - now)
                try:
                    message = self.inbox.get(block=block, timeout=timeout)
                except queue.Empty:
                    message = None
                if self.hooks is not None and time.monotonic() >= next_tick:
                    self.hooks.tick(time.monotonic())
                    next_tick = time.monotonic() + 1.0
                while message is not None:
                    self._stalled = False
                    if isinstance(message, _Shutdown):
                        if self.hooks is not None:
                            self.hooks.shutdown()
                        self._abort(list(self.scheduler.requests), RequestStatus.FINISHED_ABORTED)
                        return
                    if isinstance(message, _RunnerDied):
                        self._runner_died(message.reason)
                        return
                    if isinstance(message, _Add):
                        idle = not self.in_flight and not self.scheduler.requests
                        self.burst.arrival(time.monotonic(), idle)
                    self._apply(message)
                    try:
                        message = self.inbox.get_nowait()
                    except queue.Empty:
                        message = None
                if self._can_launch() and not self.burst.holding(time.monotonic()):
                    self._launch()
                self._take_back()
                self._publish_stats()
                self._end_turn()
        except BaseException as exc:  # a bug in the engine itself: fail everyone loudly, never hang them
            logger.exception("engine thread died")
            self.death = f"the engine thread died: {exc!r}"
            self._fail(list(self.states), EngineError("The engine thread died:\n" + traceback.format_exc()))
            self._tell_death()
            raise
        finally:
            with self._door:
                self.is_closed = True
            self._publish_stats()
            self._drain_inbox_after_close()
            self._end_turn()
            if self.grammars is not None:
                self.grammars.close()
            if self.runner is not None:
                while self._pending():  # steps still queued on the device: done before their memory goes
                    self.runner.collect()
                self.runner.close()

    def _runner_died(self, reason: str) -> None:
        logger.error("the engine stops: %s; every request fails and new ones are refused", reason)
        self.death = reason
        self.in_flight.clear()
        if self.hooks is not None:
            self.hooks.shutdown()
        everyone = list(dict.fromkeys([*self.scheduler.requests, *self.states]))  # queued or streaming, once each
        self._fail(everyone, EngineError(f"The engine stopped: {reason}."))
        self._tell_death()

    def _tell_death(self) -> None:
        if self.on_death is not None:
            try:
                self.on_death(self.death)
            except Exception:  # the listener's bug: the engine is stopping anyway
                logger.exception("on_death failed")

    def _apply(self, message: Any) -> None:
        if isinstance(message, _StepDone):
            self._step_done(message.ticket, message.outcome)
        elif isinstance(message, _Add):
            self.admit(message.request, message.sink)
        elif isinstance(message, _Abort):
            ids, sink = message.request_ids, message.sink
            if sink is not None:
                ids = [i for i in ids if (entry := self.states.get(i)) is not None and _streams_into(entry[1], sink)]
                if self.hooks is not None:  # a session turn still queued, streaming into it
                    self.hooks.drop_pending(set(message.request_ids) - set(ids), sink)
            self._abort(ids, RequestStatus.FINISHED_ABORTED, sink)
        elif isinstance(message, _Pause):
            self.scheduler.pause(message.request_ids, message.paused)
        elif isinstance(message, _GrammarReady):
            self._grammar_ready(message.request)
        elif isinstance(message, _Call):
            try:
                message.future.set_result(message.fn())
            except BaseException as exc:
                message.future.set_exception(exc)

    def admit(self, request: Request, sink: Sink | None) -> bool:
        """Hand a request to the scheduler (engine thread). A None sink: internal, no output. False:
        refused, its id being in use (the error is in the sink)."""
        if request.request_id in self.states or request.request_id in self.scheduler.requests:
            if sink is not None:
                sink.put(InvalidRequestError(f"Request id {request.request_id!r} is already in use.", "request_id"))
            return False
        if sink is not None:
            self.states[request.request_id] = (RequestTextState(request, self.tokenizer), sink)
        spec = request.params.structured_output
        if spec is not None and request.grammar is None:  # it waits in the queue until compiled
            request.grammar = self.grammars.start(spec, lambda: self.inbox.put(_GrammarReady(request)))
        self.scheduler.add_request(request)
        for observer in self.observers:
            observer.on_admit(request)
        return True

    def _grammar_ready(self, request: Request) -> None:
        if self.scheduler.requests.get(request.request_id) is not request or request.grammar is None:
            return  # finished meanwhile
        problem = request.grammar.take()
        if problem is not None:
            error = InvalidRequestError(f"The request's grammar cannot be used: {problem}", grammar_param(request))
            self._fail([request.request_id], error)

    @property
    def _runs_ahead(self) -> bool:
        return getattr(self.runner, "runs_ahead", False)

    def _pending(self) -> int:
        return self.runner.num_pending if self._runs_ahead else 0

    def _take_back(self) -> None:
        """Running ahead: take back the oldest step once the next is queued behind it (the device
        stays busy meanwhile), or when no step can start beside it."""
        while self._pending() and (self._pending() > 1 or not self._can_launch()):
            ticket, outcome = self.runner.collect()
            self._stalled = False
            self._step_done(ticket, outcome, rerun=False)

    def _can_launch(self) -> bool:
        return (
            not self._stalled
            and self.scheduler.has_ready_work
            and len(self.in_flight) < (self.runner.depth if self.runner is not None else 1)
        )

    def _launch(self) -> None:
        """Schedule a step and start it. With a pipeline (depth > 1) the requests are split into about
        depth micro-batches, so that every stage has one to work on."""
        depth = self.runner.depth
        share = None
        if depth > 1 and not self._runs_ahead:
            share = math.ceil((len(self.scheduler.running) + len(self.scheduler.waiting)) / depth)
        out = self.scheduler.schedule(share)
        failed = self.grammars.fill_masks(out)
        if failed:  # a grammar hit the engine's limits: its request fails, before the step
            ids = {request_id for request_id, _ in failed}
            out.scheduled = [item for item in out.scheduled if item.request_id not in ids]
            for request_id, why in failed:
                request = out.requests.pop(request_id, None)
                self._fail([request_id], grammar_failure(why, grammar_param(request)))
        if out.is_empty:
            self._stalled = bool(self.in_flight)  # blocks wait for a step in flight: wait for its result
            return
        self._submit(out)

    def _submit(self, out: SchedulerOutput) -> None:
        ticket = next(self._tickets)
        self.in_flight[ticket] = out
        try:
            outcome: RunnerOutput | Exception | None = self.runner.execute(out, ticket)
        except Exception as exc:
            outcome = exc
        if outcome is not None:
            self._step_done(ticket, outcome)

    def _step_done(self, ticket: int, outcome: RunnerOutput | Exception, rerun: bool = True) -> None:
        out = self.in_flight.pop(ticket, None)
        if out is None:  # the engine stopped waiting for it
            return
        if isinstance(outcome, Exception):
            self._step_failed(out, outcome, rerun)
            return
        self.steps_total += 1
        updated = self.scheduler.update_from_output(out, outcome.sampled)
        finished = []
        for request in updated:
            if request.prefill_only:
                self._on_finished(request)
                finished.append(request.request_id)  # the runner forgets it too (a pipeline's stages: its copies)
                continue
            if request.grammar is not None:
                if request.is_finished:  # at its length limit with this token
                    self._last_grammar_token(request)
                elif not self._advance_grammar(request):
                    continue
            state, sink = self.states[request.request_id]
            try:  # detokenizing and stop strings: a failure here, too, ends only this request
                state.add_token(request.output_token_ids[-1], is_last=request.is_finished)
            except Exception as exc:
                logger.exception("request %s failed while detokenizing", request.request_id)
                if request.is_finished:  # already out of the scheduler: the hooks hear it failed
                    request.status = RequestStatus.FINISHED_ERROR
                    self._on_finished(request)
                self._fail([request.request_id], EngineError(f"Detokenizing this request's output failed: {exc!r}"))
                continue
            if state.stopped_by_string is not None:
                if not request.is_finished:
                    self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED)
                elif request.status is RequestStatus.FINISHED_LENGTH:  # the stop string came with the last token
                    request.status = RequestStatus.FINISHED_STOPPED
            logprobs = outcome.logprobs.get(request.request_id)
            if request.is_finished:  # the hooks (a session turn's record) hear the end before its caller
                finished.append(request.request_id)
                self._on_finished(request, state.text)
            sink.put(state.chunk([logprobs] if logprobs is not None else None))
        self._forget(finished)

    def _last_grammar_token(self, request: Request) -> None:
        """A constrained request that reached its length limit with this token: where the token completes
        its grammar, the answer is whole and the request stopped (as a stop token or string at its last
        token says too), so that a client's parse of a whole answer never reads "length"."""
        grammar, request.grammar = request.grammar, None  # its matcher goes with it, as at any finish
        if grammar.accept(request.output_token_ids[-1]) and grammar.is_finished:
            request.status = RequestStatus.FINISHED_STOPPED

    def _advance_grammar(self, request: Request) -> bool:
        """Feed a constrained request's new token to its grammar; where the grammar is complete the
        request ends. False (the request failed) if the grammar refused the token."""
        grammar = request.grammar
        if not grammar.accept(request.output_token_ids[-1]):
            self._fail([request.request_id], grammar_failure(grammar.error, grammar_param(request)))
            return False
        if grammar.is_finished:
            self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED)
        return True

    def _step_failed(self, out: SchedulerOutput, exc: Exception, rerun: bool = True) -> None:
        """A step failed: run each of its requests alone and fail only those that still fail, so one
        request's bad input never ends the requests batched with it. Writing a position's K/V twice
        is harmless (same slot, same values), and nothing in the scheduler has advanced before
        `update_from_output`. Not `rerun`: a queued step whose results could not be copied back (the
        device failed, after later steps took its tokens): its requests fail."""
        live = []
        for item in out.scheduled:
            request = out.requests[item.request_id]
            if self.scheduler.requests.get(item.request_id) is request:
                live.append(item)
            else:  # finished meanwhile (aborted while a pipeline computed it): its blocks may be another's
                self.scheduler.in_flight.discard(request)
        if not rerun and live:
            logger.error("a queued step of %d requests failed", len(live), exc_info=exc)
            self._fail(
                [item.request_id for item in live], EngineError(f"The model failed on this request's step: {exc!r}")
            )
        elif len(live) > 1:
            logger.warning("a step of %d requests failed (%r); running them one by one", len(live), exc)
            for item in live:
                self._submit(out.only(item))
        elif live:
            logger.error("request %s failed in the model step", live[0].request_id, exc_info=exc)
            self._fail([live[0].request_id], EngineError(f"The model failed on this request's step: {exc!r}"))

    def abort_now(self, request_ids: list[str]) -> None:
        """Abort on the engine thread (the hooks' owner uses it: session interrupts and closes)."""
        self._abort(request_ids, RequestStatus.FINISHED_ABORTED)

    def _abort(self, request_ids: list[str], status: RequestStatus, sink: Sink | None = None) -> None:
        finished = self.scheduler.finish_requests(request_ids, status)
        for request in finished:
            entry = self.states.get(request.request_id)
            if entry is not None:
                entry[1].put(entry[0].chunk())
            self._on_finished(request)
        self.num_aborted_total += sum(1 for r in finished if not r.prefill_only)
        if self.hooks is not None:  # e.g. a session turn still waiting behind another one
            self.hooks.drop_pending(set(request_ids) - {r.request_id for r in finished}, sink)
        self._forget([r.request_id for r in finished])

    def _on_finished(self, request: Request, text: str = "") -> None:
        if self.hooks is not None:
            self.hooks.on_finished(request, text)
        for observer in self.observers:
            observer.on_finished(request)

    def _fail(self, request_ids: list[str], error: Exception) -> None:
        for request in self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ERROR):
            self._on_finished(request)
        for request_id in request_ids:
            entry = self.states.get(request_id)
            if entry is not None:
                entry[1].put(error)
        self.num_failed_total += len(request_ids)
        self._forget(request_ids)

    def _forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.states.pop(request_id, None)
        self.runner.release(request_ids)

    def _drain_inbox_after_close(self) -> None:
        """Requests that raced with shutdown are told so instead of waiting forever."""
        while True:
            try:
                message = self.inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(message, _Add):
                message.sink.put(EngineClosedError("The engine closed before this request started."))
            elif isinstance(message, _Call):
                message.future.set_exception(EngineClosedError("The engine is closed."))

    def _end_turn(self) -> None:
        for listener in self.after_turn:
            listener()

    def _publish_stats(self) -> None:
        s, pool = self.scheduler, self.pool
        self._stats = {
            "num_running": len(s.running),
            "num_waiting": len(s.waiting),
            "num_paused": s.num_paused,
            "kv_blocks_total": pool.num_blocks,
            "kv_blocks_used": pool.num_used_blocks,
            "kv_blocks_cached": pool.num_cached_blocks,
            "kv_block_size": pool.block_size,
            "num_preemptions_total": s.stats.num_preemptions_total,
            "num_aborted_total": self.num_aborted_total,
            "num_failed_total": self.num_failed_total,
            "prompt_tokens_total": s.stats.prompt_tokens_total,
            "prefix_cache_hit_tokens_total": s.stats.prefix_cache_hit_tokens_total,
            "generation_tokens_total": s.stats.generation_tokens_total,
            "steps_total": self.steps_total,
            "is_closed": self.is_closed,
            **(self.hooks.stats() if self.hooks is not None else {}),
        }
