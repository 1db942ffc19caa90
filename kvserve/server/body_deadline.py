"""Deadlines on a request's arrival. Its head (request line and headers) must have arrived `timeout`
seconds after the connection opened, or after the last response on it, else the connection is closed;
its body must then arrive within `timeout` seconds of its headers, else 408 and the connection is
closed. uvicorn bounds an idle keep-alive connection, not a head or a body that trickles in (a byte
every few seconds holds a connection and a file descriptor, or a task, for as long as the client likes)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

from kvserve.server.protocol import error_body


class BodyDeadlineMiddleware:
    def __init__(self, app: Callable, timeout: float) -> None:
        self.app, self.timeout = app, timeout

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        deadline = asyncio.get_running_loop().time() + self.timeout
        body_done = False
        started = False

        async def timed_receive():
            nonlocal body_done
            if body_done:  # after the body: a wait for the disconnect, which has no deadline
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise _BodyTimeout from None
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        async def watched_send(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            return await self.app(scope, timed_receive, watched_send)
        except _BodyTimeout:
            if started:  # cannot happen for a route that reads its body before answering
                raise
            return await self._reject(send)

    async def _reject(self, send) -> None:
        message = f"The request body did not arrive within {self.timeout:g} s (--body-timeout); send it faster."
        body = json.dumps(error_body(message, "timeout_error", code="request_timeout")).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        await send({"type": "http.response.start", "status": 408, "headers": headers})
        await send({"type": "http.response.body", "body": body})


class _BodyTimeout(Exception):
    pass


def head_deadline_protocol(timeout: float) -> type:
    """uvicorn's HTTP/1.1 protocol (h11) with the deadline on a request's head: pass as `http=`."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeadDeadlineProtocol(H11Protocol):
        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_head_deadline()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_head_deadline()

        def _arm_head_deadline(self) -> None:
            cycle = self.cycle  # a new head starts a new cycle: then this deadline is not its

            def late() -> None:
                if self.cycle is cycle and self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                    self.transport.close()

            self.loop.call_later(timeout, late)

    return HeadDeadlineProtocol
