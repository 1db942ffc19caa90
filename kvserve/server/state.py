"""The server's settings and state, and what every route needs: the caller's identity, the LLM
once loaded, the body as checked JSON."""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request

from kvserve.errors import InvalidRequestError, check_text
from kvserve.llm import LLM
from kvserve.pipeline.topology import Topology
from kvserve.server.metrics import ServerMetrics
from kvserve.sessions.store import key_owner

if TYPE_CHECKING:
    from kvserve.server.engine_client import RemoteLLM

DEFAULT_MAX_BODY_BYTES = 4 << 20


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
    activations: str = "auto"
    batch_invariant: bool = True
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_sessions: int = 1024
    max_sessions_per_key: int | None = 256
    session_ttl: float | None = 3600.0
    session_db: str | None = None  # None: $KVSERVE_HOME/sessions.db
    engine_process: bool = True  # the engine in a process of its own (engine_process.py), else a thread here
    pipeline: Topology | None = None  # the model's layers over several processes or hosts (kvserve/pipeline)


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
    num_inflight: int = 0  # engine requests (prompts x n of every admitted body) not yet over
    # (owner, response id or client X-Request-Id) -> engine request ids: only their owner may abort them
    requests: dict[tuple[str | None, str], list[str]] = field(default_factory=dict)
    metrics: ServerMetrics | None = None
    key_bytes: tuple[bytes, ...] = field(init=False)  # the API keys, encoded once for authorize

    def __post_init__(self) -> None:
        self.key_bytes = tuple(key.encode() for key in self.settings.api_keys)

    def set_llm(self, llm: LLM) -> None:
        self.model_name = self.settings.served_model_name or llm.model_path.stem
        self.llm = llm

    def ready_llm(self) -> LLM | RemoteLLM:
        if self.llm is None:
            detail = f": {self.load_error}" if self.load_error else "; retry shortly"
            raise APIError(503, f"The model is still loading{detail}.", "service_unavailable", code=503)
        return self.llm


def server_state(request: Request) -> ServerState:
    return request.app.state.kvserve


async def authorize(request: Request) -> str | None:  # async: no thread-pool hop per request
    """The caller's owner id, a hash of its API key (None without auth): it owns the requests and
    sessions the caller creates. Keys are compared in constant time, each of them every time."""
    keys = server_state(request).key_bytes
    if not keys:
        return None
    header = request.headers.get("authorization", "")
    token = header[7:].encode(errors="surrogateescape") if header.lower().startswith("bearer ") else b""
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(token, key)
    if not matched:
        raise APIError(
            401,
            "Missing or invalid API key: send 'Authorization: Bearer <key>'.",
            "authentication_error",
            code="invalid_api_key",
        )
    return key_owner(token.decode())


async def read_json(request: Request) -> Any:
    """The body as JSON whose every string is valid Unicode (else InvalidRequestError naming the field)."""
    raw = await request.body()
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
