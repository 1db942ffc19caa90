"""The HTTP server: OpenAI-compatible routes over one LLM. Routes translate; the engine decides.

Errors always carry the OpenAI body {"error": {"message", "type", "param", "code"}}: a client's
mistake is a 4xx, never a 500, and never harms another request.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve.engine.sampler import TokenLogprobs
from kvserve.errors import EngineClosedError, EngineError, InvalidRequestError, KVServeError, check_text
from kvserve.llm import LLM
from kvserve.outputs import RequestOutput, StreamChunk
from kvserve.sampling_params import MAX_SEED, SamplingParams
from kvserve.server.metrics import ServerMetrics
from kvserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SessionAppendRequest,
    SessionCompletionRequest,
    SessionCreateRequest,
    SessionMessageRequest,
    error_body,
    usage_dict,
)
from kvserve.sessions.manager import SessionLimitError, SessionNotFoundError
from kvserve.sessions.session import Session
from kvserve.sessions.store import SessionStoreError, key_owner

DEFAULT_MAX_BODY_BYTES = 4 << 20
logger = logging.getLogger("kvserve.server")


@dataclass(frozen=True)
class ServerSettings:
    model: str | None = None
    served_model_name: str | None = None
    api_keys: tuple[str, ...] = ()
    max_num_seqs: int = 64
    max_queue: int = 256
    request_timeout: float = 600.0
    kv_cache_tokens: int | None = None
    kv_cache_dtype: str = "auto"
    dtype: str | None = None
    weights: str = "auto"
    activations: str = "float"
    batch_invariant: bool = True
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_sessions: int = 1024
    max_sessions_per_key: int | None = 256
    session_ttl: float | None = 3600.0
    session_db: str | None = None  # None: $KVSERVE_HOME/sessions.db


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str, param: str | None = None, code: Any = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers: dict[str, str] = {}


@dataclass
class ServerState:
    settings: ServerSettings
    llm: LLM | None = None
    load_error: str | None = None
    model_name: str = "kvserve"
    num_inflight: int = 0  # engine requests (prompts x n of every admitted body) not yet over
    # (owner, response id or client X-Request-Id) -> engine request ids: only their owner may abort them
    requests: dict[tuple[str | None, str], list[str]] = field(default_factory=dict)
    metrics: ServerMetrics | None = None

    def ready_llm(self) -> LLM:
        if self.llm is None:
            detail = f": {self.load_error}" if self.load_error else "; retry shortly"
            raise APIError(503, f"The model is still loading{detail}.", "service_unavailable", code=503)
        return self.llm


def create_app(settings: ServerSettings, llm: LLM | None = None) -> FastAPI:
    """Build the app. With `llm` given it serves that engine (and does not close it); otherwise it
    loads `settings.model` in the background after start-up, answering 503 until ready."""
    state = ServerState(settings)
    state.metrics = ServerMetrics(lambda: state.llm.stats() if state.llm is not None else None)

    def set_llm(loaded: LLM) -> None:
        state.model_name = settings.served_model_name or loaded.model_path.stem
        state.llm = loaded

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loader = None
        if llm is not None:
            set_llm(llm)
        else:

            async def load() -> None:
                try:
                    set_llm(
                        await asyncio.to_thread(
                            LLM,
                            settings.model,
                            dtype=settings.dtype,
                            weights=settings.weights,
                            activations=settings.activations,
                            batch_invariant=settings.batch_invariant,
                            kv_cache_tokens=settings.kv_cache_tokens,
                            kv_cache_dtype=settings.kv_cache_dtype,
                            max_num_seqs=settings.max_num_seqs,
                            max_sessions=settings.max_sessions,
                            max_sessions_per_owner=settings.max_sessions_per_key,
                            session_ttl=settings.session_ttl,
                            session_db=settings.session_db,
                        )
                    )
                except Exception as exc:  # reported by /health and every route
                    state.load_error = f"{type(exc).__name__}: {exc}"

            loader = asyncio.create_task(load())
        yield
        if loader is not None:
            loader.cancel()
            if state.llm is not None:
                await asyncio.to_thread(state.llm.close)

    app = FastAPI(title="kvserve", lifespan=lifespan)
    app.state.kvserve = state
    _install_error_handlers(app)
    app.add_middleware(_BodyLimitMiddleware, max_bytes=settings.max_body_bytes)

    key_bytes = [key.encode() for key in settings.api_keys]

    async def authorize(request: Request) -> str | None:  # async: no thread-pool hop per request
        """The caller's owner id, a hash of its API key (None without auth): it owns the requests and
        sessions the caller creates. Keys are compared in constant time, each of them every time."""
        if not settings.api_keys:
            return None
        header = request.headers.get("authorization", "")
        token = header[7:].encode(errors="surrogateescape") if header.lower().startswith("bearer ") else b""
        matched = False
        for key in key_bytes:
            matched |= hmac.compare_digest(token, key)
        if not matched:
            raise APIError(
                401,
                "Missing or invalid API key: send 'Authorization: Bearer <key>'.",
                "authentication_error",
                code="invalid_api_key",
            )
        return key_owner(token.decode())

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.llm is None:
            status = "error" if state.load_error else "loading"
            return JSONResponse({"status": status, "detail": state.load_error}, status_code=503)
        problem = await asyncio.to_thread(state.llm.problem)  # a failed store is probed with a write
        if problem is not None:
            return JSONResponse({"status": "error", "detail": problem, "model": state.model_name}, status_code=503)
        return JSONResponse({"status": "ok", "model": state.model_name})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models() -> dict:
        state.ready_llm()
        return {
            "object": "list",
            "data": [{"id": state.model_name, "object": "model", "created": 0, "owned_by": "kvserve"}],
        }

    @app.delete("/v1/requests/{request_id}")
    async def abort(request_id: str, owner: str | None = Depends(authorize)) -> dict:
        engine_ids = state.requests.get((owner, request_id))
        if engine_ids is None:  # also another key's request: it is not this caller's to see
            raise APIError(404, f"No running request with id {request_id!r}.", "not_found_error", "request_id")
        state.ready_llm().abort(engine_ids)
        return {"id": request_id, "object": "request.abort", "aborted": True}

    async def handle(request: Request, owner, body_type, prepare, id_prefix: str, kind: str, chat: bool) -> Response:
        """Parse and check the body, admit its engine requests, build the choices' jobs, run."""
        llm = state.ready_llm()
        body = body_type.model_validate(await _json(request))
        body.check_supported()
        _check_model(state, body.model)
        release = _admit(state, body.num_requests())
        try:
            jobs = prepare(llm, body)
            response_id = f"{id_prefix}-{uuid.uuid4().hex}"
            return await _run(state, llm, request, owner, response_id, kind, body, jobs, chat, release)
        except BaseException:
            release()
            raise

    def completion_jobs(llm: LLM, body: CompletionRequest) -> list[_Job]:
        if body.echo and body.logprobs is not None:
            raise InvalidRequestError("echo with logprobs is not supported (no prompt logprobs).", "echo")
        params = body.sampling_params(body.max_tokens, body.logprobs, 16)
        jobs = []
        for p_index, prompt in enumerate(body.prompts()):
            echo = (
                (prompt if isinstance(prompt, str) else llm.tokenizer.decode(llm.encode_prompt(prompt)))
                if body.echo
                else None
            )
            for i in range(body.n):
                jobs.append(_Job(p_index, _llm_stream(llm, prompt, _with_seed(params, body.seed, i)), echo))
        return jobs

    def chat_jobs(llm: LLM, body: ChatCompletionRequest) -> list[_Job]:
        prompt_ids = llm.tokenizer.encode_chat(body.conversation())
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        default_max = max(1, llm.config.max_model_len - len(prompt_ids))  # as OpenAI: up to the context
        params = body.sampling_params(max_tokens, body.chat_logprobs(), default_max)
        return [_Job(0, _llm_stream(llm, prompt_ids, _with_seed(params, body.seed, i))) for i in range(body.n)]

    @app.post("/v1/completions")
    async def completions(request: Request, owner: str | None = Depends(authorize)) -> Response:
        return await handle(request, owner, CompletionRequest, completion_jobs, "cmpl", "text_completion", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, owner: str | None = Depends(authorize)) -> Response:
        return await handle(request, owner, ChatCompletionRequest, chat_jobs, "chatcmpl", "chat.completion", chat=True)

    # ----- sessions ---------------------------------------------------------------------------
    async def session_of(session_id: str, owner: str | None) -> Session:
        llm = state.ready_llm()
        await asyncio.to_thread(llm._session_call, lambda m: m.get(session_id, owner))
        return Session(llm, session_id, owner)

    def session_object(info: dict) -> dict:
        return {"object": "session", **info}

    @app.post("/v1/sessions")
    async def create_session(request: Request, owner: str | None = Depends(authorize)) -> dict:
        llm = state.ready_llm()
        body = SessionCreateRequest.model_validate(await _json(request))
        _check_model(state, body.model)
        session = await asyncio.to_thread(llm.session, body.system, body.conversation(), ttl=body.ttl, owner=owner)
        return session_object(await asyncio.to_thread(session.info))

    @app.get("/v1/sessions/{session_id}")
    async def get_session(session_id: str, owner: str | None = Depends(authorize)) -> dict:
        session = await session_of(session_id, owner)
        return session_object(await asyncio.to_thread(session.info))

    @app.post("/v1/sessions/{session_id}/messages")
    async def add_session_message(session_id: str, request: Request, owner: str | None = Depends(authorize)) -> dict:
        body = SessionMessageRequest.model_validate(await _json(request))
        session = await session_of(session_id, owner)
        await asyncio.to_thread(session.add_message, body.role, body.content)
        return {"id": session_id, "object": "session.message", "queued": True}

    @app.post("/v1/sessions/{session_id}/append")
    async def append_to_session(session_id: str, request: Request, owner: str | None = Depends(authorize)) -> dict:
        body = SessionAppendRequest.model_validate(await _json(request))
        session = await session_of(session_id, owner)
        await asyncio.to_thread(session.append, body.text)
        return {"id": session_id, "object": "session.append", "queued": True}

    @app.post("/v1/sessions/{session_id}/fork")
    async def fork_session(session_id: str, owner: str | None = Depends(authorize)) -> dict:
        session = await session_of(session_id, owner)
        child = await asyncio.to_thread(session.fork)
        return session_object(await asyncio.to_thread(child.info))

    @app.delete("/v1/sessions/{session_id}")
    async def delete_session(session_id: str, owner: str | None = Depends(authorize)) -> dict:
        session = await session_of(session_id, owner)
        await asyncio.to_thread(session.close)
        return {"id": session_id, "object": "session.deleted", "deleted": True}

    @app.post("/v1/sessions/{session_id}/completions")
    async def session_completion(session_id: str, request: Request, owner: str | None = Depends(authorize)) -> Response:
        session = await session_of(session_id, owner)

        def jobs(llm: LLM, body: SessionCompletionRequest) -> list[_Job]:
            if body.n != 1:
                raise InvalidRequestError("A session turn has one choice; n must be 1.", "n")
            max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
            params = body.sampling_params(max_tokens, body.chat_logprobs(), 512)
            return [_Job(0, lambda rid: session.astream(params, interrupt=body.interrupt, request_id=rid))]

        return await handle(request, owner, SessionCompletionRequest, jobs, "chatcmpl", "chat.completion", chat=True)

    return app


# ----- request execution ----------------------------------------------------------------------
def _admit(state: ServerState, num_requests: int) -> Callable[[], None]:
    """Admission control over engine requests (a body's prompts x n): beyond max_num_seqs +
    max_queue in flight, answer 429 with Retry-After before any engine work.

    Returns an idempotent `release` to call when the body's requests are over.
    """
    limit = state.settings.max_num_seqs + state.settings.max_queue
    if state.num_inflight + num_requests > limit:
        state.metrics.rejected.inc()
        if num_requests > limit:
            message = (
                f"This request creates {num_requests} engine requests (prompts x n), more than the server admits "
                f"at once ({limit}); split it into smaller requests."
            )
        else:
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


def _with_seed(params: SamplingParams, seed: int | None, index: int) -> SamplingParams:
    """Choice i of n samples with seed + i, so n choices differ but the response is reproducible."""
    return params if seed is None or index == 0 else dataclasses.replace(params, seed=(seed + index) % (MAX_SEED + 1))


@dataclasses.dataclass
class _Job:
    """One choice of a response: which prompt it answers, how to start its stream, echoed text."""

    prompt_index: int
    start: Callable[[str], AsyncIterator[StreamChunk]]  # engine request id -> stream (validates now)
    echo: str | None = None


def _llm_stream(llm: LLM, prompt, params: SamplingParams) -> Callable[[str], AsyncIterator[StreamChunk]]:
    return lambda request_id: llm.astream(prompt, params, request_id=request_id)


async def _run(state, llm, request, owner, response_id, kind, body, jobs: list[_Job], chat: bool, release) -> Response:
    """Start the engine requests of all choices; answer as one JSON body or as an SSE stream."""
    created = int(time.time())
    engine_ids = [f"{response_id}-{k}" for k in range(len(jobs))]
    # Validate every prompt before any work starts (raises InvalidRequestError -> 400).
    streams = [job.start(rid) for job, rid in zip(jobs, engine_ids, strict=True)]
    prompt_indices = [job.prompt_index for job in jobs]
    aliases = [(owner, response_id)]
    client_id = request.headers.get("x-request-id")
    if client_id:
        aliases.append((owner, client_id))
    for alias in aliases:
        state.requests[alias] = engine_ids
    arrival = time.monotonic()
    formatter = _Formatter(llm, response_id, created, state.model_name, kind, chat, [job.echo for job in jobs])

    def cleanup() -> None:  # idempotent: the request is over for the server
        for alias in aliases:
            if state.requests.get(alias) is engine_ids:
                del state.requests[alias]
        release()

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            _sse(state, streams, formatter, arrival, include_usage, cleanup, prompt_indices),
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

    work = asyncio.ensure_future(asyncio.gather(*(collect(s) for s in streams)))
    disconnect = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait(
            {work, disconnect}, timeout=state.settings.request_timeout, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        disconnect.cancel()
    if work in done:
        return work.result()
    work.cancel()
    with contextlib.suppress(asyncio.CancelledError, KVServeError):
        await work
    if disconnect in done:
        raise APIError(499, "Client closed the request.", "client_closed_request")
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


async def _sse(state, streams, formatter, arrival, include_usage, cleanup, prompt_indices) -> AsyncIterator[str]:
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream) -> None:
        try:
            async for chunk in _observed(stream, state.metrics, arrival):
                await queue.put((index, chunk))
        except BaseException as exc:
            await queue.put((index, exc))
            raise

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    finals: list[StreamChunk | None] = [None] * len(tasks)
    try:
        async with asyncio.timeout(state.settings.request_timeout):
            if formatter.chat:
                for i in range(len(tasks)):
                    yield _event(formatter.chunk_event(i, None, role=True))
            while remaining:
                index, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if formatter.echo_texts[index] is not None and formatter.first_chunk[index]:
                    yield _event(formatter.chunk_event(index, StreamChunk("", formatter.echo_texts[index], [])))
                formatter.first_chunk[index] = False
                yield _event(formatter.chunk_event(index, item))
                if item.finish_reason is not None:
                    finals[index] = item
                    remaining -= 1
        if include_usage:
            yield _event(formatter.usage_event(finals, prompt_indices))
    except TimeoutError:
        yield _event(
            error_body(
                f"The request exceeded its time limit of {state.settings.request_timeout:g} s and was aborted.",
                "timeout_error",
                code="request_timeout",
            )
        )
    except KVServeError as exc:
        yield _event(error_body(str(exc), "server_error" if isinstance(exc, EngineError) else "invalid_request_error"))
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        cleanup()
    yield "data: [DONE]\n\n"


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class _Formatter:
    """OpenAI response and chunk shapes for completions and chat completions."""

    def __init__(self, llm, response_id, created, model, kind, chat, echo_texts) -> None:
        self.tokenizer = llm.tokenizer
        self.id, self.created, self.model, self.kind, self.chat = response_id, created, model, kind, chat
        self.echo_texts = echo_texts
        self.first_chunk = [True] * len(echo_texts)

    def _logprobs(self, logprobs: list[TokenLogprobs] | None, offset: int = 0) -> dict | None:
        if not logprobs:
            return None
        decode = self.tokenizer.decode
        if self.chat:

            def entry(token_id: int, logprob: float) -> dict:
                text = decode([token_id])
                return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

            return {
                "content": [
                    {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                    for lp in logprobs
                ]
            }
        tokens = [decode([lp.token_id]) for lp in logprobs]
        offsets, position = [], offset
        for token in tokens:
            offsets.append(position)
            position += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{decode([t]): v for t, v in lp.top} for lp in logprobs],
            "text_offset": offsets,
        }

    def chunk_event(self, index: int, chunk: StreamChunk | None, role: bool = False) -> dict:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if chunk is not None and chunk.text:
                delta["content"] = chunk.text
            choice = {
                "index": index,
                "delta": delta,
                "logprobs": self._logprobs(chunk.logprobs if chunk else None),
                "finish_reason": chunk.finish_reason if chunk else None,
            }
            return {
                "id": self.id,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.model,
                "choices": [choice],
            }
        choice = {
            "index": index,
            "text": chunk.text,
            "logprobs": self._logprobs(chunk.logprobs),
            "finish_reason": chunk.finish_reason,
        }
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }

    def usage_event(self, finals: list[StreamChunk | None], prompt_indices: list[int]) -> dict:
        return {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": self._usage([f.usage if f else None for f in finals], prompt_indices),
        }

    @staticmethod
    def _usage(usages, prompt_indices: list[int]) -> dict:
        prompt = cached = completion = 0
        seen = set()
        for usage, p_index in zip(usages, prompt_indices, strict=True):
            if usage is None:
                continue
            completion += usage.completion_tokens
            if p_index not in seen:  # n choices of one prompt count the prompt once, as OpenAI does
                seen.add(p_index)
                prompt += usage.prompt_tokens
                cached += usage.cached_tokens
        return usage_dict(prompt, completion, cached)

    def full_response(self, outputs: list[RequestOutput], prompt_indices: list[int]) -> dict:
        choices = []
        for index, output in enumerate(outputs):
            text, logprobs = output.text, output.logprobs
            if self.chat:
                choices.append(
                    {
                        "index": index,
                        "message": {"role": "assistant", "content": text},
                        "logprobs": self._logprobs(logprobs),
                        "finish_reason": output.finish_reason,
                    }
                )
            else:
                echo = self.echo_texts[index] or ""
                choices.append(
                    {
                        "index": index,
                        "text": echo + text,
                        "logprobs": self._logprobs(logprobs, len(echo)),
                        "finish_reason": output.finish_reason,
                    }
                )
        usage = self._usage([o.usage for o in outputs], prompt_indices)
        return {
            "id": self.id,
            "object": self.kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage,
        }


# ----- errors, limits, helpers -----------------------------------------------------------------
async def _json(request: Request) -> Any:
    """The body as JSON whose every string is valid Unicode (else InvalidRequestError naming the field)."""
    raw = await request.body()
    try:
        body = json.loads(raw)
    except RecursionError:
        raise InvalidRequestError("The request body nests JSON too deeply; send a flat request.") from None
    except ValueError as exc:  # bad JSON or UTF-8, and integers longer than Python converts (4,300 digits)
        raise InvalidRequestError(f"The request body is not valid JSON: {exc}.") from None
    _check_strings(body)
    return body


def _check_strings(body: Any) -> None:
    """Refuse lone UTF-16 surrogates (a JSON escape can carry them) anywhere in the body, by field."""
    stack = [(body, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            check_text(value, path or "body")
        elif isinstance(value, dict):
            for key, item in value.items():
                check_text(key, f"{path}.{key!a}" if path else "field name")
                stack.append((item, f"{path}.{key}" if path else key))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{i}]") for i, item in enumerate(value))


def _check_model(state: ServerState, name: str | None) -> None:
    if name is not None and name != state.model_name:
        raise APIError(
            404,
            f"The model {name!r} does not exist; this server serves {state.model_name!r}.",
            "invalid_request_error",
            "model",
            "model_not_found",
        )


def _install_error_handlers(app: FastAPI) -> None:
    def respond(status: int, body: dict, headers: dict | None = None) -> JSONResponse:
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return respond(exc.status, error_body(exc.message, exc.type, exc.param, exc.code), exc.headers)

    @app.exception_handler(InvalidRequestError)
    async def invalid(_: Request, exc: InvalidRequestError) -> JSONResponse:
        return respond(400, error_body(str(exc), "invalid_request_error", exc.param))

    @app.exception_handler(SessionNotFoundError)
    async def session_not_found(_: Request, exc: SessionNotFoundError) -> JSONResponse:
        return respond(404, error_body(str(exc), "not_found_error", "session_id", "session_not_found"))

    @app.exception_handler(SessionLimitError)
    async def session_limit(_: Request, exc: SessionLimitError) -> JSONResponse:
        return respond(429, error_body(str(exc), "rate_limit_error", code="too_many_sessions"), {"Retry-After": "10"})

    @app.exception_handler(KVServeError)
    async def kvserve_error(_: Request, exc: KVServeError) -> JSONResponse:
        if isinstance(exc, SessionStoreError):
            return respond(503, error_body(str(exc), "service_unavailable", code="session_store_error"))
        if isinstance(exc, EngineClosedError):
            return respond(503, error_body(str(exc), "service_unavailable", code=503))
        if isinstance(exc, EngineError):
            return respond(500, error_body(str(exc), "server_error"))
        return respond(400, error_body(str(exc), "invalid_request_error"))

    @app.exception_handler(RequestValidationError)
    async def validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return respond(400, _validation_body(exc.errors()))

    from pydantic import ValidationError

    @app.exception_handler(ValidationError)
    async def pydantic_validation(_: Request, exc: ValidationError) -> JSONResponse:
        return respond(400, _validation_body(exc.errors()))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        # A bug, not the client's mistake; still an OpenAI-shaped body, and the engine keeps serving.
        logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        message = f"The server failed on this request ({type(exc).__name__}); other requests are unaffected."
        return respond(500, error_body(message, "server_error", code=500))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return respond(exc.status_code, error_body(str(exc.detail), kind, code=exc.status_code))


def _validation_body(errors: list[dict]) -> dict:
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = [str(part) for part in first.get("loc", ()) if part not in ("body",)]
    param = ".".join(loc) or None
    message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    return error_body(message, "invalid_request_error", param)


class _BodyLimitMiddleware:
    """413 for request bodies over the limit, by Content-Length or by counting a streamed body."""

    def __init__(self, app: Callable, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._reject(send)
        received = 0

        async def counting_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyTooLarge
            return message

        try:
            return await self.app(scope, counting_receive, send)
        except _BodyTooLarge:
            return await self._reject(send)

    async def _reject(self, send) -> None:
        body = json.dumps(
            error_body(f"The request body exceeds {self.max_bytes} bytes.", "invalid_request_error", code=413)
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})


class _BodyTooLarge(Exception):
    pass
