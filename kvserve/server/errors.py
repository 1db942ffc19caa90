"""Every error leaves the server as an OpenAI error body {"error": {"message", "type", "param",
"code"}}: a client's mistake is a 4xx, a bug a 500 that harms no other request. Bodies over the
limit get a 413 before they are read whole."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from kvserve.errors import EngineClosedError, EngineError, InvalidRequestError, KVServeError
from kvserve.server.protocol import error_body
from kvserve.server.state import APIError
from kvserve.sessions.manager import SessionBusyError, SessionLimitError, SessionNotFoundError, SessionsOffError
from kvserve.sessions.store import SessionStoreError

logger = logging.getLogger("kvserve.server")


RETRY_AFTER_503_S = 5  # a model's load, an engine's silence (--stage-timeout, 5 s): a few seconds


def install_error_handlers(app: FastAPI) -> None:
    def respond(status: int, body: dict, headers: dict | None = None) -> JSONResponse:
        if status == 503:  # loading, stopping, an engine or store not answering: each passes (R4)
            headers = {"Retry-After": str(RETRY_AFTER_503_S), **(headers or {})}
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

    @app.exception_handler(SessionBusyError)
    async def session_busy(_: Request, exc: SessionBusyError) -> JSONResponse:
        return respond(409, error_body(str(exc), "invalid_request_error", "session_id", "session_busy"))

    @app.exception_handler(SessionLimitError)
    async def session_limit(_: Request, exc: SessionLimitError) -> JSONResponse:
        return respond(429, error_body(str(exc), "rate_limit_error", code="too_many_sessions"), {"Retry-After": "10"})

    @app.exception_handler(SessionsOffError)
    async def sessions_off(_: Request, exc: SessionsOffError) -> JSONResponse:
        return respond(403, error_body(str(exc), "permission_error", code="sessions_off"))

    @app.exception_handler(KVServeError)
    async def kvserve_error(_: Request, exc: KVServeError) -> JSONResponse:
        if isinstance(exc, SessionStoreError):
            return respond(503, error_body(str(exc), "service_unavailable", code="session_store_error"))
        if isinstance(exc, EngineClosedError):
            return respond(503, error_body(str(exc), "service_unavailable", code="engine_unavailable"))
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

    app.exception_handler(Exception)(unexpected)  # a bug in a middleware outside BugMiddleware

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = str(exc.detail)
        route = f"{request.method} {request.url.path}"
        if exc.status_code == 404 and message == "Not Found":  # the router's: no such route
            message = (
                f"There is no route {route}. kvserve serves GET /v1/models, POST /v1/completions, "
                "POST /v1/chat/completions, /v1/sessions, /v1/requests, /health and /metrics."
            )
        headers = exc.headers
        if exc.status_code == 405 and message == "Method Not Allowed":
            # every route of this path, where Starlette's Allow names the first one's methods only
            methods = [
                method
                for method in ("DELETE", "GET", "PATCH", "POST", "PUT")
                if any(r.matches({**request.scope, "method": method})[0] == Match.FULL for r in request.app.routes)
            ]
            allowed = ", ".join(methods) or (exc.headers or {}).get("Allow", "another method")
            headers = {**(exc.headers or {}), "Allow": allowed}
            message = f"{route} is not a route; {request.url.path} takes {allowed}."
        code = _HTTP_CODES.get(exc.status_code)
        return respond(exc.status_code, error_body(message, kind, code=code), headers)


async def unexpected(request: Request, exc: Exception) -> JSONResponse:
    """A bug, not the client's mistake; still an OpenAI-shaped body, and the engine keeps serving."""
    logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    message = f"The server failed on this request ({type(exc).__name__}); other requests are unaffected."
    return JSONResponse(error_body(message, "server_error"), status_code=500)


class BugMiddleware:
    """A route's bug answered 500 here, inside the CORS middleware, so that a browser may read it too
    (Starlette answers the exceptions nobody handled outside every middleware)."""

    def __init__(self, app: Callable) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            if started:  # a stream cut mid-answer: nothing more can be said on it
                raise
            await (await unexpected(Request(scope), exc))(scope, receive, send)


# OpenAI's error codes are strings or null; these name the router's and Starlette's own refusals.
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}


def _validation_body(errors: list[dict]) -> dict:
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    if first.get("type") == "model_type" and not _param(first.get("loc", ())):  # the body: an array, a string
        return error_body("The request body must be a JSON object of the request's fields.", "invalid_request_error")
    param = _param(first.get("loc", ()))
    msg = str(first.get("msg"))
    # pydantic's wording says what is wrong; these say what to do about it too
    msg = {
        "extra_forbidden": "kvserve does not know this field; remove it from the request (or check its spelling).",
        "missing": "this field is required; send it.",
    }.get(str(first.get("type")), msg)
    message = f"{param}: {msg}" if param and not msg.startswith(param) else msg
    return error_body(message, "invalid_request_error", param)


def _param(loc: tuple) -> str | None:
    """The field a pydantic error location names, as `messages[0].content`: list indices in brackets,
    without the union member pydantic tried (`str`, `list[int]`, `function-after[...]`)."""
    param = ""
    for part in loc:
        if isinstance(part, int):
            param += f"[{part}]"
        elif part != "body" and not _UNION_MEMBER.search(part):
            param += f".{part}" if param else part
    return param or None


# How pydantic names a member of a union in an error's location; no request field is spelled so.
_UNION_MEMBER = re.compile(r"^(str|int|float|bool|none|list|dict)$|[\[(]|^function-|^[A-Z]")


class BodyLimitMiddleware:
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
            error_body(
                f"The request body exceeds {self.max_bytes} bytes; send a smaller one (the server's limit is "
                "--max-body-bytes).",
                "invalid_request_error",
                code="body_too_large",
            )
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
