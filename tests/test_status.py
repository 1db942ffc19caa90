"""Status through the API (server/routes/status.py) on a tiny random Llama: a request's status and
its lifecycle as server-sent events, the engine view a key sees (its own in detail, the rest as
anonymous occupancy), one engine read shared by every listener, the key's sessions listed after a
restart, and the page's files. Engines are held at known points by a StepGate; every test ends with
the pool checked."""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Iterator

import httpx
import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.monitor import HOLDER_BASE, IN_USE
from kvserve.server.app import ServerSettings, create_app
from kvserve.server.status_ops import sessions_list
from tests.conftest import StepGate, wait_idle_and_check
from tests.server_harness import running_server, serving

pytest.importorskip("transformers")

GREEDY = {"temperature": 0, "ignore_eos": True}
SETTINGS = ServerSettings(served_model_name="tiny", api_keys=("alice", "bob"))


@pytest.fixture(scope="module")
def llm(tiny_model_dir, tmp_path_factory):
    db = tmp_path_factory.mktemp("status") / "sessions.db"
    with LLM(str(tiny_model_dir), dtype="float32", kv_cache_tokens=2048, session_db=db, progress=False) as llm:
        yield llm


@pytest.fixture(scope="module")
def base(llm):
    with running_server(SETTINGS, llm) as base:
        yield base


@pytest.fixture(autouse=True)
def pool_checked(llm):
    yield
    wait_idle_and_check(llm, pinned=sum(len(s.pinned_block_ids) for s in llm.sessions.sessions.values()))


def auth(key: str, **headers: str) -> dict:
    return {"Authorization": f"Bearer {key}", **headers}


def sse(response: httpx.Response) -> Iterator[tuple[str, dict]]:
    name = "message"
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            yield name, json.loads(line[6:])
            name = "message"


def in_thread(fn) -> threading.Thread:
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


def test_a_requests_status_shows_its_tokens_blocks_and_timings_to_its_key_only(base, llm):
    body = {"model": "tiny", "prompt": "hello world", "max_tokens": 20, **GREEDY}  # 11 prompt tokens
    with StepGate(llm) as gate:
        done = in_thread(
            lambda: httpx.post(f"{base}/v1/completions", json=body, headers=auth("alice", **{"X-Request-Id": "job-1"}))
        )
        assert gate.entered.wait(30)
        gate.step()  # the prompt's step ran; the engine waits before the second
        status = httpx.get(f"{base}/v1/requests/job-1", headers=auth("alice")).json()
        assert status["object"] == "request.status" and status["id"] == "job-1"
        assert (status["state"], status["num_prompt_tokens"], status["num_output_tokens"]) == ("decoding", 11, 1)
        assert status["kv_blocks"] == 1 and status["timings"]["ttft_s"] is not None
        hidden = httpx.get(f"{base}/v1/requests/job-1", headers=auth("bob"))
        assert hidden.status_code == 404 and hidden.json()["error"]["type"] == "not_found_error"
        gate.open()
        done.join(30)
    status = httpx.get(f"{base}/v1/requests/job-1", headers=auth("alice")).json()
    assert (status["state"], status["num_output_tokens"], status["kv_blocks"]) == ("finished", 20, 0)
    choice = status["choices"][0]
    assert choice["finish_reason"] == "length" and choice["num_blocks_freed"] == 2  # 30 tokens computed
    assert choice["timings"]["e2e_s"] >= choice["timings"]["ttft_s"] > 0
    assert httpx.get(f"{base}/v1/requests/{choice['id']}", headers=auth("alice")).json()["id"] == choice["id"]
    assert httpx.get(f"{base}/v1/requests/nope", headers=auth("alice")).status_code == 404


def test_delete_takes_one_choices_engine_id_while_it_runs(base, llm):
    """GET took an engine request's id (`<response id>-<choice>`), DELETE answered 404 for it: it looked
    among the ids clients named only. Now it aborts that choice, and only it, for its key only."""
    body = {"model": "tiny", "prompt": "two", "max_tokens": 12, "n": 2, **GREEDY}
    answers = []
    with StepGate(llm) as gate:
        headers = auth("alice", **{"X-Request-Id": "job-n"})
        done = in_thread(lambda: answers.append(httpx.post(f"{base}/v1/completions", json=body, headers=headers)))
        assert gate.entered.wait(30)
        gate.step()
        first = httpx.get(f"{base}/v1/requests/job-n", headers=auth("alice")).json()["choices"][0]["id"]
        assert httpx.delete(f"{base}/v1/requests/{first}", headers=auth("bob")).status_code == 404
        aborted = httpx.delete(f"{base}/v1/requests/{first}", headers=auth("alice"))
        assert aborted.status_code == 200 and aborted.json()["aborted"] is True
        gate.open()
        done.join(30)
    reasons = [c["finish_reason"] for c in sorted(answers[0].json()["choices"], key=lambda c: c["index"])]
    assert reasons == ["abort", "length"]
    assert httpx.delete(f"{base}/v1/requests/{first}", headers=auth("alice")).status_code == 404  # it has ended
    wait_idle_and_check(llm)


def test_a_requests_events_follow_its_lifecycle_to_the_freed_blocks(base, llm):
    body = {"model": "tiny", "prompt": "stream me", "max_tokens": 8, "stream": True, **GREEDY}
    names: list[str] = []
    with StepGate(llm) as gate:
        done = in_thread(
            lambda: httpx.post(f"{base}/v1/completions", json=body, headers=auth("alice", **{"X-Request-Id": "job-2"}))
        )
        assert gate.entered.wait(30)

        def follow() -> None:
            with httpx.stream("GET", f"{base}/v1/requests/job-2/events", headers=auth("alice"), timeout=60) as r:
                names.extend(name for name, _ in sse(r))

        follower = in_thread(follow)
        gate.open()
        done.join(30)
        follower.join(30)
    lifecycle = [n for n in names if n != "status"]
    assert names[0] == "status" and lifecycle == ["queued", "scheduled", "first_token", "finished", "freed", "end"]


def test_a_streamed_request_the_engine_has_not_taken_in_yet_is_queued_not_unknown(base, llm):
    """A streamed response's headers can reach the client before the engine thread takes its request
    in. Asked then, its status was a 404 saying it ended too long ago; it is queued, and its events
    follow it to the end."""
    body = {"model": "tiny", "prompt": "on its way", "max_tokens": 4, "stream": True, **GREEDY}
    entered, release = threading.Event(), threading.Event()
    holder = in_thread(lambda: llm.engine.call(lambda: (entered.set(), release.wait(30))))
    assert entered.wait(30)  # the engine thread waits in this call: nothing is taken in meanwhile
    names: list[str] = []
    try:
        with httpx.stream(
            "POST", f"{base}/v1/completions", json=body, headers=auth("alice", **{"X-Request-Id": "job-early"})
        ) as response:
            assert response.status_code == 200  # the headers came while the request waits in the inbox
            status = httpx.get(f"{base}/v1/requests/job-early", headers=auth("alice"), timeout=30)
            assert status.status_code == 200, status.text
            assert status.json()["state"] == "queued" and status.json()["num_output_tokens"] == 0

            def follow() -> None:
                with httpx.stream(
                    "GET", f"{base}/v1/requests/job-early/events", headers=auth("alice"), timeout=60
                ) as r:
                    names.extend(name for name, _ in sse(r))

            follower = in_thread(follow)
            release.set()
            response.read()
            follower.join(30)
    finally:
        release.set()
        holder.join(30)
    assert names[0] == "status" and names[-1] == "end" and "finished" in names
    final = httpx.get(f"{base}/v1/requests/job-early", headers=auth("alice"), timeout=30).json()
    assert final["state"] == "finished" and final["num_output_tokens"] == 4


def first_view(base: str, key: str) -> tuple[str, dict]:
    with httpx.stream("GET", f"{base}/v1/engine/events", headers=auth(key), timeout=60) as r:
        for name, view in sse(r):
            assert name == "engine"
            return json.dumps(view), view
    raise AssertionError("no engine view came")


def blocks_by_code(view: dict) -> dict[int, int]:
    counts: dict[int, int] = {}
    for code, count in view["map"]:
        counts[code] = counts.get(code, 0) + count
    return counts


@pytest.fixture(scope="module")
def process_base(tiny_model_dir, tmp_path_factory):
    """The server with its engine in a process of its own, as `kvserve serve` runs it."""
    db = tmp_path_factory.mktemp("status-process") / "sessions.db"
    settings = dataclasses.replace(
        SETTINGS, model=str(tiny_model_dir), dtype="float32", kv_cache_tokens=2048, session_db=str(db)
    )
    app = create_app(settings)
    with serving(app) as base:
        yield base, app.state.kvserve.llm


def test_another_keys_view_shows_occupancy_and_no_ids_or_text(process_base):
    base, engine = process_base
    secret = "the launch code is 0000"
    session = httpx.post(f"{base}/v1/sessions", json={"system": secret}, headers=auth("alice")).json()["id"]
    httpx.post(
        f"{base}/v1/sessions/{session}/messages", json={"role": "user", "content": secret}, headers=auth("alice")
    )
    turn = httpx.post(
        f"{base}/v1/sessions/{session}/completions", json={"max_tokens": 6, **GREEDY}, headers=auth("alice")
    )
    reply, request_id = turn.json()["choices"][0]["message"]["content"], turn.headers["x-request-id"]
    text, alice = first_view(base, "alice")
    assert session in text and request_id in text
    (pinned,) = [s["kv_blocks"] for s in alice["sessions"] if s["id"] == session]
    assert pinned >= 2 and alice["holders"] == [{"kind": "session", "id": session}]
    assert blocks_by_code(alice)[HOLDER_BASE] == pinned

    text, bob = first_view(base, "bob")
    for leak in (session, request_id, secret, reply):
        assert leak not in text
    assert bob["holders"] == [] and bob["sessions"] == []
    assert bob["other_sessions"] == {"count": 1, "kv_blocks": pinned}
    assert blocks_by_code(bob)[IN_USE] == pinned  # the same blocks, as anonymous occupancy
    assert {e["request_id"] for e in bob["events"]} == {None}
    assert all(r["id"] is None and set(r) == {"id", "state", "kv_blocks"} for r in bob["requests"])
    assert httpx.get(f"{base}/v1/requests/{request_id}", headers=auth("bob")).status_code == 404
    assert httpx.get(f"{base}/v1/sessions", headers=auth("bob")).json()["data"] == []
    listed = httpx.get(f"{base}/v1/sessions", headers=auth("alice")).json()["data"]
    assert [(s["id"], s["title"], s["is_live"]) for s in listed] == [(session, secret, True)]
    httpx.delete(f"{base}/v1/sessions/{session}", headers=auth("alice"))
    wait_idle_and_check(engine)


def test_one_engine_read_serves_every_listener(base, llm):
    reads = 0
    read = llm.monitor.read

    def counted(*args, **kwargs):
        nonlocal reads
        reads += 1
        return read(*args, **kwargs)

    llm.monitor.read = counted
    try:
        views: list[list[float]] = [[] for _ in range(5)]

        def listen(index: int) -> None:
            with httpx.stream("GET", f"{base}/v1/engine/events", headers=auth("alice"), timeout=60) as r:
                for _, view in sse(r):
                    views[index].append(view["time"])
                    if len(views[index]) == 4:
                        return

        listeners = [in_thread(lambda i=i: listen(i)) for i in range(5)]
        for listener in listeners:
            listener.join(60)
    finally:
        del llm.monitor.read
    received = [t for times in views for t in times]
    assert len(received) == 20
    assert len(set(received)) <= reads < len(received)  # each view is one read's, shared by the listeners


def test_the_keys_sessions_are_listed_after_a_restart(tiny_model_dir, tmp_path):
    db = tmp_path / "sessions.db"
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    with LLM(str(tiny_model_dir), dtype="float32", kv_cache_tokens=1024, session_db=db, progress=False) as first:
        session = first.session(system="be brief", owner="owner-1")
        session.add_message("user", "What is a KV cache?")
        list(session.stream(params))
        listed = sessions_list(first, "owner-1")
        assert [(s["id"], s["is_live"], s["num_messages"]) for s in listed] == [(session.id, True, 3)]
        session_id = session.id
    with LLM(str(tiny_model_dir), dtype="float32", kv_cache_tokens=1024, session_db=db, progress=False) as second:
        (stored,) = sessions_list(second, "owner-1")
        assert (stored["id"], stored["title"], stored["is_live"], stored["state"]) == (
            session_id,
            "What is a KV cache?",
            False,
            "stored",
        )
        assert sessions_list(second, "owner-2") == [] and sessions_list(second, None) == []
        second.session(id=session_id, owner="owner-1")  # reopened
        assert [s["is_live"] for s in sessions_list(second, "owner-1")] == [True]
        wait_idle_and_check(second)


def test_the_page_is_served_from_the_package_with_a_strict_policy(base):
    page = httpx.get(f"{base}/")  # no key needed: the page is code, its data comes with the key
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    for name in ("app.js", "style.css"):
        assert f"/static/{name}" in page.text
        assert httpx.get(f"{base}/static/{name}").status_code == 200
    assert "http" not in page.text.replace("http-equiv", "")  # nothing fetched from elsewhere
    assert httpx.get(f"{base}/static/..%2Fapp.py").status_code == 404
    assert httpx.get(f"{base}/v1/engine").status_code == 401
    info = httpx.get(f"{base}/v1/engine", headers=auth("bob")).json()
    assert (info["model"], info["block_size"], info["num_kv_blocks"]) == ("tiny", 16, 128)


def test_status_streams_end_when_the_server_stops(llm):
    """At SIGTERM `kvserve serve` closes the feed: an open page's streams end instead of holding the
    graceful shutdown open for --shutdown-timeout."""
    app = create_app(SETTINGS, llm)
    with serving(app) as base:
        names: list[str] = []
        got_first = threading.Event()

        def follow() -> None:
            with httpx.stream("GET", f"{base}/v1/engine/events", headers=auth("alice"), timeout=60) as r:
                for name, _ in sse(r):
                    names.append(name)
                    got_first.set()

        follower = in_thread(follow)
        assert got_first.wait(30)
        app.state.status_feed.close_soon()
        follower.join(30)
        assert not follower.is_alive() and names[0] == "engine"
        with httpx.stream("GET", f"{base}/v1/engine/events", headers=auth("alice"), timeout=60) as r:
            assert list(sse(r)) == []  # a stream opened afterwards ends at once
