"""The OpenAI-compatible server, tested over real HTTP with the official openai client."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time

import httpx
import openai
import pytest

from kvserve import LLM
from kvserve.server.app import ServerSettings, create_app
from tests.conftest import StepGate, wait_idle_and_check
from tests.server_harness import running_server, serving

MODEL = "tiny"


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    with LLM(str(tiny_model_dir), dtype="float32", kv_cache_tokens=8192, max_num_seqs=48, progress=False) as llm:
        yield llm


@pytest.fixture(scope="module")
def base_url(llm):
    settings = ServerSettings(served_model_name=MODEL, max_num_seqs=48, max_queue=64, max_body_bytes=200_000)
    with running_server(settings, llm) as base:
        yield base


@pytest.fixture(autouse=True)
def no_leaks(llm):
    yield
    wait_idle_and_check(llm)


@pytest.fixture
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def metric(base_url: str, name: str) -> float:
    for line in httpx.get(f"{base_url}/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


GREEDY = dict(temperature=0, max_tokens=12, extra_body={"ignore_eos": True})


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_a_model_is_retrieved_by_its_name(client):
    model = client.models.retrieve(MODEL)
    assert (model.id, model.object, model.owned_by) == (MODEL, "model", "kvserve")
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-4o")
    assert missing.value.body["code"] == "model_not_found" and missing.value.body["param"] == "model"


def test_a_field_left_out_samples_with_the_models_recommended_value(tiny_model_dir, tmp_path):
    """As vLLM takes a model's generation_config.json: a request without temperature, top_p, top_k or
    min_p samples with the model's recommended value (it sampled at OpenAI's temperature 1, which made a
    small model ramble to the end of its context); a value sent wins. /v1/models' `created` is the
    model file's time, and /health answers HEAD (load balancers probe with it)."""
    import shutil

    from kvserve import SamplingParams

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    recommended = {"do_sample": True, "temperature": 0.5, "top_k": 3, "min_p": 0.1}
    (folder / "generation_config.json").write_text(json.dumps(recommended))
    with LLM(str(folder), dtype="float32", kv_cache_tokens=1024, session_db=False, progress=False) as own:
        with running_server(ServerSettings(served_model_name=MODEL), own) as base:
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)

            def sent(extra: dict | None = None, **fields) -> str:
                body = {"ignore_eos": True, **(extra or {})}
                answer = client.completions.create(
                    model=MODEL, prompt="a b c", max_tokens=12, seed=7, extra_body=body, **fields
                )
                return answer.choices[0].text

            def alone(**fields) -> str:
                values = {"temperature": 0.5, "top_k": 3, "min_p": 0.1, "top_p": 1.0, **fields}
                return own.generate("a b c", SamplingParams(max_tokens=12, seed=7, ignore_eos=True, **values)).text

            assert sent() == alone()
            assert sent({"top_k": 0}, temperature=1.5) == alone(temperature=1.5, top_k=0)
            assert alone() != alone(temperature=1.5, top_k=0)  # the two differ: the test can tell them apart
            assert client.models.list().data[0].created == int(folder.stat().st_mtime)  # the path it was given
            assert httpx.head(f"{base}/health").status_code == 200
        wait_idle_and_check(own)


def test_recommended_values_no_request_could_send_are_left_out(tiny_model_dir, tmp_path, caplog):
    """A generation_config.json with a negative temperature, or not JSON, made every request that left
    the field out a 400 it could not fix, or stopped the server's start."""
    import shutil

    from kvserve.server.state import _model_sampling

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    config = folder / "generation_config.json"
    config.write_text(json.dumps({"temperature": -1, "top_p": 2, "top_k": 3, "min_p": 0.1}))
    with caplog.at_level("WARNING", logger="kvserve.server"):
        assert _model_sampling(folder) == {"top_k": 3, "min_p": 0.1}
        assert "recommended temperature is left out" in caplog.text and "recommended top_p" in caplog.text
        for damaged in ("{", "[1, 2]"):
            config.write_text(damaged)
            assert _model_sampling(folder) == {}
    assert caplog.text.count("recommended sampling is not read") == 2


def test_a_null_field_is_the_field_unset_as_openai_takes_it(client, base_url):
    """Clients that send every field send null for those they leave unset: each is its default (a
    null for a field kvserve lacks asks for nothing), where a value is still checked."""
    messages = [{"role": "user", "content": "hi"}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY).choices[0].message.content
    unset = ("n", "presence_penalty", "frequency_penalty", "logprobs", "top_logprobs", "stream", "stream_options")
    unset += ("stop", "seed", "user", "tools", "tool_choice", "parallel_tool_calls", "response_format", "logit_bias")
    body = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 12, "ignore_eos": True}
    r = httpx.post(f"{base_url}/v1/chat/completions", json={**body, **dict.fromkeys(unset)}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == plain
    prompt = {"model": MODEL, "prompt": "abc", "temperature": 0, "max_tokens": 12, "ignore_eos": True}
    text = client.completions.create(model=MODEL, prompt="abc", **GREEDY).choices[0].text
    nulls = dict.fromkeys(("suffix", "best_of", "echo", "logprobs", "n", "stream"))
    r = httpx.post(f"{base_url}/v1/completions", json={**prompt, **nulls}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == text
    for refused, param in (
        ({"suffix": "x"}, "suffix"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ):
        r = httpx.post(f"{base_url}/v1/completions", json={**prompt, **refused}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_an_openai_field_whose_value_asks_for_nothing_is_accepted(client, base_url):
    """`store: false`, `service_tier: "auto"`, `modalities: ["text"]` and `best_of: 1` ask for nothing
    kvserve lacks (before: 400 each); any other value of those fields is still refused by name."""
    messages = [{"role": "user", "content": "hi"}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY).choices[0].message.content
    answer = client.chat.completions.create(
        model=MODEL, messages=messages, store=False, service_tier="auto", modalities=["text"], **GREEDY
    )
    assert answer.choices[0].message.content == plain
    text = client.completions.create(model=MODEL, prompt="abc", **GREEDY).choices[0].text
    assert client.completions.create(model=MODEL, prompt="abc", best_of=1, **GREEDY).choices[0].text == text
    chat = {"model": MODEL, "messages": messages, "max_tokens": 2}
    for refused in ({"store": True}, {"service_tier": "flex"}, {"modalities": ["text", "audio"]}, {"best_of": 2}):
        r = httpx.post(f"{base_url}/v1/chat/completions", json={**chat, **refused}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(refused)), r.text


def test_completion_and_usage(client, llm):
    r = client.completions.create(model=MODEL, prompt="hello world", **GREEDY)
    expected = llm.generate("hello world", _params(12))
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == expected.text and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(expected.prompt_token_ids) and r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_completion_prompt_forms_and_echo(client):
    single = client.completions.create(model=MODEL, prompt="abc", **GREEDY).choices[0].text
    as_ids = client.completions.create(model=MODEL, prompt=[97, 98, 99], **GREEDY).choices[0].text
    many = client.completions.create(model=MODEL, prompt=["abc", "abc"], **GREEDY)
    many_ids = client.completions.create(model=MODEL, prompt=[[97, 98, 99], [97, 98, 99]], **GREEDY)
    assert single == as_ids == many.choices[0].text == many.choices[1].text == many_ids.choices[1].text
    echoed = client.completions.create(model=MODEL, prompt="abc", echo=True, **GREEDY).choices[0].text
    assert echoed == "abc" + single


def test_chat_streaming_matches_non_streaming(client):
    messages = [{"role": "system", "content": "terse"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    full = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, stream=True, stream_options={"include_usage": True}, **GREEDY
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_sse_ends_with_done(base_url):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)


def test_sse_events_stay_one_line_for_clients_that_split_on_unicode_line_breaks(base_url):
    """U+0085, U+2028 and U+2029 end a line for str.splitlines and httpx's iter_lines; inside an
    event's JSON they are escaped, so a token that decodes to one never splits its event in two."""
    prompt = "a\u2028b\x85c\u2029d"
    body = {"model": MODEL, "prompt": prompt, "echo": True, "max_tokens": 2, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body) as r:
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines), lines
    assert lines[-1] == "data: [DONE]"
    echoed = json.loads(lines[0].removeprefix("data: "))["choices"][0]["text"]
    assert echoed == prompt


def test_n_seed_and_stop(client):
    sampled = dict(temperature=1.0, max_tokens=16, seed=7, extra_body={"ignore_eos": True})
    a = client.completions.create(model=MODEL, prompt="seeded", n=2, **sampled)
    b = client.completions.create(model=MODEL, prompt="seeded", n=2, **sampled)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.choices[0].text != a.choices[1].text  # n choices are different samples
    assert a.usage.completion_tokens == 32
    free = client.completions.create(model=MODEL, prompt="stop here", **GREEDY).choices[0].text
    stop = free[3:5]
    stopped = client.completions.create(model=MODEL, prompt="stop here", stop=[stop], **GREEDY).choices[0]
    assert stopped.finish_reason == "stop" and stopped.text == free[: free.index(stop)]


def test_logprobs(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=3, **GREEDY
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 12 and all(len(c.top_logprobs) == 3 for c in content)
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)  # greedy = top-1
    c = client.completions.create(model=MODEL, prompt="x", logprobs=2, **GREEDY)
    assert len(c.choices[0].logprobs.token_logprobs) == 12 and len(c.choices[0].logprobs.top_logprobs[0]) <= 2


def test_completion_logprobs_always_hold_the_sampled_token(client):
    """As OpenAI's and vLLM's completions: each top_logprobs holds the top `logprobs` tokens and the
    sampled one, so up to logprobs + 1; logprobs=0 gives the sampled token alone. At temperature 2
    many sampled tokens are not the top one; before, they were missing from top_logprobs."""
    sampled = dict(temperature=2, seed=3, max_tokens=24, extra_body={"ignore_eos": True})
    lp = client.completions.create(model=MODEL, prompt="x", logprobs=1, **sampled).choices[0].logprobs
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[token] == logprob and 1 <= len(top) <= 2
    assert any(len(top) == 2 for top in lp.top_logprobs)
    zero = client.completions.create(model=MODEL, prompt="x", logprobs=0, **GREEDY).choices[0].logprobs
    assert zero.top_logprobs == [{t: v} for t, v in zip(zero.tokens, zero.token_logprobs, strict=True)]


def test_an_assistant_message_sent_back_as_the_client_parsed_it_is_its_text(client):
    """`message.model_dump()` (how most clients keep a conversation) adds refusal, annotations, audio and
    function_call, all null: they change nothing (before: 400 for each). A refusal is the assistant's
    text; a spoken reply or a deprecated function_call is refused by name."""
    question = {"role": "user", "content": "Hi"}
    reply = client.chat.completions.create(model=MODEL, messages=[question], **GREEDY).choices[0].message
    dumped = reply.model_dump()
    assert {"refusal", "annotations", "audio", "function_call"} <= dumped.keys()
    then = {"role": "user", "content": "And then?"}
    by_hand = [question, {"role": "assistant", "content": reply.content}, then]
    expected = client.chat.completions.create(model=MODEL, messages=by_hand, **GREEDY).choices[0].message.content
    answer = client.chat.completions.create(model=MODEL, messages=[question, dumped, then], **GREEDY)
    assert answer.choices[0].message.content == expected
    refusal = {"role": "assistant", "content": None, "refusal": reply.content}
    answer = client.chat.completions.create(model=MODEL, messages=[question, refusal, then], **GREEDY)
    assert answer.choices[0].message.content == expected
    for field, value in (("audio", {"id": "audio_1"}), ("function_call", {"name": "f", "arguments": "{}"})):
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(model=MODEL, messages=[question, {**dumped, field: value}, then], **GREEDY)
        assert error.value.body["param"] == f"messages[1].{field}"


def test_a_stream_sends_no_empty_chunk_while_its_text_is_held_back(client):
    """A token that ends inside a character (the tiny model writes é as two byte tokens) adds no text
    yet: no event goes out for it (before: `delta: {}` mid-stream, which OpenAI never sends), and the
    streamed text is the whole answer's."""
    biased = dict(temperature=0, max_tokens=24, logit_bias={"195": 40, "169": 40}, extra_body={"ignore_eos": True})
    messages = [{"role": "user", "content": "x"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, **biased).choices[0].message.content
    assert "é" in whole
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, stream=True, **biased))
    assert all(c.choices[0].delta.content for c in chunks[1:-1])  # the role's first, the finish's last
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole
    text = client.completions.create(model=MODEL, prompt="x", **biased).choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt="x", stream=True, **biased))
    assert all(c.choices[0].text for c in chunks[:-1]) and "".join(c.choices[0].text for c in chunks) == text


def test_logprobs_bytes_rebuild_the_text_and_offsets_say_where_each_token_starts(client, base_url):
    """The tiny model's tokens are single bytes, so each character past ASCII spans tokens (biased here to
    write é's two bytes, 0xC3 0xA9, in some order): each token's `bytes` are its own (not U+FFFD's), so
    joined they are the text; a completion's text_offset counts the characters of its text before each
    token, the same streamed as whole."""
    biased = dict(temperature=0, max_tokens=24, logit_bias={"195": 40, "169": 40}, extra_body={"ignore_eos": True})
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], logprobs=True, **biased
    )
    tokens = [bytes(c.bytes) for c in r.choices[0].logprobs.content]
    assert b"\xc3\xa9" in b"".join(tokens) and all(len(t) == 1 for t in tokens)
    assert b"".join(tokens).decode("utf-8", "replace") == r.choices[0].message.content
    whole = client.completions.create(model=MODEL, prompt="ab", logprobs=1, **biased).choices[0]
    offsets, text = whole.logprobs.text_offset, whole.text
    assert offsets[0] == 0 and offsets == sorted(offsets)
    assert len(set(offsets)) < len(offsets)  # é: two tokens, one place
    for offset, token in zip(offsets, whole.logprobs.tokens, strict=True):
        if token.isascii():
            assert text[offset] == token
    streamed = []
    for chunk in client.completions.create(model=MODEL, prompt="ab", logprobs=1, stream=True, **biased):
        streamed += chunk.choices[0].logprobs.text_offset if chunk.choices[0].logprobs else []
    assert streamed == offsets


def test_async_client(base_url, llm):
    async def main():
        client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)
        rs = await asyncio.gather(*(client.completions.create(model=MODEL, prompt=f"p{i}", **GREEDY) for i in range(4)))
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "a"}], stream=True, **GREEDY
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream])
        await client.close()
        return [r.choices[0].text for r in rs], text

    texts, chat_text = asyncio.run(main())
    assert texts == [llm.generate(f"p{i}", _params(12)).text for i in range(4)]
    assert chat_text == llm.chat([{"role": "user", "content": "a"}], _params(12)).text


def test_32_concurrent_streams_equal_their_solo_runs(client, llm):
    prompts = [f"client {i} says " + "la " * i for i in range(32)]
    solo = [llm.generate(p, _params(20)).text for p in prompts]
    results: dict[int, str] = {}

    def worker(i: int) -> None:
        stream = client.completions.create(
            model=MODEL, prompt=prompts[i], stream=True, temperature=0, max_tokens=20, extra_body={"ignore_eos": True}
        )
        results[i] = "".join(c.choices[0].text for c in stream)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [results.get(i) for i in range(32)] == solo


def test_closing_a_stream_frees_everything(client, base_url, llm):
    baseline = metric(base_url, "kvserve_kv_blocks_used")
    aborted = llm.engine.call(lambda: llm.engine.num_aborted_total)
    with StepGate(llm) as gate:
        stream = client.completions.create(
            model=MODEL, prompt="long one", stream=True, temperature=0, max_tokens=900, extra_body={"ignore_eos": True}
        )
        assert gate.entered.wait(30)  # held in its first step: 900 tokens cannot be done yet
        gate.open()
        for i, _ in enumerate(stream):
            if i == 2:
                break
        stream.close()
        wait_idle_and_check(llm)  # the abort reached the engine and freed every block
    assert llm.engine.call(lambda: llm.engine.num_aborted_total) == aborted + 1
    assert metric(base_url, "kvserve_kv_blocks_used") == baseline


def test_non_streaming_disconnect_aborts(base_url, llm):
    aborted = llm.stats()["num_aborted_total"]
    body = json.dumps({"model": MODEL, "prompt": "slow", "max_tokens": 900, "temperature": 0, "ignore_eos": True})
    host, port = base_url.removeprefix("http://").split(":")
    with StepGate(llm) as gate:
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(
                f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
            )
            assert gate.entered.wait(30)  # its first step is held: the request cannot have finished
        # The client is gone; the server must abort the request (its message reaches the engine's inbox).
        deadline = time.monotonic() + 30
        while llm.engine.inbox.qsize() == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
    wait_idle_and_check(llm)
    assert llm.engine.call(lambda: llm.engine.num_aborted_total) == aborted + 1  # not a snapshot: exact


def test_hundred_disconnects_leave_the_server_healthy(client, base_url, llm):
    for i in range(100):
        stream = client.completions.create(
            model=MODEL, prompt=f"d{i}", stream=True, temperature=0, max_tokens=200, extra_body={"ignore_eos": True}
        )
        next(iter(stream))
        stream.close()
    wait_idle_and_check(llm)
    assert httpx.get(f"{base_url}/health").status_code == 200
    assert client.completions.create(model=MODEL, prompt="ok", **GREEDY).choices[0].finish_reason == "length"


def test_delete_aborts_by_response_id_and_client_id(base_url, llm):
    body = {"model": MODEL, "prompt": "abort me", "max_tokens": 900, "stream": True, "ignore_eos": True}
    headers = {"X-Request-Id": "mine-1"}
    with StepGate(llm) as gate, httpx.stream("POST", f"{base_url}/v1/completions", json=body, headers=headers) as r:
        assert gate.entered.wait(30)  # the request is in the engine and cannot have finished
        assert httpx.delete(f"{base_url}/v1/requests/mine-1").status_code == 200
        gate.open()
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert events[-1]["choices"][0]["finish_reason"] == "abort"
    assert events[0]["id"].startswith("cmpl-")
    missing = httpx.delete(f"{base_url}/v1/requests/{events[0]['id']}")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "request_id"


BAD_REQUESTS = [
    ("completions", b"{not json", 400),
    ("completions", {"model": MODEL}, 400),  # no prompt
    ("completions", {"model": MODEL, "prompt": 5}, 400),
    ("completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400),
    ("completions", {"model": MODEL, "prompt": "x", "max_tokens": "many"}, 400),
    ("completions", {"model": MODEL, "prompt": "x", "temperature": -1}, 400),
    ("completions", {"model": MODEL, "prompt": "x", "top_p": 0}, 400),
    ("completions", {"model": MODEL, "prompt": "x", "top_k": -5}, 400),
    ("completions", {"model": MODEL, "prompt": "x", "min_p": 3}, 400),
    ("completions", {"model": MODEL, "prompt": "x", "presence_penalty": 9}, 400),
    ("completions", {"model": MODEL, "prompt": "x", "frequency_penalty": -9}, 400),
    ("completions", {"model": MODEL, "prompt": "x", "repetition_penalty": 0}, 400),
    ("completions", {"model": MODEL, "prompt": "x", "logprobs": 50}, 400),
    ("completions", {"model": MODEL, "prompt": "x", "n": 0}, 400),
    ("completions", {"model": MODEL, "prompt": "x", "seed": -3}, 400),
    ("completions", {"model": MODEL, "prompt": "x", "stop": [""]}, 400),
    ("completions", {"model": MODEL, "prompt": [1, 2, 999999]}, 400),
    ("completions", {"model": MODEL, "prompt": []}, 400),
    ("completions", {"model": MODEL, "prompt": ""}, 400),
    ("completions", {"model": MODEL, "prompt": "x" * 5000}, 400),  # longer than the context
    ("completions", {"model": MODEL, "prompt": "x", "max_tokens": 100000}, 400),
    ("completions", {"model": MODEL, "prompt": "x", "logit_bias": {"1": 200}}, 400),
    ("completions", {"model": MODEL, "prompt": "x", "logit_bias": {"99999": 2}}, 400),  # outside the vocabulary
    ("completions", {"model": MODEL, "prompt": "x", "suffix": "y"}, 400),
    ("completions", {"model": "gpt-4", "prompt": "x"}, 404),
    ("completions", {"model": MODEL, "prompt": "x" * 300_000}, 413),
    ("chat/completions", {"model": MODEL, "messages": []}, 400),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": []}, 400),
    (
        "chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
        400,
    ),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, 400),
    ("chat/completions", {"model": "other", "messages": [{"role": "user", "content": "x"}]}, 404),
]


def test_bad_requests_get_4xx_while_a_good_stream_completes(base_url, client, llm):
    expected_text = llm.generate("good", _params(200)).text
    good: dict[str, str] = {}

    def good_stream() -> None:
        stream = client.completions.create(
            model=MODEL, prompt="good", stream=True, temperature=0, max_tokens=200, extra_body={"ignore_eos": True}
        )
        good["text"] = "".join(c.choices[0].text for c in stream)

    thread = threading.Thread(target=good_stream)
    thread.start()
    failures = []
    for route, body, status in BAD_REQUESTS:
        kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
        r = httpx.post(f"{base_url}/v1/{route}", headers={"content-type": "application/json"}, **kwargs)
        error = r.json().get("error", {}) if r.headers.get("content-type", "").startswith("application/json") else {}
        if r.status_code != status or set(error) != {"message", "type", "param", "code"} or not error["message"]:
            failures.append((route, str(body)[:60], r.status_code, r.text[:200]))
    thread.join(60)
    assert not failures, failures
    assert len(BAD_REQUESTS) >= 25
    assert good["text"] == expected_text


def test_error_bodies_name_the_field(base_url):
    r = httpx.post(f"{base_url}/v1/completions", json={"model": MODEL, "prompt": "x", "top_p": 0})
    assert r.json()["error"]["param"] == "top_p"
    r = httpx.post(
        f"{base_url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": []},
    )
    assert r.json()["error"]["param"] == "tools" and "tools" in r.json()["error"]["message"]


def _tool(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {}}}}


def test_chat_errors_name_the_fields_the_body_sent(base_url):
    """A chat body's max_completion_tokens and top_logprobs are the engine's max_tokens and logprobs, and
    its messages the engine's prompt: errors name what the client sent (before, the engine's names)."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    for extra, param, says in (
        ({"max_completion_tokens": 0}, "max_completion_tokens", "max_completion_tokens must be an integer"),
        ({"max_completion_tokens": 10**6}, "max_completion_tokens", "lower max_completion_tokens to at most"),
        ({"max_completion_tokens": 4, "min_tokens": 5}, "min_tokens", "must not exceed max_completion_tokens (4)"),
        ({"max_tokens": 0}, "max_tokens", "max_tokens must be an integer"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "top_logprobs must be between 0 and 20"),
        ({"messages": [{"role": "user", "content": "x " * 1000}]}, "messages", "Send fewer or shorter messages"),
        (  # a message quoting the client's own text keeps it as sent
            {"max_completion_tokens": 4, "tools": [_tool("max_tokens"), _tool("max_tokens")]},
            "tools",
            "'max_tokens' twice",
        ),
    ):
        r = httpx.post(f"{base_url}/v1/chat/completions", json={**chat, **extra})
        error = r.json()["error"]
        assert (r.status_code, error["param"]) == (400, param) and says in error["message"], (extra, error)


def test_auth(llm):
    settings = ServerSettings(served_model_name=MODEL, api_keys=("k1", "k2"))
    with running_server(settings, llm) as base:
        assert httpx.get(f"{base}/health").status_code == 200
        assert httpx.get(f"{base}/metrics").status_code == 200
        r = httpx.get(f"{base}/v1/models")
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
        for key in ("k1", "k2"):
            client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
            assert client.models.list().data[0].id == MODEL


def test_429_with_retry_after_when_the_queue_is_full(llm):
    settings = ServerSettings(served_model_name=MODEL, max_num_seqs=2, max_queue=1)
    with running_server(settings, llm) as base, StepGate(llm) as gate:
        body = {"model": MODEL, "prompt": "busy", "max_tokens": 900, "stream": True, "ignore_eos": True}
        with httpx.Client(timeout=30) as http, contextlib.ExitStack() as open_streams:
            for _ in range(3):  # two running + one queued: the server is full (and held: none can finish)
                open_streams.enter_context(http.stream("POST", f"{base}/v1/completions", json=body))
            assert gate.entered.wait(30)
            rejected = metric(base, "kvserve_requests_rejected_total")
            r = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
            assert r.status_code == 429 and r.headers["Retry-After"] == "1"
            assert r.json()["error"]["type"] == "rate_limit_error"
            assert metric(base, "kvserve_requests_rejected_total") == rejected + 1
            gate.open()
        wait_idle_and_check(llm)
        ok = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert ok.status_code == 200


def test_request_timeout(llm):
    settings = ServerSettings(served_model_name=MODEL, request_timeout=0.2)
    with running_server(settings, llm) as base, StepGate(llm):  # held: no request can finish in time
        body = {"model": MODEL, "prompt": "x", "max_tokens": 900, "ignore_eos": True}
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
        assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout"
        with httpx.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}, timeout=30) as s:
            lines = [line for line in s.iter_lines() if line]
        assert lines[-1] == "data: [DONE]" and "request_timeout" in lines[-2]
    wait_idle_and_check(llm)


def test_metrics_names(base_url, client):
    client.completions.create(model=MODEL, prompt="m", **GREEDY)
    text = httpx.get(f"{base_url}/metrics").text
    for name in (
        "kvserve_requests_running",
        "kvserve_requests_waiting",
        "kvserve_kv_cache_usage_ratio",
        "kvserve_kv_blocks_used",
        "kvserve_kv_blocks_total",
        "kvserve_prefix_cache_hit_tokens_total",
        "kvserve_prompt_tokens_total",
        "kvserve_generation_tokens_total",
        "kvserve_requests_aborted_total",
        "kvserve_requests_rejected_total",
        "kvserve_time_to_first_token_seconds_bucket",
        "kvserve_e2e_request_latency_seconds_count",
    ):
        assert name in text, name


def _params(max_tokens: int):
    from kvserve import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def test_requests_still_running_when_the_shutdown_timeout_is_over_get_a_503(llm):
    """Past --shutdown-timeout (`stop_requests_in`, which `kvserve serve` calls at SIGTERM) a request
    still running is aborted and answered as OpenAI answers errors: 503, or in a stream an error event
    then [DONE]. Before, uvicorn cancelled them: a text/plain 500 and a stream cut mid-way. The engine
    is held, so both are surely still running; their blocks are freed once it steps again."""
    app = create_app(ServerSettings(served_model_name=MODEL), llm)
    state = app.state.kvserve
    body = {"model": MODEL, "prompt": "x", "max_tokens": 200, "ignore_eos": True}
    answers: dict = {}

    def unstreamed() -> None:
        answers["plain"] = httpx.post(
            f"{base}/v1/completions", json=body, headers={"X-Request-Id": "plain"}, timeout=60
        )

    def streamed() -> None:
        request = {**body, "stream": True}
        with httpx.stream(
            "POST", f"{base}/v1/completions", json=request, headers={"X-Request-Id": "s"}, timeout=60
        ) as r:
            answers["stream"] = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]

    with serving(app) as base, StepGate(llm) as gate:
        threads = [threading.Thread(target=unstreamed), threading.Thread(target=streamed)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 30
        while not {"plain", "s"} <= {rid for _, rid in state.requests} and time.monotonic() < deadline:
            time.sleep(0.01)
        assert gate.entered.wait(30)
        state.stop_requests_in(0)
        for thread in threads:
            thread.join(30)
        gate.open()
    plain = answers["plain"]
    assert plain.status_code == 503 and plain.json()["error"]["code"] == "server_shutting_down", plain.text
    assert answers["stream"][-1] == "[DONE]"
    assert json.loads(answers["stream"][-2])["error"]["code"] == "server_shutting_down", answers["stream"]
