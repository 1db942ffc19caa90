"""Faults, durability and bounds (guarantee R8, issue 33): one process owns a session store; a write is
durable before it is acknowledged, or the answer is an error; /health tells the truth about the store;
a session's size is bounded; an engine process that stops answering or dies is noticed; a client that
does not read its stream holds no slot forever. Real processes, real SQLite files, real signals."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from kvserve.sessions.store import SessionStore, SessionStoreError


def _python(code: str) -> subprocess.Popen:
    """A Python process running `code`, its stdout piped (it prints 'ready' once set up)."""
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def _serve(*flags: str, env: dict | None = None) -> subprocess.Popen:
    command = [sys.executable, "-m", "kvserve.cli", "serve", "--log-level", "warning", *flags]
    return subprocess.Popen(command, env={**os.environ, **(env or {})}, stderr=subprocess.PIPE, text=True)


# ----- one process owns a store (6) ---------------------------------------------------------------
def test_a_second_process_on_the_same_store_is_refused_naming_the_holder(tmp_path):
    db = tmp_path / "sessions.db"
    holder = _python(
        f"from kvserve.sessions.store import SessionStore; s = SessionStore({str(db)!r}); print('ready', flush=True); "
        "import signal; signal.pause()"
    )
    try:
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(SessionStoreError, match=f"pid {holder.pid} on {socket.gethostname()}"):
            SessionStore(db)
        server = _serve("--session-db", str(db), "--port", "1")  # refused before it loads a model
        assert server.wait(60) == 2
        assert f"pid {holder.pid}" in server.stderr.read()
        holder.kill()  # the kernel drops the lock with its holder, even on SIGKILL
        holder.wait(30)
        SessionStore(db).close()
    finally:
        holder.kill()
        holder.wait()


def test_one_process_may_open_its_store_twice(tmp_path):
    """Two LLMs in one process (the tests do it) share the lock; it is released with the last."""
    first, second = SessionStore(tmp_path / "s.db"), SessionStore(tmp_path / "s.db")
    first.close()
    holder = _python(
        f"from kvserve.sessions.store import SessionStore, SessionStoreError\n"
        f"try:\n    SessionStore({str(tmp_path / 's.db')!r})\nexcept SessionStoreError:\n    print('refused')"
    )
    assert holder.stdout.read().strip() == "refused"
    holder.wait(30)
    second.close()
    SessionStore(tmp_path / "s.db").close()
