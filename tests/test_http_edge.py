"""The HTTP edge under a hostile but fair client (issue 33, items 9-16): what can be refused is
refused before the first byte, with the status the unstreamed request gets; a body that can never
be admitted is a 400, not a 429; the per-key session limit holds without keys; the OpenAI API's
types are strict; a request id names one live request; session TTLs are bounded; /metrics answers
from the start; and docs, logs, owners and odd HTTP give away nothing the key does not allow.

Each test reproduces its defect over real HTTP and holds the engine at a step gate wherever "still
running" or "still queued" must be a fact.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import socket
import sqlite3
import stat
import threading
import time
from urllib.parse import urlsplit

import httpx
import openai
import pytest

from kvserve import LLM
from kvserve.errors import InvalidRequestError
from kvserve.server.app import ServerSettings, create_app
from kvserve.server.routes import openai as openai_routes
from kvserve.sessions.limits import MAX_SESSION_TTL, MIN_SESSION_TTL
from kvserve.sessions.manager import Turn
from kvserve.sessions.store import SessionStore, SessionStoreError, key_owner
from tests.conftest import StepGate, wait_idle_and_check
from tests.server_harness import running_server, serving

MODEL = "tiny"
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def llm(tiny_model_dir, tmp_path_factory):
    db = tmp_path_factory.mktemp("edge") / "sessions.db"
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
def keyed(llm):
    settings = ServerSettings(served_model_name=MODEL, api_keys=("alice", "bob"), max_num_seqs=4, max_queue=8)
    with running_server(settings, llm) as base:
        yield base


@pytest.fixture(scope="module")
def keyless(llm):
    with running_server(ServerSettings(served_model_name=MODEL, max_num_seqs=4, max_queue=8), llm) as base:
        yield base


@pytest.fixture(autouse=True)
def no_leaks(llm):
    yield
    sessions = llm.engine.call(lambda: llm.sessions.num_pinned_blocks)
    wait_idle_and_check(llm, pinned=sessions)


def auth(key: str | None) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


def post(base: str, route: str, body, key: str | None = "alice", headers: dict | None = None) -> httpx.Response:
    content = body if isinstance(body, bytes | str) else json.dumps(body)
    all_headers = {**auth(key), "content-type": "application/json", **(headers or {})}
    return httpx.post(f"{base}/v1/{route}", content=content, headers=all_headers, timeout=60)


def delete(base: str, route: str, key: str | None = "alice") -> httpx.Response:
    return httpx.delete(f"{base}/v1/{route}", headers=auth(key), timeout=60)


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:300])
    assert r.headers["content-type"].startswith("application/json"), r.text[:300]
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["code"] is None or isinstance(error["code"], str), error  # OpenAI's codes: strings or null
    if param is not None:
        assert error["param"] == param, error
    return error


def wait_until(predicate, what: str, timeout: float = 30.0) -> None:
    """Poll a fact the test is about to rely on (never a guess about the machine's speed)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.01)


# ----- 9. what can be checked before the first byte is a status, not 200 + an error event ---------
def _queued_turns(llm, session_id: str) -> int:
    """Turns waiting behind the running one (read while the engine thread is parked at the gate)."""
    state = llm.sessions.sessions.get(session_id)
    return 0 if state is None else sum(isinstance(op, Turn) for op in state.pending)


@pytest.mark.parametrize("outcome", ["no new user message", "session deleted"])
def test_a_queued_streamed_turn_refused_when_it_starts_gets_the_unstreamed_status(keyed, llm, outcome):
    """A turn queued behind a running one is checked when it starts. Streamed, it must still get
    the status the unstreamed turn gets (400: nothing new to answer after the running turn; 404:
    the session was deleted while it waited), never 200 followed by an error event."""
    messages = [{"role": "user", "content": "hi"}]
    sid = post(keyed, "sessions", {"system": "s", "messages": messages}).json()["id"]
    url = f"{keyed}/v1/sessions/{sid}/completions"
    results: dict[str, tuple[int, str]] = {}

    def turn(name: str, max_tokens: int) -> None:
        body = {"max_tokens": max_tokens, "stream": True, **GREEDY}
        with httpx.stream("POST", url, json=body, headers=auth("alice"), timeout=60) as r:
            results[name] = (r.status_code, r.read().decode())

    with StepGate(llm) as gate:
        first = threading.Thread(target=turn, args=("first", 64))
        first.start()
        assert gate.entered.wait(30)  # the first turn is in its first step, held
        second = threading.Thread(target=turn, args=("second", 4))
        second.start()
        # Let steps through one at a time until the second turn waits in the session's queue.
        while _queued_turns(llm, sid) == 0:
            wait_until(lambda: llm.engine.inbox.qsize() > 0 or _queued_turns(llm, sid) > 0, "the second turn arrives")
            if _queued_turns(llm, sid) == 0:
                gate.step()
        assert "second" not in results  # queued: its answer cannot have started
        if outcome == "session deleted":
            deleting = threading.Thread(target=delete, args=(keyed, f"sessions/{sid}"))
            deleting.start()
            wait_until(lambda: llm.engine.inbox.qsize() > 0, "the DELETE reaches the engine")
            gate.open()
            deleting.join(60)
        else:
            gate.open()
        first.join(60)
        second.join(60)
    status, text = results["second"]
    assert status == (404 if outcome == "session deleted" else 400), text[:300]
    expected = post(keyed, f"sessions/{sid}/completions", {"max_tokens": 4, **GREEDY})  # the same, unstreamed
    assert_openai_error(expected, status)

    def shape(error: dict) -> dict:  # the message may name the moment ("was closed" / "no session")
        return {k: v for k, v in error.items() if k != "message"}

    assert shape(json.loads(text)["error"]) == shape(expected.json()["error"])
    if outcome != "session deleted":
        assert delete(keyed, f"sessions/{sid}").status_code == 200


# ----- 10. a body that can never be admitted is a 400 (split it), not a 429 -------------------------
def test_a_body_over_the_admission_limit_is_400_and_says_how_to_split(keyed):
    # max_num_seqs 4 + max_queue 8: at most 12 engine requests in flight, ever
    for prompts, n in (([f"p{i}" for i in range(13)], 1), (["a", "b", "c"], 5)):
        r = post(keyed, "completions", {"model": MODEL, "prompt": prompts, "n": n, "max_tokens": 2})
        error = assert_openai_error(r, 400)
        assert "Retry-After" not in r.headers and "split" in error["message"] and "12" in error["message"]
    r = post(keyed, "completions", {"model": MODEL, "prompt": ["a", "b", "c"], "n": 4, "max_tokens": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 12  # exactly the limit fits


# ----- 11. the per-key session limit holds without --api-key: every caller is one owner -------------
def test_the_session_limit_holds_without_keys(keyless):
    # The LLM holds at most 2 sessions per owner; without keys every caller is the same owner.
    ids = [post(keyless, "sessions", {"system": f"s{i}"}, key=None).json()["id"] for i in range(2)]
    error = assert_openai_error(post(keyless, "sessions", {"system": "one too many"}, key=None), 429)
    assert error["code"] == "too_many_sessions" and "--api-key" in error["message"]
    for sid in ids:
        assert delete(keyless, f"sessions/{sid}", key=None).status_code == 200
    again = post(keyless, "sessions", {}, key=None)  # room again
    assert again.status_code == 200 and delete(keyless, f"sessions/{again.json()['id']}", key=None).status_code == 200


# ----- 12. the OpenAI API is typed: a value of the wrong JSON type is a 400 naming the field ---------
@pytest.mark.parametrize(
    ("route", "field", "value"),
    [
        ("completions", "max_tokens", "3"),
        ("completions", "max_tokens", True),
        ("completions", "max_tokens", 3.0),
        ("completions", "stream", 0),
        ("completions", "ignore_eos", "false"),
        ("completions", "temperature", "0.5"),
        ("completions", "temperature", True),
        ("completions", "prompt", [True, False]),
        ("completions", "prompt", [1.0, 2.0]),
        ("completions", "prompt", [[1, True]]),
        ("completions", "n", "2"),
        ("completions", "seed", 7.0),
        ("completions", "echo", 1),
        ("completions", "logprobs", "2"),
        ("chat", "max_tokens", "3"),
        ("chat", "stream", "true"),
        ("chat", "logprobs", 1),
        ("chat", "top_p", "1"),
    ],
)
def test_a_value_of_the_wrong_type_is_400_naming_the_field(keyless, route, field, value):
    client = openai.OpenAI(base_url=f"{keyless}/v1", api_key="none", max_retries=0)
    kwargs = {"model": MODEL, "max_tokens": 2}
    standard = field != "ignore_eos"
    if standard:
        kwargs[field] = value
    else:
        kwargs["extra_body"] = {field: value}
    with pytest.raises(openai.BadRequestError) as refused:
        if route == "completions":
            client.completions.create(**{"prompt": "x", **kwargs})
        else:
            client.chat.completions.create(messages=[{"role": "user", "content": "x"}], **kwargs)
    assert refused.value.status_code == 400 and refused.value.param == field, refused.value.body
    assert field in refused.value.body["message"]


def test_an_integer_for_a_float_field_is_accepted_as_openai_does(keyless):
    client = openai.OpenAI(base_url=f"{keyless}/v1", api_key="none", max_retries=0)
    r = client.completions.create(
        model=MODEL, prompt="x", max_tokens=2, temperature=1, top_p=1, presence_penalty=0, frequency_penalty=0
    )
    assert r.choices[0].finish_reason in ("length", "stop")
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2, temperature=0
    )
    assert chat.choices[0].finish_reason in ("length", "stop")
    sid = post(keyless, "sessions", {"ttl": 60}, key=None).json()["id"]  # an integer TTL, too
    assert delete(keyless, f"sessions/{sid}", key=None).status_code == 200


# ----- 13. an X-Request-Id names one live request of its owner --------------------------------------
def test_a_live_request_id_is_refused_and_a_delete_aborts_once(keyed, llm):
    body = {"model": MODEL, "prompt": "dup", "max_tokens": 900, "stream": True, **GREEDY}
    headers = {**auth("alice"), "X-Request-Id": "dup"}
    with StepGate(llm) as gate, httpx.stream("POST", f"{keyed}/v1/completions", json=body, headers=headers) as older:
        assert older.status_code == 200
        assert gate.entered.wait(30)  # the older request is in the engine, held: it cannot have finished
        for stream in (False, True):
            again = post(keyed, "completions", {**body, "stream": stream}, headers={"X-Request-Id": "dup"})
            assert assert_openai_error(again, 409)["code"] == "request_id_in_use"
        # The id is per key: bob may use it beside alice's.
        with httpx.stream(
            "POST", f"{keyed}/v1/completions", json=body, headers={**auth("bob"), "X-Request-Id": "dup"}
        ) as bobs:
            assert bobs.status_code == 200  # leaving the block disconnects, which aborts it
        aborted = delete(keyed, "requests/dup")
        assert aborted.status_code == 200 and aborted.json()["aborted"] is True
        assert_openai_error(delete(keyed, "requests/dup"), 404, "request_id")  # never a second aborted: true
        gate.open()
        events = [json.loads(line[6:]) for line in older.iter_lines() if line.startswith("data: {")]
    assert events[-1]["choices"][0]["finish_reason"] == "abort"  # the older one was the one aborted
    assert_openai_error(delete(keyed, "requests/dup"), 404, "request_id")  # finished
    # an id with a '/' ran, and no /v1/requests/{id} path could name it to abort it
    slashed = post(keyed, "completions", {**body, "stream": False}, headers={"X-Request-Id": "team/42"})
    assert assert_openai_error(slashed, 400, "X-Request-Id")["message"].startswith("X-Request-Id 'team/42' has a '/'")
    reused = post(keyed, "completions", {**body, "stream": False, "max_tokens": 2}, headers={"X-Request-Id": "dup"})
    assert reused.status_code == 200  # over, so free again


# ----- 14. session TTLs have a minimum and a maximum ------------------------------------------------
@pytest.mark.parametrize("ttl", [0, -5, 5e-324, 1e-9, 0.5, MAX_SESSION_TTL * 2, 1e308])
def test_a_session_ttl_out_of_bounds_is_400_saying_the_bounds(keyed, ttl):
    error = assert_openai_error(post(keyed, "sessions", {"ttl": ttl}), 400, "ttl")
    assert "1 s" in error["message"] and "30 days" in error["message"]


def test_session_ttl_bounds_hold_for_python_callers_and_the_command_line(keyed, llm, capsys):
    assert MIN_SESSION_TTL == 1.0 and MAX_SESSION_TTL == 30 * 86400.0
    for ttl in (MIN_SESSION_TTL, MAX_SESSION_TTL):
        r = post(keyed, "sessions", {"ttl": ttl})
        assert r.status_code == 200 and r.json()["ttl"] == ttl
        assert delete(keyed, f"sessions/{r.json()['id']}").status_code == 200
    with pytest.raises(InvalidRequestError, match="30 days"):
        llm.session(ttl=1e-9)
    from kvserve.cli import build_parser

    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--session-ttl" in help_text and "1 s" in help_text and "30 days" in help_text
    for bad in ("1e-9", "5e-324", "1e12", "nan"):
        with pytest.raises(SystemExit) as exited:
            parser.parse_args(["serve", "--session-ttl", bad])
        assert exited.value.code == 2
    assert parser.parse_args(["serve", "--session-ttl", "60"]).session_ttl == 60.0


# ----- 15. /metrics answers from the start, before any request -------------------------------------
def _gauges(text: str) -> dict[str, float]:
    values = {}
    for line in text.splitlines():
        if line.startswith("kvserve_") and " " in line:
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


@pytest.mark.parametrize("engine_process", [True, False], ids=["engine-process", "engine-thread"])
def test_metrics_answer_before_the_first_request(tiny_model_dir, tmp_path, engine_process):
    settings = ServerSettings(
        model=str(tiny_model_dir),
        served_model_name=MODEL,
        dtype="float32",
        kv_cache_tokens=2048,
        session_db=str(tmp_path / "sessions.db"),
        engine_process=engine_process,
    )
    app = create_app(settings)
    with serving(app, healthy=False) as base:  # answering, perhaps still loading
        loading = httpx.get(f"{base}/metrics")
        assert loading.status_code == 200, loading.text[:300]
        wait_until(lambda: httpx.get(f"{base}/health").status_code == 200, "the model is loaded")
        ready = httpx.get(f"{base}/metrics")  # no request has run yet
        assert ready.status_code == 200, ready.text[:300]
        gauges = _gauges(ready.text)
        assert gauges["kvserve_kv_blocks_total"] == 2048 // 16
        for name in ("kvserve_requests_running", "kvserve_requests_waiting", "kvserve_kv_blocks_used"):
            assert gauges[name] == 0, name
        assert gauges["kvserve_sessions_active"] == 0


# ----- 16. docs, owners, logs and odd HTTP ----------------------------------------------------------
def test_docs_and_the_schema_need_the_key(keyed, keyless):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(f"{keyed}{path}").status_code in (401, 404), path
        assert httpx.get(f"{keyed}{path}", headers=auth("nope")).status_code in (401, 404), path
    schema = httpx.get(f"{keyed}/openapi.json", headers=auth("alice"))
    assert schema.status_code == 200 and "/v1/completions" in schema.json()["paths"]
    # One id an operation (GET and HEAD /health shared one, and FastAPI warned as it built the schema)
    ids = [operation["operationId"] for path in schema.json()["paths"].values() for operation in path.values()]
    assert len(ids) == len(set(ids)), sorted(ids)
    for path in ("/docs", "/openapi.json"):  # without keys nothing is protected, as before
        assert httpx.get(f"{keyless}{path}").status_code == 200


def test_owners_are_a_keyed_hash_under_a_secret_beside_the_store(tmp_path):
    path = tmp_path / "a" / "sessions.db"
    store = SessionStore(path)
    secret = store.owner_secret
    secret_file = store.secret_path
    assert secret_file.parent == path.parent and secret_file.read_bytes() == secret and len(secret) >= 32
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    store.close()
    assert SessionStore(path).owner_secret == secret  # created once
    digest = hashlib.sha256(b"alice").hexdigest()
    assert key_owner("alice", secret) == "hmac-sha256:" + hmac.new(secret, digest.encode(), "sha256").hexdigest()
    other = SessionStore(tmp_path / "b" / "sessions.db").owner_secret
    assert key_owner("alice", other) != key_owner("alice", secret)  # the same key, another install
    assert digest not in key_owner("alice", secret)


def test_a_store_whose_owner_secret_is_gone_is_refused(tmp_path):
    path = tmp_path / "sessions.db"
    store = SessionStore(path)
    store.create("s1", key_owner("alice", store.owner_secret), None, [{"role": "user", "content": "hi"}])
    store.close()
    store.secret_path.unlink()
    with pytest.raises(SessionStoreError, match="owner secret"):
        SessionStore(path)  # a new secret would leave alice's session unreachable for good
    assert not store.secret_path.exists()


def test_a_version_2_store_is_migrated_and_its_sessions_stay_reachable(tmp_path, tiny_model_dir):
    path = tmp_path / "v2.db"
    with sqlite3.connect(path) as db:  # owners as schema 2 wrote them: an unkeyed sha256 of the key
        db.executescript(
            "CREATE TABLE sessions (id TEXT PRIMARY KEY, owner TEXT, created REAL NOT NULL, ttl REAL);"
            "CREATE TABLE messages (session_id TEXT NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,"
            " seq INTEGER NOT NULL, role TEXT NOT NULL, content TEXT NOT NULL, PRIMARY KEY (session_id, seq));"
            "CREATE TABLE kvserve_schema (version INTEGER NOT NULL); INSERT INTO kvserve_schema VALUES (2);"
            f"INSERT INTO sessions VALUES ('s1', 'sha256:{hashlib.sha256(b'alice').hexdigest()}', 0, NULL);"
            "INSERT INTO messages VALUES ('s1', 0, 'user', 'hello');"
        )
    with LLM(str(tiny_model_dir), dtype="float32", kv_cache_tokens=1024, session_db=path, progress=False) as llm:
        stored = {row[0] for row in sqlite3.connect(path).execute("SELECT owner FROM sessions")}
        assert stored == {key_owner("alice", llm.session_store.owner_secret)}
        with running_server(ServerSettings(served_model_name=MODEL, api_keys=("alice", "bob")), llm) as base:
            assert_openai_error(httpx.get(f"{base}/v1/sessions/s1", headers=auth("bob")), 404)
            mine = httpx.get(f"{base}/v1/sessions/s1", headers=auth("alice"))
            assert mine.status_code == 200 and mine.json()["messages"] == [{"role": "user", "content": "hello"}]
            assert delete(base, "sessions/s1").status_code == 200


def test_owners_survive_a_restart_with_the_engine_in_its_own_process(tiny_model_dir, tmp_path):
    settings = ServerSettings(
        model=str(tiny_model_dir),
        served_model_name=MODEL,
        api_keys=("alice",),
        dtype="float32",
        kv_cache_tokens=1024,
        session_db=str(tmp_path / "sessions.db"),
    )
    with serving(create_app(settings)) as base:
        sid = post(base, "sessions", {"system": "kept"}).json()["id"]
    with serving(create_app(settings)) as base:  # a new front end and engine process, the same store
        again = httpx.get(f"{base}/v1/sessions/{sid}", headers=auth("alice"))
        assert again.status_code == 200 and again.json()["messages"] == [{"role": "system", "content": "kept"}]
        assert delete(base, f"sessions/{sid}").status_code == 200


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_a_key_in_the_query_string_never_reaches_the_access_log(llm):
    settings = ServerSettings(served_model_name=MODEL, api_keys=("alice-secret",))
    records = _Records()
    access = logging.getLogger("uvicorn.access")
    with serving(create_app(settings, llm), log_level="info") as base:
        access.addHandler(records)
        try:
            refused = httpx.get(f"{base}/v1/models?api_key=alice-secret")
            assert assert_openai_error(refused, 401)["code"] == "invalid_api_key"
            assert "Authorization" in refused.json()["error"]["message"]
            httpx.get(f"{base}/v1/models?x=1&API_KEY=alice-secret&y=2", headers=auth("alice-secret"))
            httpx.get(f"{base}/health?api-key=alice-secret")
        finally:
            access.removeHandler(records)
    assert len(records.lines) == 3, records.lines
    assert not [line for line in records.lines if "alice-secret" in line], records.lines
    assert "x=1" in records.lines[1] and "y=2" in records.lines[1]  # the rest of the query is kept


def _raw(base: str, request: bytes) -> bytes:
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
    return data


@pytest.mark.parametrize("version", ["HTTP/0.9", "HTTP/2.0", "HTTP/3.0"])
def test_request_lines_of_other_http_versions_are_refused(keyless, version):
    answer = _raw(keyless, f"GET /health {version}\r\nHost: x\r\n\r\n".encode())
    status = int(answer.split(b" ", 2)[1])
    assert status in (400, 505), answer[:200]
    ok = _raw(keyless, b"GET /health HTTP/1.0\r\nHost: x\r\n\r\n")
    assert ok.split(b" ", 2)[1] == b"200", ok[:200]


def test_a_body_with_a_content_encoding_is_refused_with_415(keyless):
    import gzip

    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 2}).encode()
    for content, encoding in ((body, "gzip"), (gzip.compress(body), "gzip"), (body, "br")):
        r = post(keyless, "completions", content, key=None, headers={"Content-Encoding": encoding})
        assert "uncompressed" in assert_openai_error(r, 415)["message"]
    identity = post(keyless, "completions", body, key=None, headers={"Content-Encoding": "identity"})
    assert identity.status_code == 200


def test_no_key_never_matches_even_an_empty_key(llm):
    """`kvserve serve` refuses an empty --api-key; a server made with one in code still answers a
    request without a key 401, and the real key 200."""
    settings = ServerSettings(served_model_name=MODEL, api_keys=("alice", ""), max_num_seqs=4, max_queue=8)
    with running_server(settings, llm) as base:
        assert httpx.get(f"{base}/v1/models").status_code == 401
        assert httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer alice"}).status_code == 200


def test_errors_outside_the_fields_say_what_to_do(keyless):
    """The router's own 404 and 405, a body over the size limit, and a body that is not a JSON object
    say what to send instead (before: "Not Found", "Method Not Allowed", the bare limit, and pydantic's
    name for the request class)."""
    missing = assert_openai_error(httpx.post(f"{keyless}/v1/embeddings", json={}), 404)
    assert "POST /v1/embeddings" in missing["message"] and "/v1/models" in missing["message"]
    wrong = httpx.get(f"{keyless}/v1/chat/completions")
    assert "takes POST" in assert_openai_error(wrong, 405)["message"] and wrong.headers["allow"] == "POST"
    wrong = httpx.put(f"{keyless}/v1/sessions/sess-x")  # two routes of this path: both named
    assert "takes DELETE, GET" in assert_openai_error(wrong, 405)["message"] and wrong.headers["allow"] == "DELETE, GET"
    too_big = post(keyless, "completions", {"model": MODEL, "prompt": "x" * (5 << 20)}, key=None)
    assert "--max-body-bytes" in assert_openai_error(too_big, 413)["message"]
    for body in ([{"model": MODEL, "prompt": "x"}], '"just text"', "5"):
        error = assert_openai_error(post(keyless, "completions", body, key=None), 400)
        assert error["message"] == "The request body must be a JSON object of the request's fields.", error
    # a nested unknown or missing field: pydantic's "Extra inputs are not permitted", "Field required"
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x", "foo": 1}], "max_tokens": 1}
    error = assert_openai_error(post(keyless, "chat/completions", chat, key=None), 400, "messages[0].foo")
    assert (
        error["message"]
        == "messages[0].foo: kvserve does not know this field; remove it from the request (or check its spelling)."
    )
    error = assert_openai_error(post(keyless, "chat/completions", {"model": MODEL}, key=None), 400, "messages")
    assert error["message"] == "messages: this field is required; send it."
    current = {**chat, "messages": [{"role": "user", "content": "x"}], "stream": True}
    current["stream_options"] = {"include_usage": True, "include_obfuscation": False}  # OpenAI's, since 2025
    assert post(keyless, "chat/completions", current, key=None).status_code == 200


def test_a_request_from_another_sites_page_is_refused_even_a_simple_one(keyless):
    """A browser sends a POST with a text/plain body from any page without a preflight, and the server
    read the body as JSON: any site the user opened could use a server without --api-key, and fill its
    sessions. A foreign Origin is a 403, as is (on a loopback address) a Host that does not name this
    machine: a page whose name was rebound to 127.0.0.1 sends its own, and could read the answers."""
    body = json.dumps({"system": "planted"})
    sessions = lambda: {s["id"] for s in httpx.get(f"{keyless}/v1/sessions").json()["data"]}  # noqa: E731
    before = sessions()
    for headers in (
        {"Origin": "https://evil.example", "content-type": "text/plain"},
        {"Origin": "null"},  # a sandboxed frame, a file opened in the browser
        {"Host": "evil.example", "Sec-Fetch-Site": "same-origin"},  # the rebound page's own GET-like request
        {"Host": "evil.example", "Origin": "http://evil.example"},  # the rebound page, "same-origin"
    ):
        r = httpx.post(f"{keyless}/v1/sessions", content=body, headers=headers)
        error = assert_openai_error(r, 403)
        assert error["code"] == "cross_site_request" and (
            "allowed-origins" in error["message"] or "localhost" in error["message"]
        )
    assert sessions() == before
    port = urlsplit(keyless).port
    for headers in (
        {"Origin": keyless},  # the server's own page
        {"Host": f"localhost:{port}", "Origin": f"http://localhost:{port}"},
        {"Host": "localhost", "X-Forwarded-Host": "chat.example.com", "Origin": "https://chat.example.com"},  # proxied
        {"Host": "gateway.internal"},  # not a browser (an SDK, a proxy's own call): any Host
    ):
        r = httpx.post(f"{keyless}/v1/sessions", content=body, headers={"content-type": "application/json", **headers})
        assert r.status_code == 200, (headers, r.text)
        assert delete(keyless, f"sessions/{r.json()['id']}", key=None).status_code == 200


def test_other_sites_pages_may_call_the_api_only_when_allowed(llm, keyless, monkeypatch):
    """A browser lets another site's page read an answer only when the server says that site may
    (CORS). By default none may, so a page of any site the user opens cannot use the model or its
    sessions; `--allowed-origins` names those that may, `*` any."""
    site, other = "https://chat.example.com", "https://evil.example.net"
    preflight = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    assert httpx.options(f"{keyless}/v1/completions", headers={"Origin": site, **preflight}).status_code == 405
    assert "access-control-allow-origin" not in httpx.post(f"{keyless}/v1/completions", json=body).headers
    settings = ServerSettings(served_model_name=MODEL, api_keys=("alice",), allowed_origins=(site,))
    with running_server(settings, llm) as base:
        answer = httpx.options(f"{base}/v1/completions", headers={"Origin": site, **preflight})
        assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == site
        assert "authorization" in answer.headers["access-control-allow-headers"].lower()
        refused = httpx.options(f"{base}/v1/completions", headers={"Origin": other, **preflight})
        assert "access-control-allow-origin" not in refused.headers
        r = post(base, "completions", body, headers={"Origin": site})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == site
        assert "x-request-id" in r.headers["access-control-expose-headers"].lower()
        unauthorized = post(base, "completions", body, key=None, headers={"Origin": site})  # errors are readable too
        assert unauthorized.status_code == 401 and unauthorized.headers["access-control-allow-origin"] == site

        def bug(*args) -> dict:
            raise RuntimeError("injected bug")

        monkeypatch.setattr(openai_routes, "_model_object", bug)
        failed = httpx.get(f"{base}/v1/models", headers={**auth("alice"), "Origin": site})  # a bug's 500 too
        assert assert_openai_error(failed, 500)["type"] == "server_error" and "RuntimeError" in failed.text
        assert failed.headers["access-control-allow-origin"] == site
        monkeypatch.undo()
        assert httpx.get(f"{base}/v1/models", headers=auth("alice")).status_code == 200
    with running_server(ServerSettings(served_model_name=MODEL, allowed_origins=("*",)), llm) as base:
        r = post(base, "completions", body, key=None, headers={"Origin": other})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"


@pytest.mark.parametrize("route, prepare", [("chat/completions", "_chat_jobs"), ("completions", "_completion_jobs")])
def test_a_bodys_schemas_and_tokens_are_worked_out_off_the_event_loop(llm, keyless, monkeypatch, route, prepare):
    """A 4 MiB body's prompt takes seconds to tokenize, its tools' schemas to check; done on the event
    loop, every other client's stream stood still meanwhile. Here a body's preparation is held: the
    server still answers others, then the held request completes."""
    entered, release = threading.Event(), threading.Event()
    original = getattr(openai_routes, prepare)

    def held(*args):
        entered.set()
        assert release.wait(60)
        return original(*args)

    monkeypatch.setattr(openai_routes, prepare, held)
    body = {
        "model": MODEL,
        "max_tokens": 2,
        **({"messages": [{"role": "user", "content": "hi"}]} if "chat" in route else {"prompt": "hi"}),
    }
    answers = []
    worker = threading.Thread(target=lambda: answers.append(post(keyless, route, body, key=None)))
    worker.start()
    try:
        assert entered.wait(60)
        assert httpx.get(f"{keyless}/health", timeout=30).status_code == 200  # the loop is free
    finally:
        release.set()
        worker.join(60)
    assert answers and answers[0].status_code == 200, answers


def test_sessions_off_is_a_403_that_says_so(tiny_model_dir):
    """--max-sessions 0 keeps no sessions: opening one is refused for good (403, no Retry-After), in a
    sentence that names the flag, not "there are already 0 sessions" with a 429 to retry forever."""
    with LLM(str(tiny_model_dir), dtype="float32", session_db=False, max_sessions=0, progress=False) as off:
        with running_server(ServerSettings(served_model_name=MODEL), off) as base:
            r = post(base, "sessions", {"system": "hi"}, key=None)
            error = assert_openai_error(r, 403)
            assert error["code"] == "sessions_off" and "--max-sessions 0" in error["message"]
            assert "Retry-After" not in r.headers
        wait_idle_and_check(off)
