"""EngineClient: how callers on other threads (LLM, Session) talk to the engine thread.

A request is submitted with a sink of the caller's kind (a thread queue, or an asyncio queue on the
caller's loop) and its chunks are read from that sink. Leaving a stream early (break, exception,
garbage collection, task cancellation) aborts the request through the engine's one abort path.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from kvserve.engine.core import EngineCore, Sink
from kvserve.engine.request import Request
from kvserve.errors import KVServeError
from kvserve.outputs import StreamChunk

Start = Callable[[Sink], None]  # submits a request whose chunks go to the given sink


class ThreadSink(queue.SimpleQueue):
    """A request's chunks for a reader thread."""


class _Mailbox:
    """What the engine thread hands one asyncio loop, delivered in order, with one wake-up of the loop
    for everything posted before it runs: a step's chunks for 64 streams cost one call_soon_threadsafe
    (a write to the loop's self-pipe), not 64."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            self.loop = weakref.ref(loop)  # the mailboxes are kept by loop, weakly
        except TypeError:  # a loop without weak references (an extension type's): held for good
            self.loop = lambda: loop
        self.lock = threading.Lock()
        self.items: list[tuple[asyncio.Queue, Any]] = []

    def post(self, inbox: asyncio.Queue, item: Any) -> None:
        with self.lock:
            self.items.append((inbox, item))
            if len(self.items) > 1:  # a wake-up is on its way
                return
        loop = self.loop()
        with contextlib.suppress(RuntimeError, AttributeError):  # a closed or gone loop: nobody listens
            loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self.lock:
            items, self.items = self.items, []
        for inbox, item in items:
            inbox.put_nowait(item)


_mailboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Mailbox] = weakref.WeakKeyDictionary()
_held_mailboxes: dict[int, _Mailbox] = {}  # by id, for loops without weak references (never freed)
_mailboxes_lock = threading.Lock()


def _mailbox(loop: asyncio.AbstractEventLoop) -> _Mailbox:
    try:
        weakref.ref(loop)
        store, key = _mailboxes, loop
    except TypeError:  # no weak reference to this loop: held by its id
        store, key = _held_mailboxes, id(loop)
    with _mailboxes_lock:
        mailbox = store.get(key)
        if mailbox is None:
            mailbox = store[key] = _Mailbox(loop)
        return mailbox


class AsyncSink:
    """A request's chunks delivered into an asyncio queue on the reader's own loop, through the loop's
    mailbox."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.mailbox = _mailbox(loop)

    def put(self, item: Any) -> None:
        self.mailbox.post(self.queue, item)


class EngineClient:
    def __init__(self, engine: EngineCore) -> None:
        self.engine = engine

    def submit(self, request: Request) -> ThreadSink:
        """Start `request`; its chunks arrive in the returned sink (read them with `chunks`)."""
        sink = ThreadSink()
        self.engine.add(request, sink)
        return sink

    def stream(self, request: Request) -> Iterator[StreamChunk]:
        return self.stream_with(request.request_id, lambda sink: self.engine.add(request, sink), own=True)

    def stream_with(self, request_id: str, start: Start, own: bool = False) -> Iterator[StreamChunk]:
        """Yield a request's chunks; `start(sink)` submits it. Leaving early aborts `request_id`; with
        `own` (the request, or the session turn waiting for its place, streams into this sink), only if
        it is this stream's."""
        sink = ThreadSink()
        start(sink)
        finished = False
        try:
            for chunk in chunks(sink):
                finished = chunk.finish_reason is not None
                yield chunk
        except KVServeError:  # the engine already finished (or refused) this request
            finished = True
            raise
        finally:
            if not finished:
                self.engine.abort([request_id], sink if own else None)

    def astream(self, request: Request) -> AsyncIterator[StreamChunk]:
        return self.astream_with(request.request_id, lambda sink: self.engine.add(request, sink), own=True)

    async def astream_with(self, request_id: str, start: Start, own: bool = False) -> AsyncIterator[StreamChunk]:
        """asyncio twin of `stream_with`: `start(sink)` submits; leaving early aborts `request_id`."""
        sink = AsyncSink(asyncio.get_running_loop())
        start(sink)
        abort = lambda: self.engine.abort([request_id], sink if own else None)  # noqa: E731
        async with contextlib.aclosing(read_chunks(sink.queue, abort)) as stream:
            async for chunk in stream:
                yield chunk

    def call(self, fn: Callable[[], Any], timeout: float | None = 600) -> Any:
        """Run `fn` on the engine thread at the next step boundary and return its result."""
        return self.engine.call(fn, timeout)

    def post(self, fn: Callable[[], Any], sink: Sink) -> None:
        """Run `fn` on the engine thread without waiting; an exception from it goes to `sink` (the
        stream of the request it was to start)."""
        future = self.engine.post(fn)
        future.add_done_callback(lambda f: sink.put(f.exception()) if f.exception() is not None else None)

    def abort(self, request_ids: list[str]) -> None:
        self.engine.abort(request_ids)

    def pause(self, request_ids: list[str], paused: bool = True) -> None:
        self.engine.pause(request_ids, paused)


def chunks(sink: ThreadSink) -> Iterator[StreamChunk]:
    """A request's chunks from its sink until the last one; an error in the sink is raised."""
    while True:
        item = sink.get()
        if isinstance(item, BaseException):
            raise item
        yield item
        if item.finish_reason is not None:
            return


async def read_chunks(queue: asyncio.Queue, abort: Callable[[], None]) -> AsyncIterator[StreamChunk]:
    """A request's chunks from its asyncio queue until the last; an error in the queue is raised.
    Leaving before the last chunk (break, exception, cancellation, aclose) calls `abort`."""
    finished = False
    try:
        while True:
            item = await queue.get()
            if isinstance(item, BaseException):  # the engine already finished (or refused) it
                finished = True
                raise item
            finished = item.finish_reason is not None
            yield item
            if finished:
                return
    finally:
        if not finished:
            abort()
