"""A stream paced to its client: generation pauses while the client does not read, and a client that
stops reading for good gives its slot back.

While the client reads, nothing happens. When it stops, the server's writes back up (the socket's
buffers, then uvicorn's, which then holds the response's generator at its `yield`), and the chunks the
engine goes on making pile up in the stream's queue. Past MAX_BUFFERED_CHUNKS the stream's engine
requests are paused (`LLM.pause`: out of the batch, their KV blocks freed, their place and output
kept); they resume once the client has read all but MAX_BUFFERED_CHUNKS // 4. Paused for
`stall_timeout` seconds, the stream is given up: `on_stall` aborts its requests and frees its
admission place, and the client, if it ever reads again, gets what was buffered and then the error.

How soon a stream pauses depends on how much the kernel buffers for a client that does not read: with
Linux's send-buffer autotuning (up to 4 MiB by default) a whole long stream could sit in it, generated
at full speed while others wait. `listening_socket` fixes the server's send buffer of every connection
at SEND_BUFFER_BYTES, far more than a token stream needs to flow at any speed a reader keeps up with.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable

from kvserve.errors import KVServeError

MAX_BUFFERED_CHUNKS = 64  # chunks a stream holds for a client that does not read before its requests pause
SEND_BUFFER_BYTES = 64 << 10  # each connection's kernel send buffer (Linux doubles it for its own bookkeeping)


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's listening socket (for uvicorn's `Server.run(sockets=...)`): its connections inherit
    a send buffer of SEND_BUFFER_BYTES."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[
        0
    ]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
    sock.bind(address)
    return sock


class StreamStalledError(KVServeError):
    """The client did not read its stream for --stall-timeout seconds: the request was aborted."""


class Backpressure:
    def __init__(self, llm, request_ids: list[str], stall_timeout: float) -> None:
        self.llm, self.request_ids, self.stall_timeout = llm, request_ids, stall_timeout
        self.on_stall: Callable[[], None] | None = None
        self.is_paused = False
        self._timer: asyncio.TimerHandle | None = None

    def update(self, num_buffered: int) -> None:
        """The stream's queue holds `num_buffered` chunks now (on the event loop)."""
        if not self.is_paused and num_buffered >= MAX_BUFFERED_CHUNKS:
            self.is_paused = True
            self._pause(True)
            self._timer = asyncio.get_running_loop().call_later(self.stall_timeout, self._stalled)
        elif self.is_paused and num_buffered <= MAX_BUFFERED_CHUNKS // 4:
            self.is_paused = False
            self.close()
            self._pause(False)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _pause(self, paused: bool) -> None:
        with contextlib.suppress(KVServeError):  # an engine gone: its requests fail on their own
            self.llm.pause(self.request_ids, paused)

    def _stalled(self) -> None:
        self._timer = None
        with contextlib.suppress(KVServeError):
            self.llm.abort(self.request_ids)
        if self.on_stall is not None:
            self.on_stall()

    def error(self) -> StreamStalledError:
        return StreamStalledError(
            f"The client did not read this stream for {self.stall_timeout:g} s (--stall-timeout); the request "
            "was aborted."
        )
