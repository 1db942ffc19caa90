"""The front end's handle on an engine process (engine_process.py): what the routes use of an `LLM`
(astream, abort, sessions, stats, problem), implemented over the two ZeroMQ pipes.

Prompts are tokenized and checked here, in the front end (`RequestBuilder`, as `LLM` does), so a
bad prompt never reaches the engine. One asyncio task reads the engine's messages and puts each
chunk in its request's queue; leaving a stream early sends an abort, applied by the engine at its
next step boundary. If the engine process dies, every stream and call fails with EngineError at
once, later ones with EngineClosedError (503), and `problem()` says why (/health answers 503); then
`on_death` is called (`kvserve serve` exits non-zero, for a supervisor to restart it).

An engine process that is alive but silent (stopped, hung) is noticed too: the front end pings it
when it has heard nothing for HEARTBEAT_INTERVAL, and after `engine_timeout` seconds without a word
it fails every stream and call in flight (aborting them, for when it answers again), refuses new
ones with 503 and reports it on /health, until the engine process is heard from again.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import pickle
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import zmq
import zmq.asyncio

from kvserve.engine.client import read_chunks
from kvserve.errors import EngineClosedError, EngineError, InvalidRequestError, KVServeError
from kvserve.outputs import StreamChunk
from kvserve.prompts import Prompt, RequestBuilder
from kvserve.sampling_params import SamplingParams
from kvserve.server import engine_process
from kvserve.server.state import ServerSettings
from kvserve.text.tokenizer import Tokenizer

logger = logging.getLogger("kvserve.server")
CALL_TIMEOUT = 600.0  # a session call waits behind the engine's current step, like LLM's calls
PROBLEM_TIMEOUT = 5.0  # /health: an engine process that does not answer this fast is reported
HEARTBEAT_INTERVAL = 0.25  # an engine process not heard from for this long is pinged


class EngineProcessError(KVServeError):
    """The engine process could not start (the model failed to load) or is gone."""


class RemoteLLM:
    """Start with `await RemoteLLM.start(settings)` on the server's event loop; `close()` stops it."""

    def __init__(self, settings: ServerSettings) -> None:
        self._dir = tempfile.mkdtemp(prefix="kvserve-ipc-")
        self._context = zmq.asyncio.Context()
        self._to_engine = zmq.Context.instance().socket(zmq.PUSH)
        self._to_engine.setsockopt(zmq.LINGER, 0)
        self._to_engine.setsockopt(zmq.SNDHWM, 0)  # never refuse work for a full pipe; admission limits it
        self._send_lock = threading.Lock()
        self._from_engine = self._context.socket(zmq.PULL)
        to_address, from_address = f"ipc://{self._dir}/to-engine", f"ipc://{self._dir}/from-engine"
        self._to_engine.bind(to_address)
        self._from_engine.bind(from_address)
        self.process = multiprocessing.get_context("spawn").Process(
            target=engine_process.main, args=(settings, to_address, from_address), name="kvserve-engine", daemon=True
        )
        self.streams: dict[str, asyncio.Queue] = {}
        self._calls: dict[int, Future] = {}
        self._call_ids = itertools.count()
        self._stats: dict[str, Any] = {}
        self.death: str | None = None
        self._why_stopped: str | None = None  # what the engine process said before it exited
        self._said_closed: asyncio.Event | None = None  # set when its last message ("closed") arrives
        self._last_words: asyncio.Future | None = None  # waits for that message once the process has exited
        self.silence: str | None = None  # why the engine process counts as not answering, while it does
        self.on_death: Callable[[str], None] | None = None  # called once the process has died unasked
        self._timeout = settings.engine_timeout
        self._heard = time.monotonic()  # when the engine process last sent anything
        self._closing = False
        self._loaded = False  # the engine process said it is ready
        self._reader: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None

    @classmethod
    async def start(cls, settings: ServerSettings) -> RemoteLLM:
        """Spawn the engine process and wait until its model is loaded (EngineProcessError if it fails)."""
        self = cls(settings)
        loop = asyncio.get_running_loop()
        self.process.start()
        died = loop.create_future()
        loop.add_reader(self.process.sentinel, lambda: died.done() or died.set_result(None))
        try:
            first = asyncio.ensure_future(self._from_engine.recv())
            done, _ = await asyncio.wait({first, died}, return_when=asyncio.FIRST_COMPLETED)
            if first not in done:
                first.cancel()
                raise EngineProcessError(f"The engine process exited (code {self.process.exitcode}) while loading.")
            message = pickle.loads(first.result())
            if message[0] == "failed":
                raise EngineProcessError(message[1])
            self._loaded = True
            info = message[1]
            self.model_path = Path(info["model_path"])
            self.tokenizer = await asyncio.to_thread(Tokenizer.from_model_path, self.model_path)
            self.tokenizer.keep_below(info["vocab_size"])  # as the engine process's (llm._check_vocabularies)
            await asyncio.to_thread(getattr, self.tokenizer, "token_bytes")  # logprobs' bytes: built once, here
            self.config = SimpleNamespace(max_model_len=info["max_model_len"])
            self._stats = info["stats"]
            self.owner_secret: bytes | None = info["owner_secret"]
            self.request_builder = RequestBuilder(self.tokenizer, info["vocab_size"], info["max_model_len"])
        except BaseException:
            loop.remove_reader(self.process.sentinel)
            await asyncio.to_thread(self.close)
            raise
        self._said_closed = asyncio.Event()
        died.add_done_callback(lambda _: self._exited())
        self._heard = time.monotonic()
        self._reader = asyncio.ensure_future(self._read())
        self._watcher = asyncio.ensure_future(self._watch())
        return self

    # ----- requests ----------------------------------------------------------------------------
    def encode_prompt(self, prompt: Prompt) -> list[int]:
        return self.request_builder.encode_prompt(prompt)

    def astream(
        self, prompt: Prompt, params: SamplingParams | None = None, *, request_id: str | None = None
    ) -> AsyncIterator[StreamChunk]:
        """As `LLM.astream`: the prompt is checked now; the request starts on first iteration."""
        self._check_alive()
        request = self.request_builder.build(prompt, params, request_id)
        return self._stream(request.request_id, ("add", request))

    def abort(self, request_ids: str | list[str]) -> None:
        self._send(("abort", [request_ids] if isinstance(request_ids, str) else list(request_ids)))

    def pause(self, request_ids: str | list[str], paused: bool = True) -> None:
        self._send(("pause", [request_ids] if isinstance(request_ids, str) else list(request_ids), paused))

    async def _stream(self, request_id: str, message: tuple) -> AsyncIterator[StreamChunk]:
        self._check_alive()
        if request_id in self.streams:
            raise InvalidRequestError(f"Request id {request_id!r} is already in use.", "request_id")
        queue: asyncio.Queue = asyncio.Queue()
        self.streams[request_id] = queue
        try:
            self._send(message)
            async with contextlib.aclosing(read_chunks(queue, lambda: self._abort_left(request_id))) as stream:
                async for chunk in stream:
                    yield chunk
        finally:
            self.streams.pop(request_id, None)

    def _abort_left(self, request_id: str) -> None:
        """A stream left before its last chunk: abort it, unless the engine process is gone."""
        if self.death is None:
            with contextlib.suppress(KVServeError):
                self.abort([request_id])

    # ----- sessions ----------------------------------------------------------------------------
    def session(self, system=None, messages=None, *, id: str | None = None, ttl=None, owner=None) -> RemoteSession:
        """As `LLM.session`: a new session, or with `id` an existing one (SessionNotFoundError if not)."""
        if id is not None:
            return RemoteSession(self, self.call("session_get", id, owner), owner)
        return RemoteSession(self, self.call("session_new", system, messages, ttl, owner), owner)

    # ----- calls and health --------------------------------------------------------------------
    def call(self, op: str, *args: Any, timeout: float = CALL_TIMEOUT) -> Any:
        """Run a named operation (engine_process.OPERATIONS) in the engine process; from any thread
        but the event loop's."""
        self._check_alive()
        call_id = next(self._call_ids)
        future: Future = Future()
        self._calls[call_id] = future
        try:
            self._send(("call", call_id, op, args))
            return future.result(timeout)
        except TimeoutError:
            raise EngineError(f"The engine process did not answer {op!r} within {timeout:g} s.") from None
        finally:
            self._calls.pop(call_id, None)

    def stats(self) -> dict[str, Any]:
        """The engine's stats as of its last loop turn that changed them."""
        return dict(self._stats)

    def problem(self) -> str | None:
        if self.death is not None:
            return self.death
        if self.silence is not None:
            return self.silence
        try:
            return self.call("problem", timeout=min(PROBLEM_TIMEOUT, self._timeout))
        except KVServeError as exc:
            return str(exc)

    def check_integrity(self) -> dict[str, Any]:
        return self.call("check_integrity", timeout=60)

    def close(self) -> None:
        """Ask the engine process to stop (it aborts what is left), wait for it, then kill it if it must."""
        self._closing = True
        if self.process.is_alive() and not self._loaded:  # still loading: nothing to finish or to save
            self.process.kill()
            self.process.join(5)
        if self.process.is_alive():
            with contextlib.suppress(KVServeError, zmq.ZMQError):
                self._send(("shutdown",))
            self.process.join(30)
        if self.process.is_alive():
            logger.error("the engine process did not stop within 30 s; killing it")
            self.process.kill()
            self.process.join(5)
        if self._watcher is not None:
            with contextlib.suppress(RuntimeError):
                self._watcher.get_loop().call_soon_threadsafe(self._watcher.cancel)
        if self._reader is not None:  # the reader closes its socket as it ends, on its own loop
            with contextlib.suppress(RuntimeError):  # a closed loop
                self._reader.get_loop().call_soon_threadsafe(self._reader.cancel)
        else:
            self._from_engine.close(linger=0)
        self._to_engine.close(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)

    # ----- plumbing ----------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self.death is not None:
            raise EngineClosedError(f"The engine is not running ({self.death}); the server cannot serve requests.")
        if self.silence is not None:
            raise EngineClosedError(f"The engine is not answering ({self.silence}); retry shortly.")

    def _send(self, message: tuple) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            try:  # with no high-water mark only a missing peer (the engine process gone) refuses
                self._to_engine.send(data, zmq.NOBLOCK)
            except zmq.Again:
                raise EngineClosedError("The engine process is not accepting work.") from None

    async def _read(self) -> None:
        try:
            while True:
                self._dispatch(pickle.loads(await self._from_engine.recv()))
        finally:
            self._from_engine.close(linger=0)

    def _dispatch(self, message: tuple) -> None:
        self._heard = time.monotonic()
        if self.silence is not None:
            logger.warning("the engine process answers again; the server serves requests again")
            self.silence = None
        kind = message[0]
        if kind == "out":
            _, items, stats = message
            for request_id, item in items:
                queue = self.streams.get(request_id)
                if queue is not None:
                    queue.put_nowait(item)
            if stats is not None:
                self._stats = stats
        elif kind == "died":
            self._why_stopped = message[1]
        elif kind == "closed" and self._said_closed is not None:
            self._said_closed.set()
        elif kind == "result":
            _, call_id, ok, value = message
            future = self._calls.get(call_id)
            if future is not None and not future.done():
                future.set_result(value) if ok else future.set_exception(value)

    async def _watch(self) -> None:
        """Ping the engine process when it has been quiet; declare it silent after engine_timeout."""
        interval = min(HEARTBEAT_INTERVAL, self._timeout / 4)
        while self.death is None:
            await asyncio.sleep(interval)
            quiet = time.monotonic() - self._heard
            if quiet >= self._timeout:
                if self._from_engine.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # it spoke; this loop was busy
                    continue
                if self.silence is None and self.death is None:
                    self._silent(quiet)
            elif quiet >= interval:
                with contextlib.suppress(KVServeError):
                    self._send(("ping",))

    def _silent(self, quiet: float) -> None:
        """The engine process has not answered for `quiet` seconds: fail (and abort) everything in
        flight now, refuse everything new until it is heard from again."""
        self.silence = f"the engine process has not answered for {quiet:.1f} s"
        logger.error("%s; requests in flight fail and new ones get 503 until it answers", self.silence)
        # 503 (service_unavailable), as for the requests refused meanwhile: the engine is not broken, only silent.
        error = EngineClosedError(
            f"The engine process has not answered for {quiet:.1f} s; this request was aborted. Retry shortly."
        )
        for queue in self.streams.values():
            queue.put_nowait(error)
        if self.streams:  # applied when (if) it answers again, so that their blocks are freed
            with contextlib.suppress(KVServeError):
                self.abort(list(self.streams))
        for future in list(self._calls.values()):
            if not future.done():
                future.set_exception(EngineClosedError(f"The engine is not answering ({self.silence})."))

    def _exited(self) -> None:
        """The engine process exited. One that returned (code 0) sent its last messages first, a reason
        among them: they are read (a second at most) before its death is declared with that reason."""
        self.process.join(1)
        if self.process.exitcode != 0 or self._closing or self._said_closed is None:
            self._on_death()
            return

        async def after_its_last_message() -> None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._said_closed.wait(), 1.0)
            self._on_death()

        self._last_words = asyncio.ensure_future(after_its_last_message())

    def _on_death(self) -> None:
        """The engine process exited: fail everything in flight now, and everything later."""
        self.process.join(1)
        code = self.process.exitcode
        self.death = f"the engine process exited with code {code}"
        if self._why_stopped is not None:
            self.death = f"the engine stopped ({self._why_stopped}) and its process exited"
        if not self._closing:
            logger.error("%s; every request in flight fails and /health answers 503", self.death)
        error = EngineError(f"The engine process died ({self.death}); this request was lost.")
        for queue in self.streams.values():
            queue.put_nowait(error)
        for future in list(self._calls.values()):
            if not future.done():
                future.set_exception(EngineClosedError(f"The engine is not running ({self.death})."))
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(self.process.sentinel)
        if not self._closing and self.on_death is not None:
            self.on_death(self.death)


class RemoteSession:
    """As `Session`, for a session that lives in the engine process."""

    def __init__(self, llm: RemoteLLM, session_id: str, owner: str | None) -> None:
        self.llm, self.id, self.owner = llm, session_id, owner

    def _call(self, method: str, *args: Any) -> Any:
        return self.llm.call("session", self.id, self.owner, method, args)

    def info(self) -> dict[str, Any]:
        return self._call("info")

    def add_message(self, role: str, content: str) -> None:
        self._call("add_message", role, content)

    def append(self, text: str) -> None:
        self._call("append", text)

    def fork(self) -> RemoteSession:
        return RemoteSession(self.llm, self._call("fork"), self.owner)

    def close(self) -> None:
        self._call("close")

    def interrupt(self) -> None:
        self._call("interrupt")

    def astream(
        self,
        params: SamplingParams | None = None,
        *,
        interrupt: bool = False,
        request_id: str | None = None,
        announce: bool = False,
    ) -> AsyncIterator[StreamChunk]:
        self.llm._check_alive()
        params = params or SamplingParams(max_tokens=256)
        request_id = request_id or f"{self.id}-turn-{uuid.uuid4().hex[:8]}"
        return self.llm._stream(request_id, ("turn", self.id, self.owner, params, interrupt, request_id, announce))
