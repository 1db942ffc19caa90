"""What the HTTP edge refuses or hides before any route runs: request lines of an HTTP version the
server does not speak (505), and API keys a client put in a URL's query string (never written to
the access log)."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable

from kvserve.server.protocol import error_body

# Query parameters that carry credentials: their values never reach the access log.
_QUERY_SECRET = re.compile(r"([?&](?:api[_-]?key|key|access[_-]?token|token)=)[^&#\s\"]*", re.IGNORECASE)


async def send_error(send: Callable, status: int, body: dict) -> None:
    """Answer an ASGI HTTP request with an OpenAI error body, before any route ran."""
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


class HTTPVersionMiddleware:
    """505 for a request line that is not HTTP/1.x (`HTTP/0.9`, `HTTP/2.0` in plain text): the server
    speaks HTTP/1.1, and h11 passes any version through."""

    def __init__(self, app: Callable) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        version = scope.get("http_version", "1.1") if scope["type"] == "http" else "1.1"
        if not version.startswith("1."):
            message = f"HTTP/{version} is not supported; send HTTP/1.1 (or HTTP/1.0) requests."
            return await send_error(
                send, 505, error_body(message, "invalid_request_error", code="http_version_not_supported")
            )
        return await self.app(scope, receive, send)


class QueryKeyRedactor(logging.Filter):
    """uvicorn's access log writes each request's path with its query string: the value of a
    credential parameter (`?api_key=...`) becomes `[redacted]` there."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(
                _QUERY_SECRET.sub(r"\1[redacted]", arg) if isinstance(arg, str) else arg for arg in record.args
            )
        return True


def redact_access_log() -> None:
    """Install QueryKeyRedactor on uvicorn's access logger (once; after uvicorn configured logging)."""
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, QueryKeyRedactor) for f in access.filters):
        access.addFilter(QueryKeyRedactor())
