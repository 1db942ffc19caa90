"""Isolation under attack (R6): no client can kill, cancel or stall another client's request.

Each test reproduces one way a neighbour could harm a request, over real HTTP where the defect was
found there, and holds the engine at a step gate wherever "still running" must be a fact.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import threading
import time

import httpx
import pytest

from kvserve import LLM, SamplingParams
from kvserve.errors import EngineError, InvalidRequestError
from kvserve.server.app import ServerSettings
from kvserve.sessions.store import SessionStore, SessionStoreError, key_owner
from tests.conftest import StepGate, run_beside_a_failing_request, wait_idle_and_check
from tests.server_harness import running_server

MODEL = "tiny"
GREEDY = {"temperature": 0, "ignore_eos": True}


def solo(llm, prompt: str, max_tokens: int) -> str:
    return llm.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)).text


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:300])
    assert r.headers["content-type"].startswith("application/json"), r.text[:300]
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["code"] is None or isinstance(error["code"], str), error  # OpenAI's codes: strings or null
    if param is not None:
        assert error["param"] == param, error
    return error


@pytest.fixture(scope="module")
def llm(tiny_model_dir, tmp_path_factory):
    db = tmp_path_factory.mktemp("isolation") / "sessions.db"
    with LLM(
        str(tiny_model_dir),
        dtype="float32",
        kv_cache_tokens=8192,
        session_db=db,
        max_sessions_per_owner=2,
        progress=False,
    ) as llm:
        yield llm


@pytest.fixture(scope="module")
def base(llm):
    settings = ServerSettings(served_model_name=MODEL, api_keys=("alice", "bob"), max_num_seqs=4, max_queue=8)
    with running_server(settings, llm) as base:
        yield base


@pytest.fixture(autouse=True)
def no_leaks(llm):
    yield
    sessions = llm.engine.call(lambda: llm.sessions.num_pinned_blocks)
    wait_idle_and_check(llm, pinned=sessions)


def post(base: str, route: str, body, key: str = "alice", **kwargs) -> httpx.Response:
    content = body if isinstance(body, bytes | str) else json.dumps(body)
    headers = {**auth(key), "content-type": "application/json"}
    return httpx.post(f"{base}/v1/{route}", content=content, headers=headers, timeout=60, **kwargs)


# ----- 1. out-of-range numbers are refused at the edge; a failing step fails only its request --------
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("top_k", 2**63),
        ("seed", 2**64),
        ("seed", 2**63),
        ("top_k", 2**31),
        ("max_tokens", 2**63),
        ("min_tokens", 2**40),
    ],
)
def test_numbers_that_do_not_fit_the_engine_get_400_naming_the_field(base, field, value):
    r = post(base, "completions", {"model": MODEL, "prompt": "x", "max_tokens": 4, field: value})
    assert_openai_error(r, 400, field)


def test_overflowing_values_beside_a_stream_leave_it_intact(base, llm):
    expected = solo(llm, "neighbour", 64)
    with StepGate(llm) as gate:
        result = {}

        def stream() -> None:
            body = {"model": MODEL, "prompt": "neighbour", "max_tokens": 64, "stream": True, **GREEDY}
            with httpx.stream("POST", f"{base}/v1/completions", json=body, headers=auth("alice"), timeout=60) as s:
                events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
            result["text"] = "".join(e["choices"][0]["text"] for e in events if "choices" in e)
            result["errors"] = [e for e in events if "error" in e]

        thread = threading.Thread(target=stream)
        thread.start()
        assert gate.entered.wait(30)  # the neighbour is in the engine, its step held
        for field, value in (("top_k", 2**63), ("seed", 2**64)):
            body = {"model": MODEL, "prompt": "attack", "max_tokens": 4, "stream": True, field: value}
            assert_openai_error(post(base, "completions", body, "bob"), 400, field)
    thread.join(60)
    assert result == {"text": expected, "errors": []}


def test_a_step_that_fails_for_one_request_fails_only_that_request(llm):
    prompts = ["one", "two", "three"]
    expected = [solo(llm, p, 16) for p in prompts]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    results = run_beside_a_failing_request(llm, prompts, params)
    assert [results[p].text for p in prompts] == expected
    assert isinstance(results["poison"], EngineError) and "injected fault" in str(results["poison"])


# ----- 2. a failing session store fails only its operation, and /health tells the truth ----------
def test_a_store_that_cannot_write_fails_only_its_operation_and_health_says_so(base, llm):
    sid = post(base, "sessions", {"system": "durable"}).json()["id"]
    post(base, f"sessions/{sid}/messages", {"role": "user", "content": "first"})
    store = llm.session_store
    store._db.execute("PRAGMA query_only = ON")  # the fault: every write now fails inside SQLite
    try:
        turn = post(base, f"sessions/{sid}/completions", {"max_tokens": 8, **GREEDY})
        # Its reply cannot be stored, so it is not acknowledged (R8): an error, and the history as before.
        assert assert_openai_error(turn, 503)["code"] == "session_store_error"
        health = httpx.get(f"{base}/health")
        assert health.status_code == 503 and "session store" in health.json()["detail"]
        # The engine keeps serving stateless requests; new sessions fail clearly, not with a 500.
        ok = post(base, "completions", {"model": MODEL, "prompt": "still here", "max_tokens": 4, **GREEDY})
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
        assert assert_openai_error(post(base, "sessions", {"system": "x"}), 503)["code"] == "session_store_error"
    finally:
        store._db.execute("PRAGMA query_only = OFF")
    assert httpx.get(f"{base}/health").status_code == 200  # the probe's write succeeds again
    # The failed turn changed nothing: the same turn is answered now, and every answer is stored.
    turn = post(base, f"sessions/{sid}/completions", {"max_tokens": 8, **GREEDY})
    reply = turn.json()["choices"][0]["message"]["content"]
    post(base, f"sessions/{sid}/messages", {"role": "user", "content": "second"})
    assert post(base, f"sessions/{sid}/completions", {"max_tokens": 8, **GREEDY}).status_code == 200
    _, _, stored = store.load(sid)
    assert [content for _, content, _ in stored[:4]] == ["durable", "first", reply, "second"] and len(stored) == 5
    assert httpx.delete(f"{base}/v1/sessions/{sid}", headers=auth("alice")).status_code == 200


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the death is the test
def test_when_the_engine_thread_dies_health_is_503_and_requests_fail_fast(tiny_model_dir):
    doomed = LLM(str(tiny_model_dir), dtype="float32", kv_cache_tokens=2048, session_db=False, progress=False)
    with doomed, running_server(ServerSettings(served_model_name=MODEL), doomed) as url:

        def engine_bug():
            raise RuntimeError("injected engine bug")

        doomed.engine.scheduler.schedule = engine_bug  # the next step kills the engine thread
        body = {"model": MODEL, "prompt": "x", "max_tokens": 4}
        assert_openai_error(httpx.post(f"{url}/v1/completions", json=body, timeout=30), 500)
        doomed.engine.thread.join(30)
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and "engine thread died" in health.json()["detail"]
        after = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert assert_openai_error(after, 503)["code"] == "engine_unavailable"


# ----- 3. a request belongs to the key that sent it -------------------------------------------------
def test_another_key_cannot_cancel_a_request(base, llm):
    body = {"model": MODEL, "prompt": "mine", "max_tokens": 300, "stream": True, **GREEDY}
    with StepGate(llm) as gate:
        headers = {**auth("alice"), "X-Request-Id": "alice-req"}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, headers=headers, timeout=60) as s:
            assert gate.entered.wait(30)
            response_id = s.headers["x-request-id"]
            for rid in ("alice-req", response_id):
                r = httpx.delete(f"{base}/v1/requests/{rid}", headers=auth("bob"))
                assert_openai_error(r, 404, "request_id")
            assert httpx.delete(f"{base}/v1/requests/alice-req", headers=auth("alice")).status_code == 200
            gate.open()
            events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert events[-1]["choices"][0]["finish_reason"] == "abort"


# ----- 4. admission counts engine requests (prompts x n), not HTTP requests -----------------------
def test_admission_counts_prompts_times_n(base, llm):
    # max_num_seqs 4 + max_queue 8: at most 12 engine requests in flight. A body over that can never
    # be admitted: 400 (split it), not a 429 a client would retry forever (issue 33).
    for prompts, n in (([f"p{i}" for i in range(100)], 1), (["a", "b", "c"], 5)):
        r = post(base, "completions", {"model": MODEL, "prompt": prompts, "n": n, "max_tokens": 2})
        assert_openai_error(r, 400)
        assert "Retry-After" not in r.headers and "split" in r.json()["error"]["message"]
    with StepGate(llm) as gate:
        holder = threading.Thread(
            target=post, args=(base, "completions", {"model": MODEL, "prompt": ["h"] * 5, "n": 2, "max_tokens": 2})
        )
        holder.start()
        assert gate.entered.wait(30)  # 10 engine requests in flight
        r = post(base, "completions", {"model": MODEL, "prompt": ["x", "y", "z"], "max_tokens": 2})
        assert_openai_error(r, 429)
        assert r.headers["Retry-After"] == "1" and "capacity" in r.json()["error"]["message"]
        gate.open()
        holder.join(60)
    assert post(base, "completions", {"model": MODEL, "prompt": ["x", "y"], "n": 6, "max_tokens": 2}).status_code == 200


# ----- 5, 6. text that is not Unicode, JSON too deep, numbers too long: 400 with a JSON body --------
SURROGATE = '"a\\ud800b"'  # raw JSON text: the escape decodes to a lone surrogate


@pytest.mark.parametrize(
    ("route", "template", "param"),
    [
        ("completions", '{"model": "tiny", "prompt": %s}', "prompt"),
        ("completions", '{"model": "tiny", "prompt": [%s]}', "prompt[0]"),
        ("completions", '{"model": "tiny", "prompt": "x", "stop": [%s]}', "stop[0]"),
        ("chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": %s}]}', "messages[0].content"),
        ("sessions", '{"system": %s}', "system"),
    ],
)
def test_lone_surrogates_get_400_naming_the_field(base, route, template, param):
    assert_openai_error(post(base, route, template % SURROGATE), 400, param)


def test_lone_surrogates_never_reach_a_session(base):
    sid = post(base, "sessions", {"system": "s"}).json()["id"]
    for route, template in (("messages", '{"role": "user", "content": %s}'), ("append", '{"text": %s}')):
        assert_openai_error(post(base, f"sessions/{sid}/{route}", template % SURROGATE), 400)
    info = httpx.get(f"{base}/v1/sessions/{sid}", headers=auth("alice"))
    assert info.status_code == 200 and info.json()["messages"] == [{"role": "system", "content": "s"}]
    post(base, f"sessions/{sid}/messages", {"role": "user", "content": "fine"})
    assert post(base, f"sessions/{sid}/completions", {"max_tokens": 4, **GREEDY}).status_code == 200
    assert httpx.delete(f"{base}/v1/sessions/{sid}", headers=auth("alice")).status_code == 200


def test_deep_json_and_huge_integers_get_400_on_a_kept_alive_connection(base):
    with httpx.Client(headers={**auth("alice"), "content-type": "application/json"}, timeout=60) as http:
        for content in (
            "[" * 100_000 + "]" * 100_000,
            '{"model": "tiny", "prompt": "x", "max_tokens": ' + "9" * 5000 + "}",
            '{"model": "tiny", "prompt": [' + "1" * 5000 + "]}",
        ):
            assert_openai_error(http.post(f"{base}/v1/completions", content=content), 400)
        ok = http.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert ok.status_code == 200


def test_python_api_refuses_what_the_engine_cannot_hold(llm):
    for kwargs in ({"top_k": 2**63}, {"seed": 2**64}, {"max_tokens": 10**5000}, {"stop": ["a\ud800"]}):
        with pytest.raises(InvalidRequestError):
            SamplingParams(**kwargs)
    with pytest.raises(InvalidRequestError, match="surrogate"):
        llm.generate("bad \udc00 text")
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        llm.generate([1, 2**64])


# ----- 7. the store checks its schema at start-up ------------------------------------------------------
def test_a_foreign_sqlite_file_is_refused_at_start_up(tmp_path, tiny_model_dir):
    foreign = tmp_path / "other.db"
    with sqlite3.connect(foreign) as db:
        db.execute("CREATE TABLE sessions (name TEXT, value INTEGER)")
    with pytest.raises(SessionStoreError, match="not a kvserve session store"):
        SessionStore(foreign)
    serve = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "serve", "--model", str(tiny_model_dir), "--session-db", str(foreign)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert serve.returncode == 2 and "not a kvserve session store" in serve.stderr


def test_a_store_of_a_newer_kvserve_is_called_newer_whatever_its_tables(tmp_path):
    """A later schema may add columns and tables: it was called "not a kvserve session store"."""
    path = tmp_path / "newer.db"
    SessionStore(path).close()
    with sqlite3.connect(path) as db:
        db.executescript(
            "ALTER TABLE sessions ADD COLUMN title TEXT; CREATE TABLE attachments (id TEXT);"
            "UPDATE kvserve_schema SET version = 6;"
        )
    with pytest.raises(SessionStoreError, match="written by a newer kvserve \\(schema 6, this one reads up to 5\\)"):
        SessionStore(path)


def test_a_version_1_store_is_migrated_and_its_owners_hashed(tmp_path):
    path = tmp_path / "v1.db"
    with sqlite3.connect(path) as db:  # the layout before the schema version existed
        db.executescript(
            "CREATE TABLE sessions (id TEXT PRIMARY KEY, owner TEXT, created REAL NOT NULL, ttl REAL);"
            "CREATE TABLE messages (session_id TEXT NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,"
            " seq INTEGER NOT NULL, role TEXT NOT NULL, content TEXT NOT NULL, PRIMARY KEY (session_id, seq));"
            "INSERT INTO sessions VALUES ('s1', 'alice', 0, NULL);"
            "INSERT INTO messages VALUES ('s1', 0, 'user', 'hello');"
        )
    store = SessionStore(path)
    owner = key_owner("alice", store.owner_secret)
    assert store.load("s1") == (owner, None, [("user", "hello", False)])
    store.close()
    assert SessionStore(path).load("s1")[0] == owner  # migrated once, then read as is


def _version_4_store(path, owner: str | None) -> None:
    with sqlite3.connect(path) as db:
        db.executescript(
            "CREATE TABLE sessions (id TEXT PRIMARY KEY, owner TEXT, created REAL NOT NULL, ttl REAL);"
            "CREATE TABLE messages (session_id TEXT NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,"
            " seq INTEGER NOT NULL, role TEXT NOT NULL, content TEXT NOT NULL, is_open INTEGER NOT NULL DEFAULT 0,"
            " PRIMARY KEY (session_id, seq));"
            "CREATE TABLE kvserve_schema (version INTEGER NOT NULL); INSERT INTO kvserve_schema VALUES (4);"
            "INSERT INTO messages VALUES ('s1', 0, 'user', 'hello', 0);"
        )
        db.execute("INSERT INTO sessions VALUES ('s1', ?, 0, 60)", (owner,))


def test_a_version_4_store_gains_each_sessions_last_write(tmp_path):
    """Version 5 keeps when a session was last written (its TTL holds across restarts); a version 4
    store's sessions count from the migration, so none expires at once."""
    path = tmp_path / "v4.db"
    _version_4_store(path, None)
    store = SessionStore(path)
    assert store.load("s1") == (None, 60, [("user", "hello", False)])
    assert store.expired(time.time()) == [] and store.expired(time.time() + 61) == ["s1"]
    store.close()
    # A version 4 store whose keys' sessions lost their owner secret is refused, migration or not.
    keyed = tmp_path / "v4-keyed.db"
    _version_4_store(keyed, "hmac-sha256:abc")
    with pytest.raises(SessionStoreError, match="owner secret"):
        SessionStore(keyed)


# ----- 8. keys: hashed owners, sessions per key bounded ---------------------------------------------
def test_sessions_store_a_key_hash_and_are_bounded_per_key(base, llm):
    ids = [post(base, "sessions", {"system": f"s{i}"}).json()["id"] for i in range(2)]
    third = post(base, "sessions", {"system": "one too many"})
    assert assert_openai_error(third, 429)["code"] == "too_many_sessions"
    bobs = post(base, "sessions", {"system": "bob's"}, key="bob")  # another key is not crowded out
    assert bobs.status_code == 200
    owners = {row[0] for row in sqlite3.connect(llm.session_store.path).execute("SELECT owner FROM sessions")}
    assert "alice" not in owners and "bob" not in owners
    assert key_owner("alice", llm.session_store.owner_secret) in owners
    for sid, key in [*((i, "alice") for i in ids), (bobs.json()["id"], "bob")]:
        assert httpx.delete(f"{base}/v1/sessions/{sid}", headers=auth(key)).status_code == 200
