"""The engine in a process of its own (`kvserve serve`'s default), tested over real HTTP with the
official openai client: the same answers as the in-process engine, aborts on disconnect applied in
the engine process, typed errors from the front end, and a dead engine process answered by 503 at
once, never a hang."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from kvserve import LLM, SamplingParams
from kvserve.server.app import ServerSettings, create_app
from tests.conftest import wait_idle_and_check
from tests.server_harness import serving

MODEL = "tiny"
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = ["hello there", "The quick brown fox", "zz", "a longer prompt of several words, to prefill more"]


def settings(model, tmp_path, **overrides) -> ServerSettings:
    return ServerSettings(
        model=str(model),
        served_model_name=MODEL,
        dtype="float32",
        kv_cache_tokens=4096,
        max_num_seqs=16,
        session_db=str(tmp_path / "sessions.db"),
        **overrides,
    )


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    with LLM(str(tiny_model_dir), dtype="float32", kv_cache_tokens=4096, session_db=False, progress=False) as llm:
        yield llm


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    app = create_app(settings(tiny_model_dir, tmp_path_factory.mktemp("engine-process")))
    with serving(app) as base:
        engine = app.state.kvserve.llm
        assert engine.process.is_alive() and engine.process.pid != os.getpid()
        yield base, engine


def test_answers_equal_the_in_process_engine(served, llm):
    base, engine = served
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    greedy = dict(model=MODEL, temperature=0, max_tokens=12, extra_body={"ignore_eos": True})
    solo = [llm.generate(p, GREEDY).text for p in PROMPTS]
    batch = client.completions.create(prompt=PROMPTS, **greedy)
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == solo
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(messages=messages, **greedy)
    assert chat.choices[0].message.content == llm.chat(messages, GREEDY).text
    sampled = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.8, seed=7, ignore_eos=True)
    body = dict(model=MODEL, temperature=0.9, top_p=0.8, seed=7, max_tokens=12, extra_body={"ignore_eos": True})
    seeded = client.completions.create(prompt=PROMPTS[1], **body).choices[0].text
    assert seeded == llm.generate(PROMPTS[1], sampled).text

    async def streamed() -> list[str]:  # 16 streams at once, batched in the engine process
        aclient = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)

        async def one(prompt: str) -> str:
            stream = await aclient.completions.create(prompt=prompt, stream=True, **greedy)
            return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

        try:
            return await asyncio.gather(*(one(p) for p in PROMPTS * 4))
        finally:
            await aclient.close()

    assert asyncio.run(streamed()) == solo * 4
    wait_idle_and_check(engine)


def test_the_engine_process_leaves_its_start_up_heap_out_of_garbage_collection(served):
    _, engine = served
    assert engine.call("frozen_objects") > 10_000  # the imports, the model, the tokenizer


def test_a_frozen_heap_still_collects_the_garbage_made_after_it():
    """freeze_startup_heap in a fresh interpreter: what lived at the call is out of collections, and a
    reference cycle made later is still collected."""
    script = (
        "import gc, weakref\n"
        "from kvserve.processes import freeze_startup_heap\n"
        "frozen = freeze_startup_heap('test')\n"
        "class Node: pass\n"
        "a, b = Node(), Node()\n"
        "a.other, b.other = b, a\n"
        "gone = weakref.ref(a)\n"
        "del a, b\n"
        "gc.collect()\n"
        "print(frozen, gc.get_freeze_count(), gone() is None)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
    assert int(out[0]) == int(out[1]) > 1_000 and out[2] == "True", out


def test_bad_requests_are_refused_by_the_front_end(served):
    base, engine = served
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as bad_id:
        client.completions.create(model=MODEL, prompt=[5, 10**6], max_tokens=4)
    assert bad_id.value.body["param"] == "prompt" and "vocabulary" in bad_id.value.body["message"]
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model=MODEL, prompt="x", max_tokens=5000)
    assert too_long.value.body["param"] == "max_tokens"
    logprobs = client.completions.create(model=MODEL, prompt="hi", max_tokens=3, logprobs=2, temperature=0)
    assert len(logprobs.choices[0].logprobs.tokens) == 3
    assert all(len(top) == 2 for top in logprobs.choices[0].logprobs.top_logprobs)
    wait_idle_and_check(engine)


def _first_event_then_close(base: str) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                return  # leaving the block closes the connection with ~1000 tokens still to go


def test_a_client_that_disconnects_aborts_its_request_in_the_engine_process(served):
    base, engine = served
    before = engine.stats()
    _first_event_then_close(base)
    wait_idle_and_check(engine)
    deadline = time.monotonic() + 30  # the stats arrive with the engine's next message after the abort
    while engine.stats()["num_aborted_total"] == before["num_aborted_total"] and time.monotonic() < deadline:
        time.sleep(0.01)
    after = engine.stats()
    assert after["num_aborted_total"] == before["num_aborted_total"] + 1
    # Stopped long before its 1000 tokens (a step of this tiny model takes about a millisecond).
    assert after["generation_tokens_total"] - before["generation_tokens_total"] < 1000


def test_a_dead_engine_process_fails_requests_at_once_and_health_says_so(tiny_model_dir, tmp_path):
    app = create_app(settings(tiny_model_dir, tmp_path))
    with serving(app) as base:
        engine = app.state.kvserve.llm
        body = {"model": MODEL, "prompt": "x", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 1:
                        os.kill(engine.process.pid, signal.SIGKILL)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["type"] == "server_error" and "engine process died" in error["message"]
        health = httpx.get(f"{base}/health")
        assert health.status_code == 503 and "exited with code -9" in health.json()["detail"]
        later = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert later.status_code == 503 and later.json()["error"]["type"] == "service_unavailable", later.text
        assert later.json()["error"]["code"] == "engine_unavailable"
        chat = httpx.post(f"{base}/v1/sessions", json={})
        assert chat.status_code == 503
    assert engine.process.exitcode == -signal.SIGKILL


def test_a_model_that_fails_to_load_is_reported_and_the_engine_process_is_gone(tmp_path):
    before = set(multiprocessing.active_children())  # the module's server has its own
    app = create_app(settings(tmp_path / "missing.gguf", tmp_path))
    with serving(app, healthy=False) as base:
        deadline = time.monotonic() + 60
        health = httpx.get(f"{base}/health").json()
        while health["status"] == "loading" and time.monotonic() < deadline:
            time.sleep(0.05)
            health = httpx.get(f"{base}/health").json()
        assert health["status"] == "error" and "missing.gguf" in health["detail"]
        refused = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert refused.status_code == 503 and "missing.gguf" in refused.json()["error"]["message"]
    assert app.state.kvserve.llm is None
    assert not [p for p in set(multiprocessing.active_children()) - before if p.name == "kvserve-engine"]
