"""Running a completion body: admission, one engine request per choice, and the answer as one
JSON body or as a server-sent event stream. A client that disconnects, or a request past its time
limit, aborts its engine requests. Whatever can be refused is refused before the first byte, with
the status the unstreamed request gets: a body over the admission limit, a live X-Request-Id, and
a session turn the session cannot take (it is awaited until it starts)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from kvserve.errors import EngineClosedError, EngineError, InvalidRequestError, KVServeError
from kvserve.llm import LLM
from kvserve.outputs import RequestOutput, StreamChunk
from kvserve.sampling_params import MAX_SEED, SamplingParams
from kvserve.server.backpressure import Backpressure, StreamStalledError
from kvserve.server.formatting import Formatter, event
from kvserve.server.metrics import ServerMetrics
from kvserve.server.protocol import error_body
from kvserve.server.state import APIError, ServerState, check_model, read_json, server_state
from kvserve.sessions.store import SessionStoreError
from kvserve.text.tool_calls import ToolFormat

SHUTTING_DOWN = "The server is shutting down and aborted this request; send it again (to another server)."


class ServerStoppingError(KVServeError):
    """What ends a stream still running when the server's --shutdown-timeout is over."""


async def handle(request: Request, owner, body_type, prepare, id_prefix: str, kind: str, chat: bool) -> Response:
    """Parse and check the body, admit its engine requests, build the choices' jobs (`prepare`), run."""
    state = server_state(request)
    llm = state.ready_llm()
    body = await asyncio.to_thread(_checked, body_type, await read_json(request))
    check_model(state, body.model)
    release = admit(state, body.num_requests())
    try:
        # Schemas, tools, the chat template and the prompts' tokens, off the event loop: a 4 MiB body's
        # take seconds. Tokenizing a long prompt lets go of the interpreter lock; validating a schema does not.
        jobs = await asyncio.to_thread(prepare, llm, body, state.sampling_defaults)
        response_id = f"{id_prefix}-{uuid.uuid4().hex}"
        return await run(state, llm, request, owner, response_id, kind, body, jobs, chat, release)
    except InvalidRequestError as exc:
        release()
        raise body.as_sent(exc) from None
    except BaseException:
        release()
        raise


def _checked(body_type, fields):
    body = body_type.model_validate(fields)
    body.check_supported()
    return body


def admit(state: ServerState, num_requests: int) -> Callable[[], None]:
    """Admission control over engine requests (a body's prompts x n): beyond max_num_seqs +
    max_queue in flight, answer 429 with Retry-After before any engine work.

    A body that alone exceeds the limit can never be admitted: 400 saying how to split it (a 429
    would have a client that obeys Retry-After retry forever).

    Returns an idempotent `release` to call when the body's requests are over.
    """
    limit = state.settings.max_num_seqs + state.settings.max_queue
    if num_requests > limit:
        raise APIError(
            400,
            f"This request creates {num_requests} engine requests (prompts x n), more than the server ever admits "
            f"at once ({limit}: --max-num-seqs + --max-queue); split it into requests of at most {limit} prompts x n.",
            "invalid_request_error",
            code="request_too_large",
        )
    if state.num_inflight + num_requests > limit:
        state.metrics.rejected.inc()
        message = f"The server is at capacity ({limit} engine requests in flight); retry shortly."
        error = APIError(429, message, "rate_limit_error", code="server_overloaded")
        error.headers["Retry-After"] = "1"
        raise error
    state.num_inflight += num_requests
    released = False

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            state.num_inflight -= num_requests

    return release


def with_seed(params: SamplingParams, seed: int | None, index: int) -> SamplingParams:
    """Choice i of n samples with seed + i, so n choices differ but the response is reproducible."""
    return params if seed is None or index == 0 else dataclasses.replace(params, seed=(seed + index) % (MAX_SEED + 1))


@dataclasses.dataclass
class Job:
    """One choice of a response: which prompt it answers, how to start its stream, echoed text.
    A stream that `announces` its start first yields an empty chunk once its request has started
    (a session turn: once the session took it), or raises why it could not."""

    prompt_index: int
    start: Callable[[str], AsyncIterator[StreamChunk]]  # engine request id -> stream (validates now)
    echo: str | None = None
    announces: bool = False
    tool_format: ToolFormat | None = None  # parse the answer's tool calls in this format


@dataclasses.dataclass(eq=False)
class Running:
    """A response in flight: its engine requests, and the ids (owner, id) it answers to."""

    engine_ids: list[str]
    aliases: list[tuple[str | None, str]]


def llm_stream(llm: LLM, prompt, params: SamplingParams) -> Callable[[str], AsyncIterator[StreamChunk]]:
    return lambda request_id: llm.astream(prompt, params, request_id=request_id)


async def run(state, llm, request, owner, response_id, kind, body, jobs: list[Job], chat: bool, release) -> Response:
    """Start the engine requests of all choices; answer as one JSON body or as an SSE stream."""
    created = int(time.time())
    engine_ids = [f"{response_id}-{k}" for k in range(len(jobs))]
    aliases = [(owner, response_id)]
    client_id = request.headers.get("x-request-id")
    if client_id:
        if "/" in client_id:  # the request would run, and /v1/requests/{id} could never name it (%2F is "/" there)
            raise APIError(
                400,
                f"X-Request-Id {client_id!r:.100} has a '/', which no /v1/requests/{{id}} path can hold; use another id.",
                "invalid_request_error",
                "X-Request-Id",
            )
        if (owner, client_id) in state.requests:  # the older one stays what DELETE aborts
            raise APIError(
                409,
                f"A request with X-Request-Id {client_id!r} is still running; send another id, or wait for it "
                "to end (DELETE /v1/requests/{id} aborts it).",
                "invalid_request_error",
                "X-Request-Id",
                code="request_id_in_use",
            )
        aliases.append((owner, client_id))
    # Validate every prompt before any work starts (raises InvalidRequestError -> 400).
    streams = [job.start(rid) for job, rid in zip(jobs, engine_ids, strict=True)]
    prompt_indices = [job.prompt_index for job in jobs]
    running = Running(engine_ids, aliases)
    for alias in aliases:
        state.requests[alias] = running
    arrival = time.monotonic()
    formatter = Formatter(
        llm,
        response_id,
        created,
        state.model_name,
        kind,
        chat,
        [job.echo for job in jobs],
        [j.tool_format for j in jobs],
    )

    def cleanup() -> None:  # idempotent: the request is over for the server
        for alias in aliases:
            if state.requests.get(alias) is running:
                del state.requests[alias]
        release()

    announcing = [stream for job, stream in zip(jobs, streams, strict=True) if job.announces]
    if announcing:  # a refusal is the status the unstreamed request gets, not 200 and an error event
        try:
            await _finish_or_abort(state, request, asyncio.gather(*(anext(s) for s in announcing)))
        except BaseException:
            cleanup()
            for stream in streams:
                with contextlib.suppress(BaseException):
                    await stream.aclose()
            raise

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        flow = Backpressure(llm, engine_ids, state.settings.stall_timeout)  # paced to a client that does not read
        return StreamingResponse(
            _sse(state, streams, formatter, arrival, include_usage, cleanup, prompt_indices, flow),
            media_type="text/event-stream",
            headers={"X-Request-Id": response_id},
            background=BackgroundTask(cleanup),  # also when the stream never started
        )
    try:
        outputs = await _collect_or_abort(state, request, streams, arrival)
    finally:
        cleanup()
    return JSONResponse(formatter.full_response(outputs, prompt_indices), headers={"X-Request-Id": response_id})


async def _observed(stream: AsyncIterator[StreamChunk], metrics: ServerMetrics, arrival: float):
    """Pass a choice's chunks through, observing its time to first token and end-to-end latency."""
    first = True
    async for chunk in stream:
        if first and chunk.token_ids:
            metrics.ttft.observe(time.monotonic() - arrival)
            first = False
        yield chunk
    metrics.e2e.observe(time.monotonic() - arrival)


async def _collect_or_abort(state, request, streams, arrival) -> list[RequestOutput]:
    """Run all choices to the end; a client disconnect or the time limit cancels (= aborts) them."""

    async def collect(stream) -> RequestOutput:
        return RequestOutput.from_chunks([chunk async for chunk in _observed(stream, state.metrics, arrival)])

    return await _finish_or_abort(state, request, asyncio.gather(*(collect(s) for s in streams)))


async def _finish_or_abort(state, request, awaitable):
    """Await `awaitable` (work on the body's streams); a client disconnect, the time limit or the
    server's shutdown cancels it, which aborts its engine requests, and answers 499, 504 or 503."""
    work = asyncio.ensure_future(awaitable)
    disconnect = asyncio.ensure_future(_wait_disconnect(request))
    stopping = asyncio.ensure_future(state.stopping.wait())
    try:
        done, _ = await asyncio.wait(
            {work, disconnect, stopping}, timeout=state.settings.request_timeout, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        disconnect.cancel()
        stopping.cancel()
    if work in done:
        return work.result()
    work.cancel()
    with contextlib.suppress(asyncio.CancelledError, KVServeError):
        await work
    if disconnect in done:
        raise APIError(499, "Client closed the request.", "client_closed_request")
    if stopping in done:
        raise APIError(503, SHUTTING_DOWN, "service_unavailable", code="server_shutting_down")
    raise APIError(
        504,
        f"The request exceeded its time limit of {state.settings.request_timeout:g} s and was aborted.",
        "timeout_error",
        code="request_timeout",
    )


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _sse(
    state, streams, formatter, arrival, include_usage, cleanup, prompt_indices, flow: Backpressure
) -> AsyncIterator[str]:
    queue: asyncio.Queue = asyncio.Queue()

    def stalled() -> None:  # the client has not read for stall_timeout: its requests are aborted
        queue.put_nowait((0, flow.error()))
        cleanup()

    flow.on_stall = stalled

    async def pump(index: int, stream) -> None:
        try:
            async for chunk in _observed(stream, state.metrics, arrival):
                await queue.put((index, chunk))
                flow.update(queue.qsize())
        except BaseException as exc:
            await queue.put((index, exc))
            raise

    async def stop() -> None:  # the server's shutdown: the stream ends with an error event
        await state.stopping.wait()
        await queue.put((0, ServerStoppingError(SHUTTING_DOWN)))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    tasks.append(asyncio.ensure_future(stop()))
    remaining = len(streams)
    finals: list[StreamChunk | None] = [None] * len(streams)
    try:
        async with asyncio.timeout(state.settings.request_timeout):
            if formatter.chat:
                for i in range(len(streams)):
                    yield event(formatter.chunk_event(i, None, role=True))
            while remaining:
                index, item = await queue.get()
                flow.update(queue.qsize())
                if isinstance(item, BaseException):
                    raise item
                if formatter.echo_texts[index] is not None and formatter.first_chunk[index]:
                    yield event(formatter.chunk_event(index, StreamChunk("", formatter.echo_texts[index], [])))
                formatter.first_chunk[index] = False
                for payload in formatter.chunk_events(index, item):
                    yield event(payload)
                if item.finish_reason is not None:
                    finals[index] = item
                    remaining -= 1
        if include_usage:
            yield event(formatter.usage_event(finals, prompt_indices))
    except TimeoutError:
        yield event(
            error_body(
                f"The request exceeded its time limit of {state.settings.request_timeout:g} s and was aborted.",
                "timeout_error",
                code="request_timeout",
            )
        )
    except KVServeError as exc:
        yield event(_stream_error(exc))
    finally:
        flow.close()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        cleanup()
    yield "data: [DONE]\n\n"


def _stream_error(exc: KVServeError) -> dict:
    """The error event that ends a stream, typed as the same error is when it comes before the first byte."""
    if isinstance(exc, StreamStalledError):
        return error_body(str(exc), "timeout_error", code="stream_stalled")
    if isinstance(exc, SessionStoreError):
        return error_body(str(exc), "service_unavailable", code="session_store_error")
    if isinstance(exc, ServerStoppingError):
        return error_body(str(exc), "service_unavailable", code="server_shutting_down")
    if isinstance(exc, EngineClosedError):
        return error_body(str(exc), "service_unavailable", code="engine_unavailable")
    if isinstance(exc, EngineError):
        return error_body(str(exc), "server_error")
    return error_body(str(exc), "invalid_request_error", getattr(exc, "param", None))  # as unstreamed, the field
