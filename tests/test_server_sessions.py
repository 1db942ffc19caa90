"""Session routes over real HTTP: turns equal stateless chat, ownership by API key, and a server
killed with SIGKILL mid-turn continues its sessions after a restart."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from kvserve import LLM, SamplingParams
from kvserve.server.app import ServerSettings, create_app
from tests.conftest import StepGate, wait_idle_and_check
from tests.server_harness import descendants, free_port, running_server, serving

MODEL = "tiny"
GREEDY = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir, tmp_path_factory):
    db = tmp_path_factory.mktemp("sessions") / "s.db"
    with LLM(str(tiny_model_dir), dtype="float32", kv_cache_tokens=8192, session_db=db, progress=False) as llm:
        yield llm


@pytest.fixture(scope="module", params=["engine-thread", "engine-process"])
def served(request, llm, tiny_model_dir, tmp_path_factory):
    """(base URL, engine): the server with the engine in a thread of its process (`llm` itself), or
    in a process of its own (as `kvserve serve` runs it; the engine is then the front end's handle)."""
    settings = ServerSettings(served_model_name=MODEL, api_keys=("alice", "bob"))
    if request.param == "engine-thread":
        with running_server(settings, llm) as base:
            yield base, llm
        return
    db = tmp_path_factory.mktemp("sessions") / "process.db"
    app = create_app(
        dataclasses.replace(
            settings, model=str(tiny_model_dir), dtype="float32", kv_cache_tokens=8192, session_db=str(db)
        )
    )
    with serving(app) as base:
        yield base, app.state.kvserve.llm


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_session_turns_over_http_equal_stateless_chat(served, llm):
    base, engine = served
    h = auth("alice")
    created = httpx.post(f"{base}/v1/sessions", json={"system": "be brief"}, headers=h).json()
    sid = created["id"]
    assert created["object"] == "session" and created["messages"] == [{"role": "system", "content": "be brief"}]
    history = [{"role": "system", "content": "be brief"}]
    for i in range(2):
        httpx.post(f"{base}/v1/sessions/{sid}/messages", json={"role": "user", "content": f"q{i}"}, headers=h)
        history.append({"role": "user", "content": f"q{i}"})
        r = httpx.post(f"{base}/v1/sessions/{sid}/completions", json=GREEDY, headers=h).json()
        text = r["choices"][0]["message"]["content"]
        assert r["object"] == "chat.completion" and text == llm.chat(history, PARAMS).text
        history.append({"role": "assistant", "content": text})
        if i == 1:
            assert r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    httpx.post(f"{base}/v1/sessions/{sid}/append", json={"text": "streamed "}, headers=h)
    httpx.post(f"{base}/v1/sessions/{sid}/append", json={"text": "input"}, headers=h)
    with httpx.stream("POST", f"{base}/v1/sessions/{sid}/completions", json={**GREEDY, "stream": True}, headers=h) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    history.append({"role": "user", "content": "streamed input"})
    assert text == llm.chat(history, PARAMS).text
    info = httpx.get(f"{base}/v1/sessions/{sid}", headers=h).json()
    assert info["messages"][-1] == {"role": "assistant", "content": text} and info["kv_blocks"] > 0
    metrics = httpx.get(f"{base}/metrics").text
    assert "kvserve_sessions_active" in metrics and "kvserve_session_kv_blocks" in metrics
    # A fork takes no settings: a field it would ignore is refused by name (a ttl there silently did nothing).
    refused = httpx.post(f"{base}/v1/sessions/{sid}/fork", json={"ttl": 5}, headers=h)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "ttl"
    fork = httpx.post(f"{base}/v1/sessions/{sid}/fork", headers=h).json()
    assert fork["id"] != sid and fork["messages"] == info["messages"]
    for session_id in (sid, fork["id"]):
        assert httpx.delete(f"{base}/v1/sessions/{session_id}", headers=h).json()["deleted"] is True
    assert httpx.get(f"{base}/v1/sessions/{sid}", headers=h).status_code == 404
    wait_idle_and_check(engine)


def test_another_key_cannot_see_append_or_delete(served):
    base, engine = served
    sid = httpx.post(f"{base}/v1/sessions", json={}, headers=auth("alice")).json()["id"]
    bob = auth("bob")
    for method, path, body in (
        ("GET", "", None),
        ("POST", "/append", {"text": "x"}),
        ("POST", "/messages", {"role": "user", "content": "x"}),
        ("POST", "/completions", GREEDY),
        ("POST", "/fork", None),
        ("DELETE", "", None),
    ):
        r = httpx.request(method, f"{base}/v1/sessions/{sid}{path}", json=body, headers=bob)
        assert r.status_code == 404, (method, path, r.text)
        assert r.json()["error"]["code"] == "session_not_found"
    assert httpx.get(f"{base}/v1/sessions/{sid}", headers=auth("alice")).status_code == 200
    assert httpx.get(f"{base}/v1/sessions/{sid}").status_code == 401
    httpx.delete(f"{base}/v1/sessions/{sid}", headers=auth("alice"))
    wait_idle_and_check(engine)


def test_a_streamed_turn_the_session_cannot_take_gets_the_unstreamed_status(served):
    """Nothing new to answer, or a reply that cannot fit the context: streamed or not, the same 4xx
    status and body before the first byte, never 200 and an error event (issue 33)."""
    base, engine = served
    h = auth("alice")
    sid = httpx.post(f"{base}/v1/sessions", json={"system": "s"}, headers=h).json()["id"]
    url = f"{base}/v1/sessions/{sid}/completions"
    for body, param in (({**GREEDY}, "messages"), ({**GREEDY, "max_tokens": 1024}, "max_tokens")):
        answers = [httpx.post(url, json={**body, "stream": stream}, headers=h) for stream in (False, True)]
        for r in answers:
            assert r.status_code == 400 and r.headers["content-type"].startswith("application/json"), r.text[:300]
            assert r.json()["error"]["param"] == param
        assert answers[0].json() == answers[1].json()
        httpx.post(f"{base}/v1/sessions/{sid}/messages", json={"role": "user", "content": "hi"}, headers=h)
    streamed = httpx.post(url, json={**GREEDY, "stream": True}, headers=h)  # and a good turn still streams
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
    assert httpx.delete(f"{base}/v1/sessions/{sid}", headers=h).status_code == 200
    wait_idle_and_check(engine)


def _start(tiny_model_dir, home, port) -> subprocess.Popen:
    env = {**os.environ, "KVSERVE_HOME": str(home), "KVSERVE_DTYPE": "float32", "KVSERVE_SERVED_MODEL_NAME": MODEL}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvserve.cli",
            "serve",
            "--model",
            str(tiny_model_dir),
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("server did not start")


def test_sigkill_mid_turn_then_restart_continues_the_session(tiny_model_dir, tmp_path, llm):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = _start(tiny_model_dir, tmp_path, port)
    try:
        sid = httpx.post(f"{base}/v1/sessions", json={"system": "durable"}).json()["id"]
        httpx.post(f"{base}/v1/sessions/{sid}/messages", json={"role": "user", "content": "turn one"})
        one = httpx.post(f"{base}/v1/sessions/{sid}/completions", json=GREEDY).json()["choices"][0]["message"]
        httpx.post(f"{base}/v1/sessions/{sid}/messages", json={"role": "user", "content": "doomed turn"})
        started = threading.Event()

        def doomed() -> None:
            body = {**GREEDY, "max_tokens": 900, "stream": True}
            try:
                with httpx.stream("POST", f"{base}/v1/sessions/{sid}/completions", json=body, timeout=60) as s:
                    for _ in s.iter_lines():
                        started.set()
            except httpx.HTTPError:
                pass

        thread = threading.Thread(target=doomed)
        thread.start()
        assert started.wait(30)
        (engine,) = descendants(proc.pid, b"spawn_main")
        os.kill(engine, signal.SIGKILL)  # the engine, mid-turn; the front end then exits non-zero itself
        assert proc.wait(60) == 1
        thread.join(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    proc = _start(tiny_model_dir, tmp_path, port)
    try:
        info = httpx.get(f"{base}/v1/sessions/{sid}").json()
        completed = [
            {"role": "system", "content": "durable"},
            {"role": "user", "content": "turn one"},
            {"role": "assistant", "content": one["content"]},
        ]
        # The killed turn's reply is lost; the message it answered was acknowledged, so it is kept (R8).
        completed.append({"role": "user", "content": "doomed turn"})
        assert info["messages"] == completed
        two = httpx.post(f"{base}/v1/sessions/{sid}/completions", json=GREEDY).json()["choices"][0]["message"]
        assert two["content"] == llm.chat(completed, PARAMS).text
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def test_a_fork_during_a_turn_is_409_session_busy(llm):
    """Over HTTP too a fork needs the session idle: during a turn it is 409 `session_busy`, at once."""
    with running_server(ServerSettings(served_model_name=MODEL), llm) as base, StepGate(llm) as gate:
        sid = httpx.post(f"{base}/v1/sessions", json={"system": "sys"}).json()["id"]
        httpx.post(f"{base}/v1/sessions/{sid}/messages", json={"role": "user", "content": "hi"}).raise_for_status()
        body = {"max_tokens": 100, "ignore_eos": True, "temperature": 0}
        turn = threading.Thread(
            target=httpx.post, args=(f"{base}/v1/sessions/{sid}/completions",), kwargs={"json": body, "timeout": 120}
        )
        turn.start()
        assert gate.entered.wait(30)  # the turn's first step waits at the gate: it is running
        answers = []
        fork = threading.Thread(target=lambda: answers.append(httpx.post(f"{base}/v1/sessions/{sid}/fork", timeout=60)))
        fork.start()
        while fork.is_alive():  # the engine takes calls between steps: a step at a time until it has
            gate.allow(1)
            fork.join(0.05)
        steps_before_the_answer = gate.num_entered
        gate.open()
        turn.join(60)
        assert steps_before_the_answer < 100  # the turn still had tokens to go
        assert answers[0].status_code == 409 and answers[0].json()["error"]["code"] == "session_busy"
        child = httpx.post(f"{base}/v1/sessions/{sid}/fork")  # idle again
        assert child.status_code == 200
        for session_id in (sid, child.json()["id"]):
            httpx.delete(f"{base}/v1/sessions/{session_id}").raise_for_status()


def test_a_base_model_refuses_a_session_up_front(tiny_model_dir, tmp_path):
    """A model without a chat template cannot hold a conversation. Before, POST /v1/sessions answered
    200 with a session whose every turn then failed (and the page made one per try)."""
    import shutil

    base_model = tmp_path / "base-model"
    shutil.copytree(tiny_model_dir, base_model)
    config = json.loads((base_model / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (base_model / "tokenizer_config.json").write_text(json.dumps(config))
    settings = ServerSettings(
        model=str(base_model), engine_process=False, dtype="float32", session_db=str(tmp_path / "s.db")
    )
    with running_server(settings) as base:
        for body in ({}, {"system": "hi"}):  # the first, with nothing to render yet, was the 200
            refused = httpx.post(f"{base}/v1/sessions", json=body, timeout=60)
            assert refused.status_code == 400, refused.text
            assert "no chat template" in refused.json()["error"]["message"]
        assert httpx.get(f"{base}/v1/sessions", timeout=60).json()["data"] == []  # none was made
        plain = httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
        assert plain.status_code == 200, plain.text
