"""The engine in a process of its own, the HTTP front end in another (`kvserve serve`'s default).

The engine process holds one `LLM`: the engine thread and with it every piece of KV state (the
scheduler, the block pool, the sessions), as in-process. It shares no interpreter lock with the
front end, which parses HTTP, tokenizes, checks, and frames server-sent events. They talk over two
ZeroMQ PUSH/PULL pipes on Unix sockets, one each way, in pickled tuples:

    front end -> engine                               engine -> front end
    ("add", Request)        tokenized and checked     ("ready", info) | ("failed", reason)  once
    ("turn", session, owner, params, interrupt, id,   ("out", [(request id, chunk | error)], stats)
        announce)                                         one message per engine loop turn
    ("abort", [request ids])
    ("pause", [request ids], paused)  a stream's client is not reading (or is again)
    ("call", call id, op, args)  sessions, health     ("result", call id, ok, value)
    ("ping",)               when it heard nothing     ("pong",)  from the main thread, at once (none
                                                          while a session store write is in progress)
    ("shutdown",)

A request's chunks are still made on the engine thread (detokenized, cut at stop strings, so a stop
string ends the request in the step that produced it); they leave as one message per step.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import pickle
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import zmq

from kvserve.errors import EngineError, InvalidRequestError
from kvserve.llm import LLM
from kvserve.processes import die_with_parent, freeze_startup_heap
from kvserve.server.state import ServerSettings
from kvserve.server.status_ops import STATUS_OPERATIONS
from kvserve.sessions.session import Session

logger = logging.getLogger("kvserve.engine")


def build_llm(settings: ServerSettings) -> LLM:
    """The LLM that `settings` describe (in the engine process, or in-process with --engine-process off)."""
    return LLM(
        settings.model,
        dtype=settings.dtype,
        weights=settings.weights,
        activations=settings.activations,
        batch_invariant=settings.batch_invariant,
        cuda_graphs=settings.cuda_graphs,
        async_scheduling=settings.async_scheduling,
        kv_cache_tokens=settings.kv_cache_tokens,
        kv_cache_dtype=settings.kv_cache_dtype,
        max_num_seqs=settings.max_num_seqs,
        gather_ms=settings.gather_ms,
        max_sessions=settings.max_sessions,
        max_sessions_per_owner=settings.max_sessions_per_key,
        session_ttl=settings.session_ttl,
        session_db=settings.session_db,
        max_session_tokens=settings.max_session_tokens,
        max_message_bytes=settings.max_message_bytes,
        pipeline=settings.pipeline,
    )


def dumps(message: tuple) -> bytes:
    """Pickle a message; an error that does not pickle travels as an EngineError with its text."""
    try:
        return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        return pickle.dumps(tuple(_picklable(part) for part in message), protocol=pickle.HIGHEST_PROTOCOL)


def _picklable(value: Any) -> Any:
    if isinstance(value, BaseException):
        try:
            pickle.dumps(value)
        except Exception:
            return EngineError(f"{type(value).__name__}: {value}")
        return value
    if isinstance(value, list):
        return [_picklable(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_picklable(item) for item in value)
    return value


class Outbox:
    """The engine -> front end pipe. The engine thread's sinks buffer their chunks here and
    `flush` (run after each engine loop turn) sends them as one message, with the stats when they
    changed. Call results are sent at once. Sends are serialized by a lock (a ZeroMQ socket is not
    thread-safe)."""

    def __init__(self, context: zmq.Context, address: str) -> None:
        self.socket = context.socket(zmq.PUSH)
        # No high-water mark, and no blocking send: the engine thread never waits on the front end;
        # with the front end gone (no peer) a message is dropped, and the process exits within a second.
        self.socket.setsockopt(zmq.SNDHWM, 0)
        self.socket.setsockopt(zmq.LINGER, 1000)
        self.socket.connect(address)
        self.lock = threading.Lock()
        self.pending: list[tuple[str, Any]] = []
        self.stats: dict[str, Any] | None = None
        self.llm: LLM | None = None

    def put(self, request_id: str, item: Any) -> None:
        with self.lock:
            self.pending.append((request_id, item))

    def send(self, message: tuple) -> None:
        data = dumps(message)
        with self.lock:
            self._send(data)

    def _send(self, data: bytes) -> None:
        try:
            self.socket.send(data, zmq.NOBLOCK)
        except zmq.Again:  # no front end connected any more
            logger.debug("dropped a message: the front end is gone")

    def flush(self) -> None:
        stats = self.llm.stats() if self.llm is not None else None
        with self.lock:
            if not self.pending and stats == self.stats:
                return
            items, self.pending, self.stats = self.pending, [], stats
            self._send(dumps(("out", items, stats)))


class RemoteSink:
    """A request's sink in the engine process: its chunks go to the outbox, tagged with its id."""

    __slots__ = ("outbox", "request_id")

    def __init__(self, outbox: Outbox, request_id: str) -> None:
        self.outbox, self.request_id = outbox, request_id

    def put(self, item: Any) -> None:
        self.outbox.put(self.request_id, item)


def _session(llm: LLM, session_id: str, owner: str | None) -> Session:
    if llm.sessions is None:
        raise InvalidRequestError("Sessions need the prefix cache, which this server runs without.")
    return Session(llm.client, llm.sessions, session_id, owner)


def _session_op(llm: LLM, session_id: str, owner: str | None, method: str, args: tuple) -> Any:
    result = getattr(_session(llm, session_id, owner), method)(*args)
    return result.id if isinstance(result, Session) else result


# The operations a front end may ask for by name; each runs on a worker thread of the engine process.
OPERATIONS = {
    "session_new": lambda llm, system, messages, ttl, owner: llm.session(system, messages, ttl=ttl, owner=owner).id,
    "session_get": lambda llm, session_id, owner: llm.session(id=session_id, owner=owner).id,
    "session": _session_op,
    "problem": lambda llm: llm.problem(),
    "check_integrity": lambda llm: llm.check_integrity(),
    "runner_timings": lambda llm: llm.runner_timings(),
    "frozen_objects": lambda llm: gc.get_freeze_count(),  # freeze_startup_heap's
    **STATUS_OPERATIONS,  # the status routes' reads (status_ops.py)
}
SESSION_METHODS = frozenset({"info", "add_message", "append", "fork", "close", "interrupt"})


def main(settings: ServerSettings, to_engine: str, from_engine: str) -> None:
    """The engine process: load the model, say ready (or why not), then serve until told to stop or
    until the front end's process is gone."""
    # Ctrl-C reaches the whole group, and a service manager's SIGTERM may too: the front end decides
    # (it ends the requests, then sends "shutdown"); this process dies with it in any case.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    die_with_parent()
    logging.basicConfig(format="%(levelname)s:     %(name)s: %(message)s")
    logging.getLogger("kvserve").setLevel(settings.log_level.upper())  # a spawned process starts at WARNING
    context = zmq.Context()
    inbox = context.socket(zmq.PULL)
    inbox.connect(to_engine)
    outbox = Outbox(context, from_engine)
    try:
        llm = build_llm(settings)
    except Exception as exc:
        outbox.send(("failed", f"{type(exc).__name__}: {exc}"))
        outbox.socket.close()
        return
    outbox.llm = llm
    llm.engine.after_turn.append(outbox.flush)
    freeze_startup_heap("engine")
    info = {
        "model_path": str(llm.model_path),
        "vocab_size": llm.model.config.vocab_size,
        "max_model_len": llm.config.max_model_len,
        "stats": llm.stats(),  # /metrics has real figures before the first request
        # owners are keyed with the store's secret (the front end computes them): they survive restarts
        "owner_secret": llm.session_store.owner_secret if llm.session_store is not None else None,
    }
    outbox.send(("ready", info))
    try:
        _serve(llm, inbox, outbox)
    finally:
        llm.close()  # aborts what is left; the engine's last turn flushes those chunks
        outbox.send(("closed",))
        inbox.close(linger=0)
        outbox.socket.close()
        context.term()


def _store_write_since(llm: LLM) -> float | None:
    """When the session store's write in progress began (time.monotonic()), or None."""
    store = llm.session_store
    return store.writing_since if store is not None else None


def _serve(llm: LLM, inbox: zmq.Socket, outbox: Outbox) -> None:
    parent = multiprocessing.parent_process()
    workers = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kvserve-call")
    engine = llm.engine
    warned_for = None  # the store write last warned about
    try:
        while True:
            if engine.death is not None:  # a lost pipeline stage: for good; the front end exits too
                logger.error("the engine stopped (%s); the engine process exits", engine.death)
                outbox.send(("died", engine.death))  # the front end's requests and log say why, not "code 0"
                return
            if not inbox.poll(1000):
                if parent is not None and not parent.is_alive():
                    logger.error("the front end's process is gone; the engine process stops")
                    return
                continue
            message = pickle.loads(inbox.recv())
            kind = message[0]
            if kind == "add":
                request = message[1]
                try:
                    engine.add(request, RemoteSink(outbox, request.request_id))
                except Exception as exc:  # the engine is closed
                    outbox.send(("out", [(request.request_id, exc)], None))
            elif kind == "turn":
                _, session_id, owner, params, interrupt, request_id, announce = message
                sink = RemoteSink(outbox, request_id)
                try:
                    _, start = _session(llm, session_id, owner).start_turn(params, interrupt, request_id, announce)
                    start(sink)
                except Exception as exc:
                    outbox.send(("out", [(request_id, exc)], None))
            elif kind == "abort":  # by id: a session turn's stream lives here only as a RemoteSink
                engine.abort(message[1])
            elif kind == "pause":
                engine.pause(message[1], message[2])
            elif kind == "call":
                workers.submit(_call, llm, outbox, *message[1:])
            elif kind == "ping":
                # The engine thread in a store write (its disk frozen, or slow) serves nobody meanwhile: no
                # pong, so that past --stage-timeout the front end fails its requests and answers 503, as
                # for an engine that stopped. A write takes milliseconds: a ping missed then costs nothing.
                since = _store_write_since(llm)
                if since is None:
                    outbox.send(("pong",))
                elif since != warned_for and time.monotonic() - since > 1.0:
                    warned_for = since
                    logger.warning("a session store write has taken over 1 s (is its disk answering?)")
            elif kind == "shutdown":
                return
    finally:
        workers.shutdown(wait=False, cancel_futures=True)


def _call(llm: LLM, outbox: Outbox, call_id: int, op: str, args: tuple) -> None:
    try:
        if op == "session" and args[2] not in SESSION_METHODS:
            raise InvalidRequestError(f"Unknown session operation {args[2]!r}.")
        outbox.send(("result", call_id, True, OPERATIONS[op](llm, *args)))
    except BaseException as exc:
        outbox.send(("result", call_id, False, exc))
