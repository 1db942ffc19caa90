"""Faults, durability and bounds (guarantee R8, issue 33): one process owns a session store; a write is
durable before it is acknowledged, or the answer is an error; /health tells the truth about the store;
a session's size is bounded; an engine process that stops answering or dies is noticed; a client that
does not read its stream holds no slot forever. Real processes, real SQLite files, real signals."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from kvserve.server.app import create_app
from kvserve.sessions.store import SessionStore, SessionStoreError
from tests.conftest import wait_idle_and_check
from tests.server_harness import descendants, free_port, serving
from tests.test_engine_process import MODEL, settings


def _python(code: str) -> subprocess.Popen:
    """A Python process running `code`, its stdout piped (it prints 'ready' once set up)."""
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def wait_for(condition, timeout: float = 60.0):
    """Poll until `condition()` is truthy (returned); fail after `timeout` s (a hang, not a race)."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, "the condition did not come true"
        time.sleep(0.05)
    return value


def _healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


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


# ----- an engine process that stops answering (2) or dies (7) -------------------------------------
def _events(response) -> list[str]:
    return [line[6:] for line in response.iter_lines() if line.startswith("data: ")]


def test_a_stopped_engine_process_fails_requests_fast_and_recovers_on_sigcont(tiny_model_dir, tmp_path):
    """SIGSTOP of the engine process: once it has not answered for the injected timeout, running
    streams end with an error event, new requests get 503 at once and /health says why; SIGCONT: it
    serves again, and the aborted streams' blocks were freed."""
    app = create_app(settings(tiny_model_dir, tmp_path, engine_timeout=1.0))
    with serving(app) as base:
        engine = app.state.kvserve.llm
        body = {"model": MODEL, "prompt": "x", "max_tokens": 900, "ignore_eos": True, "stream": True}
        stopped = False
        try:
            with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as response:
                events = []
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if len(events) == 1:
                            os.kill(engine.process.pid, signal.SIGSTOP)
                            stopped = True
            assert events[-1] == "[DONE]"
            error = json.loads(events[-2])["error"]
            assert error["type"] == "server_error" and "not answered" in error["message"], error
            later = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
            assert later.status_code == 503 and "not answered" in later.json()["error"]["message"]
            assert httpx.post(f"{base}/v1/sessions", json={}).status_code == 503
            health = httpx.get(f"{base}/health")
            assert health.status_code == 503 and "not answered" in health.json()["detail"]
        finally:
            if stopped:
                os.kill(engine.process.pid, signal.SIGCONT)
        wait_for(lambda: httpx.get(f"{base}/health").status_code == 200)
        again = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert again.status_code == 200
        wait_idle_and_check(engine)


def test_serve_exits_non_zero_when_its_engine_process_is_killed(tiny_model_dir, tmp_path):
    """A supervisor restarts what exits: a front end without its engine must not answer 503 forever."""
    port = free_port()
    env = {"KVSERVE_SESSION_DB": str(tmp_path / "sessions.db"), "KVSERVE_DTYPE": "float32"}
    server = _serve("--model", str(tiny_model_dir), "--port", str(port), env=env)
    try:
        wait_for(lambda: _healthy(f"http://127.0.0.1:{port}"))
        (engine,) = descendants(server.pid, b"spawn_main")
        os.kill(engine, signal.SIGKILL)
        assert server.wait(60) == 1  # a hang guard: it exits within a moment of the engine's death
        assert "the engine process exited with code -9" in server.stderr.read()
    finally:
        server.kill()
        server.wait()
