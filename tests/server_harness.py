"""A real uvicorn server on a free loopback port, in a background thread, for the HTTP tests."""

from __future__ import annotations

import os
import socket
import threading
import time
from contextlib import contextmanager

import httpx
import uvicorn

from kvserve.server.app import ServerSettings, create_app
from kvserve.server.backpressure import listening_socket
from kvserve.server.body_deadline import head_deadline_protocol


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int, marker: bytes) -> list[int]:
    """The processes under `pid` (any depth) whose command line holds `marker`."""
    children: dict[int, list[int]] = {}
    commands: dict[int, bytes] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    commands[int(entry)] = f.read()
            except OSError:
                continue
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], list(children.get(pid, []))
    while todo:
        current = todo.pop()
        if marker in commands.get(current, b""):
            found.append(current)
        todo.extend(children.get(current, []))
    return found


@contextmanager
def running_server(settings: ServerSettings, llm=None):
    """Yield the base URL of a started server; stop it (gracefully) on exit."""
    with serving(create_app(settings, llm)) as base:
        yield base


@contextmanager
def serving(app, healthy: bool = True, log_level: str = "warning"):
    """Yield the base URL of `app` served by uvicorn; with `healthy`, once /health answered 200,
    else once it answered at all. Stop it (gracefully) on exit."""
    sock = listening_socket("127.0.0.1", 0)  # as `kvserve serve` listens (its connections' send buffers)
    port = sock.getsockname()[1]
    timeout = app.state.kvserve.settings.body_timeout
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level=log_level, http=head_deadline_protocol(timeout))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    last = "nothing"  # what /health last answered, for the error below
    while time.monotonic() < deadline:
        try:  # a loaded machine may take seconds to answer: a short timeout would only ask again
            answer = httpx.get(f"{base}/health", timeout=10)
            if answer.status_code == 200 or not healthy:
                break
            last = f"{answer.status_code} {answer.text[:300]}"
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(0.05)
    else:
        raise RuntimeError(f"server did not become healthy in 60 s (started: {server.started}); /health: {last}")
    try:
        yield base
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
