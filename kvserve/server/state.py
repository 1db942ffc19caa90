"""The server's settings and state, and what every route needs: the caller's identity, the LLM
once loaded, the body as checked JSON."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request

from kvserve.errors import InvalidRequestError, KVServeError, check_text
from kvserve.llm import LLM
from kvserve.pipeline.topology import Topology
from kvserve.server.metrics import ServerMetrics
from kvserve.sessions.store import OWNER_SECRET_BYTES, key_owner

if TYPE_CHECKING:
    from kvserve.server.engine_client import RemoteLLM

DEFAULT_MAX_BODY_BYTES = 4 << 20


@dataclass(frozen=True)
class ServerSettings:
    model: str | None = None
    served_model_name: str | None = None
    api_keys: tuple[str, ...] = ()
    max_num_seqs: int = 64
    gather_ms: float = 3.0
    max_queue: int = 256
    request_timeout: float = 600.0
    kv_cache_tokens: int | None = None
    kv_cache_dtype: str = "auto"
    dtype: str | None = None
    weights: str = "auto"
    activations: str = "auto"
    batch_invariant: bool = True
    cuda_graphs: bool = True
    async_scheduling: bool | None = None  # None: on a GPU
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    allowed_origins: tuple[str, ...] = ()  # other sites' pages that may call the API from a browser (CORS); "*": any
    host: str = "127.0.0.1"  # the address it is bound to: on a loopback one, only this machine's names are served
    max_sessions: int = 1024
    max_sessions_per_key: int | None = 256
    session_ttl: float | None = 3600.0
    session_db: str | None = None  # None: $KVSERVE_HOME/sessions.db
    max_session_tokens: int | None = None  # None: the model's context
    max_message_bytes: int | None = None  # None: 16 bytes per token of max_session_tokens
    engine_process: bool = True  # the engine in a process of its own (engine_process.py), else a thread here
    engine_timeout: float = 5.0  # seconds an engine process may go unheard before requests fail (--stage-timeout)
    stall_timeout: float = 60.0  # seconds a stream may stay paused for a client that does not read, then aborted
    body_timeout: float = 30.0  # seconds a request's body may take to arrive, else 408
    pipeline: Topology | None = None  # the model's layers over several processes or hosts (kvserve/pipeline)
    log_level: str = "info"  # kvserve's loggers, in the engine process too (--log-level)


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str, param: str | None = None, code: Any = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers: dict[str, str] = {}


@dataclass
class ServerState:
    settings: ServerSettings
    llm: LLM | RemoteLLM | None = None
    load_error: str | None = None
    model_name: str = "kvserve"
    # The model's recommended sampling values (its file's or model card's): a request that leaves one out
    # samples with it, as vLLM does with a model's generation_config.json; OpenAI's defaults otherwise.
    sampling_defaults: dict[str, float] = field(default_factory=dict)
    model_created: int = 0  # /v1/models' `created`: the model file's time
    num_inflight: int = 0  # engine requests (prompts x n of every admitted body) not yet over
    # (owner, response id or client X-Request-Id) -> the response in flight (execution.Running): only
    # its owner may abort it, and one live request per (owner, id)
    requests: dict[tuple[str | None, str], Any] = field(default_factory=dict)
    metrics: ServerMetrics | None = None
    key_bytes: tuple[bytes, ...] = field(init=False)  # the API keys, encoded once for authorize
    owner_secret: bytes | None = None  # what owners are keyed with (key_owner), once the engine is up
    # Called (on the event loop) when the engine process died unasked; `kvserve serve` exits non-zero.
    on_fatal: Callable[[str], None] | None = None
    # Called (in the loading thread) once an engine in this process has loaded; `kvserve serve` freezes
    # the heap there, its own process for good.
    on_loaded: Callable[[], None] | None = None
    # Set when a shutdown's --shutdown-timeout is over: the requests still running end with a 503
    # (an error event in a stream) before the server stops, not a 500 or a stream cut short.
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    loop: asyncio.AbstractEventLoop | None = None  # the server's, once it has started

    def __post_init__(self) -> None:
        self.key_bytes = tuple(key.encode() for key in self.settings.api_keys)

    def stop_requests_in(self, seconds: float) -> None:
        """From any thread (a signal handler): in `seconds`, end every request still running."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.loop.call_later, seconds, self.stopping.set)

    def set_llm(self, llm: LLM) -> None:
        self.model_name = self.settings.served_model_name or llm.model_path.stem
        # The session store's secret, so that owners survive a restart; without a store, owners live
        # in memory only and a secret for this process's life does.
        store = getattr(llm, "session_store", None)  # an LLM; a RemoteLLM has its engine process's secret
        secret = store.owner_secret if store is not None else getattr(llm, "owner_secret", None)
        self.owner_secret = secret or secrets.token_bytes(OWNER_SECRET_BYTES)
        self.sampling_defaults = _model_sampling(llm.model_path)
        with contextlib.suppress(OSError):
            self.model_created = int(llm.model_path.stat().st_mtime)
        self.llm = llm

    def ready_llm(self) -> LLM | RemoteLLM:
        if self.llm is None:
            detail = f": {self.load_error}" if self.load_error else "; retry shortly"
            raise APIError(503, f"The model is still loading{detail}.", "service_unavailable", code="model_loading")
        return self.llm


def _model_sampling(model_path) -> dict[str, float]:
    """The model's recommended values, each one checked as a request's would be: a value no request
    could send (a negative temperature in generation_config.json) is left out, with a warning."""
    from kvserve.sampling_params import SamplingParams
    from kvserve.weights.loader import recommended_sampling

    log = logging.getLogger("kvserve.server")
    try:
        found = recommended_sampling(model_path)
    except (KVServeError, OSError, ValueError, AttributeError) as exc:  # a damaged generation_config.json
        log.warning("the model's recommended sampling is not read (OpenAI's defaults instead): %s", exc)
        return {}
    kept = {}
    for name, value in found.items():
        try:
            SamplingParams(**{name: value})
        except (KVServeError, TypeError, ValueError) as exc:
            log.warning("the model's recommended %s is left out (OpenAI's default instead): %s", name, exc)
        else:
            kept[name] = value
    return kept


def server_state(request: Request) -> ServerState:
    return request.app.state.kvserve


async def require_key(request: Request) -> bytes | None:  # async: no thread-pool hop per request
    """The caller's API key (None without auth), or 401. Keys are compared in constant time, each of
    them every time; a key in the query string is never one (it would end up in logs)."""
    keys = server_state(request).key_bytes
    if not keys:
        return None
    header = request.headers.get("authorization", "")
    token = header[7:].encode(errors="surrogateescape") if header.lower().startswith("bearer ") else b""
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(token, key)
    if not matched or not token:  # no key is never a key, whatever keys are set
        where = "API keys in the query string are not accepted (they end up in logs)"
        if "api_key" not in request.url.query.lower().replace("-", "_"):
            where = "Missing or invalid API key"
        raise APIError(
            401, f"{where}: send 'Authorization: Bearer <key>'.", "authentication_error", code="invalid_api_key"
        )
    return token


async def authorize(request: Request) -> str | None:
    """The caller's owner id (None without auth): a keyed hash of its API key (key_owner). It owns
    the requests and sessions the caller creates."""
    token = await require_key(request)
    if token is None:
        return None
    state = server_state(request)
    if state.owner_secret is None:
        state.ready_llm()  # 503 while loading
    return key_owner(token.decode(), state.owner_secret)


async def read_json(request: Request) -> Any:
    """The body as JSON whose every string is valid Unicode (else InvalidRequestError naming the field).
    A compressed body is refused (415) rather than parsed as if it were not."""
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise APIError(
            415,
            f"Content-Encoding {encoding!r} is not supported; send the request body uncompressed, without "
            "a Content-Encoding header.",
            "invalid_request_error",
            "Content-Encoding",
            code="unsupported_content_encoding",
        )
    raw = await request.body()
    if len(raw) < OFF_THE_LOOP_BYTES:
        return _parsed(raw)
    return await asyncio.to_thread(_parsed, raw)


# A body this large is parsed on a worker thread: 4 MiB of JSON holds the event loop, and every stream
# on it, for tens of milliseconds.
OFF_THE_LOOP_BYTES = 64 << 10


def _parsed(raw: bytes) -> Any:
    try:
        body = json.loads(raw)
    except RecursionError:
        raise InvalidRequestError("The request body nests JSON too deeply; send a flat request.") from None
    except ValueError as exc:  # bad JSON or UTF-8, and integers longer than Python converts (4,300 digits)
        raise InvalidRequestError(f"The request body is not valid JSON: {exc}.") from None
    check_strings(body)
    return body


def check_strings(body: Any) -> None:
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


def check_model(state: ServerState, name: str | None) -> None:
    if name is not None and name != state.model_name:
        raise APIError(
            404,
            f"The model {name!r} does not exist; this server serves {state.model_name!r}.",
            "invalid_request_error",
            "model",
            "model_not_found",
        )
