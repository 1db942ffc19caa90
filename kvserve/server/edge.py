"""What the HTTP edge refuses or hides before any route runs: request lines of an HTTP version the
server does not speak (505), requests another site's page made (403), and API keys a client put in a
URL's query string (never written to the access log)."""

from __future__ import annotations

import ipaddress
import json
import logging
import re
import socket
from collections.abc import Callable
from urllib.parse import urlsplit

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


class CrossSiteMiddleware:
    """403 for a request another site's page made. A browser sends a simple POST (a `text/plain` body,
    which the server reads as JSON) from any page without asking first, so CORS alone let every site
    the user opened use a server without --api-key: its model, and its sessions (filling the key's
    limit). Refused: an `Origin` that is neither the server's own (its `Host`, or the `X-Forwarded-Host`
    a proxy sets) nor in --allowed-origins; and, on a server bound to a loopback address, a browser's
    request (one with `Origin` or `Sec-Fetch-Site`) whose `Host` is not a name of this machine: a page
    whose name was rebound to 127.0.0.1 sends its own, as Ollama checks it. Other clients (SDKs, curl,
    a proxy's own calls) send neither header and pass whatever their Host."""

    def __init__(self, app: Callable, allowed_origins: tuple[str, ...], bind_host: str) -> None:
        self.app = app
        self.allowed = frozenset(allowed_origins)
        self.loopback = _is_loopback(bind_host)
        machine = socket.gethostname().lower()
        self.machine_names = {"localhost", machine, machine.split(".")[0]}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or "*" in self.allowed:
            return await self.app(scope, receive, send)
        wanted = (b"host", b"origin", b"sec-fetch-site", b"x-forwarded-host")
        headers = {name: value.decode("latin-1") for name, value in scope["headers"] if name in wanted}
        host, origin = headers.get(b"host", ""), headers.get(b"origin")
        browser = origin is not None or b"sec-fetch-site" in headers
        refusal = None
        if self.loopback and browser and host and not _names_this_machine(host, self.machine_names):
            refusal = (
                f"Host {host!r:.100} is not a name of this machine, and the server listens on a loopback address "
                "(a page whose name was pointed at it sends its own); open it as localhost, or have a proxy in front "
                "send 'Host: localhost' and 'X-Forwarded-Host' with its own name."
            )
        elif (
            origin is not None
            and origin not in self.allowed
            and urlsplit(origin).netloc not in (host, headers.get(b"x-forwarded-host"))
        ):
            refusal = (
                f"A page of {origin!r:.100} may not call this server from a browser; start it with "
                "--allowed-origins naming that site (KVSERVE_ALLOWED_ORIGINS) to let it."
            )
        if refusal is not None and scope["method"] != "OPTIONS":  # a preflight is CORS's to answer
            return await send_error(send, 403, error_body(refusal, "permission_error", code="cross_site_request"))
        return await self.app(scope, receive, send)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _names_this_machine(host: str, names: set[str]) -> bool:
    """An IP address (a page cannot rebind one), a subdomain of localhost, or one of `names`."""
    name = urlsplit(f"//{host}").hostname or ""
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        pass
    return name in names or name.endswith(".localhost")


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
