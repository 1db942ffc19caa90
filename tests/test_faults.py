"""Faults, durability and bounds (guarantee R8, issue 33): one process owns a session store; a write is
durable before it is acknowledged, or the answer is an error; /health tells the truth about the store;
a session's size is bounded; an engine process that stops answering or dies is noticed; a client that
does not read its stream holds no slot forever. Real processes, real SQLite files, real signals."""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time

import httpx
import pytest

from kvserve import LLM, SamplingParams
from kvserve.errors import InvalidRequestError
from kvserve.server.app import ServerSettings, create_app
from kvserve.sessions.store import SessionStore, SessionStoreError
from tests.conftest import StepGate, wait_idle_and_check
from tests.server_harness import descendants, free_port, running_server, serving
from tests.test_engine_process import MODEL, settings

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
MAX_SESSION_TOKENS = 200  # the byte tokenizer's tokens are bytes: ~180 characters of text


def _llm(model, db, **overrides) -> LLM:
    options = dict(dtype="float32", kv_cache_tokens=4096, max_session_tokens=MAX_SESSION_TOKENS, progress=False)
    return LLM(str(model), session_db=db, **{**options, **overrides})


@pytest.fixture(scope="module")
def llm(tiny_model_dir, tmp_path_factory):
    with _llm(tiny_model_dir, tmp_path_factory.mktemp("faults") / "sessions.db") as llm:
        yield llm


@pytest.fixture(scope="module")
def base(llm):
    with running_server(ServerSettings(served_model_name=MODEL), llm) as base:
        yield base


def _rows(llm: LLM, session_id: str) -> list[tuple[str, str, bool]]:
    """What the store holds of a session, read from its file by a connection of the test's own."""
    with sqlite3.connect(llm.session_store.path) as db:
        query = "SELECT role, content, is_open FROM messages WHERE session_id = ? ORDER BY seq"
        return [(role, content, bool(is_open)) for role, content, is_open in db.execute(query, (session_id,))]


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
    server = None
    try:
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(SessionStoreError, match=f"pid {holder.pid} on {socket.gethostname()}"):
            SessionStore(db)
        (tmp_path / "link.db").symlink_to(db)  # another name for the same file: before, its own lock
        with pytest.raises(SessionStoreError, match=f"pid {holder.pid} on {socket.gethostname()}"):
            SessionStore(tmp_path / "link.db")
        server = _serve("--session-db", str(db), "--port", "1")  # refused before it loads a model
        assert server.wait(60) == 2
        assert f"pid {holder.pid}" in server.stderr.read()
        holder.kill()  # the kernel drops the lock with its holder, even on SIGKILL
        holder.wait(30)
        SessionStore(db).close()
    finally:
        for process in (holder, server):  # a server the refusal failed to stop must not outlive the test
            if process is not None:
                process.kill()
                process.wait()


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
            assert error["type"] == "service_unavailable" and "not answered" in error["message"], error
            later = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
            assert later.status_code == 503 and "not answered" in later.json()["error"]["message"]
            assert later.headers["retry-after"] == "5"  # every 503 says when to come back (R4)
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


def test_a_store_write_that_does_not_return_fails_requests_as_a_stopped_engine_does(tiny_model_dir, tmp_path):
    """A frozen disk under the session store held the engine thread in a write: every request waited
    (19 s in an outside test, as long as the disk stayed frozen) while /health said ok. The engine
    process answers no ping while a store write is in progress: past the timeout, requests fail with
    503 and /health says why, and once the write returns it serves again. Here another connection
    holds the database's write lock, so the store's write waits (SQLite's 5 s busy timeout), as it
    would on a frozen disk; the engine's timeout is 2 s of those 5 (not less: the writes that return, with
    their syncs, must not outlast it on a loaded machine)."""
    app = create_app(settings(tiny_model_dir, tmp_path, engine_timeout=2.0))
    with serving(app) as base:
        sid = httpx.post(f"{base}/v1/sessions", json={}).json()["id"]
        message = {"role": "user", "content": "x"}
        holder = sqlite3.connect(tmp_path / "sessions.db", isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        try:
            waited = httpx.post(f"{base}/v1/sessions/{sid}/messages", json=message, timeout=60)
            assert waited.status_code == 503 and "not answered" in waited.json()["error"]["message"], waited.text
            assert waited.headers["retry-after"] == "5"
            health = httpx.get(f"{base}/health")
            assert health.status_code == 503 and "not answered" in health.json()["detail"]
        finally:
            holder.rollback()
            holder.close()
        wait_for(lambda: httpx.get(f"{base}/health").status_code == 200)
        assert httpx.post(f"{base}/v1/sessions/{sid}/messages", json=message).status_code == 200
        assert httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}).is_success
        wait_idle_and_check(app.state.kvserve.llm)


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


# ----- every acknowledged write is stored first (4), and a session is bounded (3) -------------------
def test_every_acknowledged_write_is_stored_before_its_answer_in_the_order_it_will_read(llm):
    """A message and an append are in the file when their call returns, also while a turn runs (queued
    behind it: stored as the history will read); the turn's reply goes before them."""
    s = llm.session(system="sys")
    assert _rows(llm, s.id) == [("system", "sys", False)]
    s.add_message("user", "hello")
    s.append("streamed ")
    s.append("in")  # still open: a later append would join it, after a restart too
    assert _rows(llm, s.id) == [("system", "sys", False), ("user", "hello", False), ("user", "streamed in", True)]
    with StepGate(llm) as gate:
        chunks = []
        turn = threading.Thread(target=lambda: chunks.extend(s.stream(GREEDY)))
        turn.start()
        assert gate.entered.wait(30)  # the turn runs (its first step waits at the gate)
        queued = threading.Thread(target=s.add_message, args=("user", "queued behind the turn"))
        queued.start()
        gate.allow(1)  # one step, then the engine takes the message: queued behind the running turn
        queued.join(30)
        assert not queued.is_alive()
        assert _rows(llm, s.id) == [
            ("system", "sys", False),
            ("user", "hello", False),
            ("user", "streamed in", False),  # closed by the turn that answers it
            ("user", "queued behind the turn", False),
        ]
        gate.open()
        turn.join(30)
    reply = "".join(c.text for c in chunks)
    assert [m["content"] for m in s.info()["messages"]] == [
        "sys",
        "hello",
        "streamed in",
        reply,
        "queued behind the turn",
    ]
    assert _rows(llm, s.id) == [
        ("system", "sys", False),
        ("user", "hello", False),
        ("user", "streamed in", False),
        ("assistant", reply, False),
        ("user", "queued behind the turn", False),
    ]
    s.close()
    assert _rows(llm, s.id) == []
    wait_idle_and_check(llm)


def test_a_session_is_bounded_and_what_would_exceed_it_is_refused_and_not_applied(llm, base):
    s = llm.session(system="bounded")
    s.append("a" * 100)
    before = s.info()
    for call, param in ((lambda: s.append("b" * 150), "text"), (lambda: s.add_message("user", "c" * 150), "content")):
        with pytest.raises(InvalidRequestError, match="max-session-tokens") as refused:
            call()
        assert refused.value.param == param
    assert s.info() == before and _rows(llm, s.id)[-1] == ("user", "a" * 100, True)  # nothing applied
    # Over HTTP: 400 naming the field, and the session as it was.
    r = httpx.post(f"{base}/v1/sessions/{s.id}/append", json={"text": "d" * 150})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text", r.text
    assert httpx.get(f"{base}/v1/sessions/{s.id}").json()["messages"] == before["messages"]
    # Bytes are bounded before anything is tokenized: 16 per token of the session's bound by default.
    too_long = "e" * (16 * MAX_SESSION_TOKENS + 1)
    with pytest.raises(InvalidRequestError, match="max-message-bytes"):
        s.append(too_long)
    r = httpx.post(f"{base}/v1/sessions", json={"system": too_long})
    assert r.status_code == 400 and "max-message-bytes" in r.json()["error"]["message"]
    r = httpx.post(f"{base}/v1/sessions", json={"system": "f" * 300})  # few bytes, too many tokens
    assert r.status_code == 400 and "max-session-tokens" in r.json()["error"]["message"]
    # A turn whose reply could take the session past its bound is refused too.
    with pytest.raises(InvalidRequestError, match=r"lower max_tokens to at most \d+,") as refused:
        s.generate(SamplingParams(max_tokens=150, temperature=0))
    assert refused.value.param == "max_tokens"
    room = int(str(refused.value).split("at most ")[1].split(",")[0])
    s.append("g" * room)  # the conversation takes the whole bound
    with pytest.raises(InvalidRequestError, match="no reply fits: start a new session"):  # max_tokens cannot help
        s.generate(SamplingParams(max_tokens=2, temperature=0))
    s.close()
    wait_idle_and_check(llm)


# ----- /health tells the truth about the store (4, 5) ----------------------------------------------
def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


@pytest.mark.parametrize("removed", ["sessions.db", "sessions.db-wal"])
def test_a_removed_store_turns_writes_into_errors_and_health_says_so(tiny_model_dir, tmp_path, removed):
    """SQLite would go on writing into the unlinked file: every write acknowledged and lost. The store
    checks that its file and its write-ahead log are the ones it opened (device and inode) around every
    write: with the log removed, the commits not yet copied into the file were acknowledged and lost."""
    db = tmp_path / "sessions.db"
    with _llm(tiny_model_dir, db) as llm, running_server(ServerSettings(served_model_name=MODEL), llm) as base:
        sid = httpx.post(f"{base}/v1/sessions", json={"system": "here"}).json()["id"]
        (tmp_path / removed).unlink()
        for method, path, body in (
            ("POST", "", {"system": "new"}),
            ("POST", f"/{sid}/messages", {"role": "user", "content": "x"}),
            ("POST", f"/{sid}/append", {"text": "x"}),
            ("DELETE", f"/{sid}", None),
        ):
            error = _error(httpx.request(method, f"{base}/v1/sessions{path}", json=body), 503)
            assert error["code"] == "session_store_error" and "removed" in error["message"], (method, path)
        health = httpx.get(f"{base}/health")
        assert health.status_code == 503 and "was removed" in health.json()["detail"]
        stateless = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert stateless.status_code == 200  # only the store's operations fail
        wait_idle_and_check(llm, pinned=llm.engine.call(lambda: llm.sessions.num_pinned_blocks))


def test_a_full_store_answers_errors_health_says_so_delete_frees_space_and_nothing_acknowledged_is_lost(
    tiny_model_dir, tmp_path
):
    db = tmp_path / "sessions.db"
    acknowledged: dict[str, list[str]] = {}
    with (
        _llm(tiny_model_dir, db, max_session_tokens=None) as llm,
        running_server(ServerSettings(served_model_name=MODEL), llm) as base,
    ):
        pages = llm.session_store._db.execute("PRAGMA page_count").fetchone()[0]
        llm.session_store._db.execute(f"PRAGMA max_page_count = {pages + 6}")  # the fault: room for 6 pages more
        for i in range(100):  # ~1 KB a session: full long before
            r = httpx.post(f"{base}/v1/sessions", json={"system": f"{i} " + "s" * 600})
            if r.status_code != 200:
                break
            sid = r.json()["id"]
            acknowledged[sid] = [f"{i} " + "s" * 600]
            r = httpx.post(f"{base}/v1/sessions/{sid}/messages", json={"role": "user", "content": "m" * 300})
            if r.status_code != 200:
                break
            acknowledged[sid].append("m" * 300)
        error = _error(r, 503)
        assert error["code"] == "session_store_error" and "full" in error["message"]
        health = httpx.get(f"{base}/health")
        assert health.status_code == 503 and "full" in health.json()["detail"]
        for sid in list(acknowledged):  # a client can free space: DELETE works on a full store
            assert httpx.delete(f"{base}/v1/sessions/{sid}").status_code == 200
            del acknowledged[sid]
            if httpx.get(f"{base}/health").status_code == 200:  # the probe's write (8 KB) fits again
                break
        assert acknowledged, "health said the store was full until every session was deleted"
        r = httpx.post(f"{base}/v1/sessions", json={"system": "after"})
        assert r.status_code == 200, r.text
        acknowledged[r.json()["id"]] = ["after"]
        wait_idle_and_check(llm, pinned=llm.engine.call(lambda: llm.sessions.num_pinned_blocks))
    with _llm(tiny_model_dir, db) as again:  # a restart: every acknowledged write is there
        for sid, contents in acknowledged.items():
            assert [m["content"] for m in again.session(id=sid).info()["messages"]] == contents


def test_a_corrupted_page_is_reported_for_good_and_refused_at_the_next_start(tiny_model_dir, tmp_path):
    db = tmp_path / "sessions.db"
    with _llm(tiny_model_dir, db) as llm:
        sid = llm.session(system="x" * 50, messages=[{"role": "user", "content": "y" * 50}]).id
    with _llm(tiny_model_dir, db) as llm, running_server(ServerSettings(served_model_name=MODEL), llm) as base:
        with sqlite3.connect(db) as check:
            page_size = check.execute("PRAGMA page_size").fetchone()[0]
            (root,) = check.execute("SELECT rootpage FROM sqlite_master WHERE name = 'messages'").fetchone()
        with open(db, "r+b") as f:  # the fault: garbage over the messages table's page, under the server
            f.seek((root - 1) * page_size)
            f.write(bytes(range(256)) * (page_size // 256))
        error = _error(httpx.get(f"{base}/v1/sessions/{sid}"), 503)
        assert error["code"] == "session_store_error" and "malformed" in error["message"]
        assert httpx.post(f"{base}/v1/sessions", json={"system": "new"}).status_code in (200, 503)
        for _ in range(2):  # a write that succeeds does not mend it
            health = httpx.get(f"{base}/health")
            assert health.status_code == 503 and "malformed" in health.json()["detail"]
    with pytest.raises(SessionStoreError, match="damaged"):
        _llm(tiny_model_dir, db)


# ----- a client that does not read (8) ---------------------------------------------------------------
def _silent_stream(base: str, body: dict) -> socket.socket:
    """A streaming request on a socket that is never read (a receive buffer of a few KB), so the
    server's writes back up: a client that does not read."""
    host, port = base.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    payload = json.dumps(body).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    sock.sendall(f"{head}Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


# Big events (20 logprobs each, ~2 KB) fill the socket's buffers long before the 1000 tokens are made.
SILENT = {"model": MODEL, "prompt": "x", "max_tokens": 1000, "ignore_eos": True, "stream": True, "logprobs": 20}


def test_streams_nobody_reads_are_paused_off_the_batch_and_new_requests_still_run(llm):
    """max_num_seqs=2 and three streams whose clients do not read: paused once their buffers are full
    (out of the batch, their KV freed, keeping their place), so a new request still gets its tokens."""
    settings = ServerSettings(served_model_name=MODEL, max_num_seqs=2, stall_timeout=600.0)
    with running_server(settings, llm) as base:
        silent = [_silent_stream(base, SILENT) for _ in range(3)]
        try:
            wait_for(lambda: llm.stats()["num_paused"] == 3)
            counts = llm.check_integrity()
            assert counts["running"] == 0 and counts["used"] == 0  # out of the batch, no KV block held
            # ignore_eos: the tiny model's 300-token vocabulary samples its EOS within 8 tokens now and then
            body = {"model": MODEL, "prompt": "new", "max_tokens": 8, "ignore_eos": True}
            r = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        finally:
            for sock in silent:
                sock.close()  # a disconnect aborts them
        wait_for(lambda: llm.stats()["num_paused"] == 0)
    wait_idle_and_check(llm)


def test_a_stream_nobody_reads_frees_its_slot_after_the_stall_timeout(llm):
    settings = ServerSettings(served_model_name=MODEL, stall_timeout=0.5)  # injected: the timeout is the subject
    app = create_app(settings, llm)
    aborted = llm.stats()["num_aborted_total"]
    with serving(app) as base:
        sock = _silent_stream(base, SILENT)
        try:
            wait_for(lambda: llm.stats()["num_aborted_total"] == aborted + 1)  # paused, then aborted
            wait_idle_and_check(llm)
            assert app.state.kvserve.num_inflight == 0  # its admission place is free too
        finally:
            sock.close()


def test_a_body_that_does_not_arrive_in_time_gets_408_and_the_connection_closed(llm):
    with running_server(ServerSettings(served_model_name=MODEL, body_timeout=0.5), llm) as base:
        host, port = base.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=60) as sock:
            head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            sock.sendall(f"{head}Content-Length: 100\r\n\r\n{{".encode())  # 1 of 100 bytes, then nothing
            answer = b""
            while chunk := sock.recv(65536):  # to the end: the server closes the connection
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert b'"type":"timeout_error"' in answer.replace(b" ", b"") and b'"code":"request_timeout"' in answer.replace(
            b" ", b""
        )
        assert httpx.get(f"{base}/health").status_code == 200


def _length(response: bytes) -> int:
    """A response head's Content-Length (0 until the head is whole)."""
    head = response.split(b"\r\n\r\n", 1)[0].lower()
    return next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.startswith(b"content-length:")), 0)


def test_a_head_that_does_not_arrive_in_time_has_its_connection_closed(llm):
    """A request line and headers that trickle in (slowloris), or never come, held a connection (a file
    descriptor) for as long as the client liked: now the connection is closed once --body-timeout has
    passed since it opened, or since its last response. A head that arrives in time is answered."""
    with running_server(ServerSettings(served_model_name=MODEL, body_timeout=0.5), llm) as base:
        host, port = base.removeprefix("http://").split(":")
        for sent in (b"", b"GET /health HTTP/1.1\r\nHost: x\r\n"):  # nothing; a head without its end
            with socket.create_connection((host, int(port)), timeout=60) as sock:
                sock.sendall(sent)
                assert sock.recv(65536) == b""  # closed by the server (a hang guard: 60 s)
        with socket.create_connection((host, int(port)), timeout=60) as sock:  # after a response, the same
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = b""
            while chunk := sock.recv(65536):  # the whole response: what follows is the server's doing
                answer += chunk
                if b"\r\n\r\n" in answer and len(answer.split(b"\r\n\r\n", 1)[1]) >= _length(answer):
                    break
            assert answer.startswith(b"HTTP/1.1 200")
            sock.sendall(b"GET /health HTTP/1.1\r\n")
            assert sock.recv(65536) == b""
