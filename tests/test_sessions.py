"""Sessions on a tiny random model: retention, ordering under concurrency (R1), fork, eviction,
persistence. Every test ends with the pool's integrity check and, once sessions close, no block in use."""

from __future__ import annotations

import asyncio
import gc
import threading
import time

import pytest

from kvserve import LLM, InvalidRequestError, SamplingParams
from kvserve.sessions.manager import SessionBusyError, SessionLimitError, SessionNotFoundError
from kvserve.sessions.status import owner_sessions
from tests.conftest import StepGate, wait_idle, wait_idle_and_check

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture
def llm(tiny_model_dir, tmp_path):
    with LLM(
        str(tiny_model_dir), dtype="float32", kv_cache_tokens=8192, session_db=tmp_path / "s.db", progress=False
    ) as llm:
        yield llm


def close_all_and_check(llm: LLM, sessions) -> None:
    for s in sessions:
        s.close()
    counts = wait_idle_and_check(llm)
    assert counts["used"] == 0


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_three_turns_equal_stateless_chat_and_compute_only_new_tokens(llm):
    s = llm.session(system="You are terse.")
    history = [{"role": "system", "content": "You are terse."}]
    previous = None
    for i in range(3):
        s.add_message("user", f"question number {i}: " + "why? " * (i + 1))
        history.append({"role": "user", "content": f"question number {i}: " + "why? " * (i + 1)})
        out = s.generate(GREEDY)
        expected = llm.chat(history, GREEDY)
        assert out.text == expected.text and out.token_ids == expected.token_ids
        prompt = llm.tokenizer.encode_chat(history)
        if previous is not None:
            computed = previous[0] + previous[1][:-1]  # the last sampled token has no KV yet
            block = llm.config.block_size
            assert out.usage.cached_tokens == common_prefix(prompt, computed) // block * block > 0
        history.append({"role": "assistant", "content": out.text})
        previous = (prompt, out.token_ids)
        info = s.info()
        assert info["kv_blocks"] > 0 and info["num_turns"] == i + 1
    assert llm.stats()["session_kv_blocks"] == s.info()["kv_blocks"]
    wait_idle_and_check(llm, pinned=s.info()["kv_blocks"])  # held while idle, nothing else
    close_all_and_check(llm, [s])


def test_r1_appends_during_a_turn_queue_behind_it_in_order(llm):
    s = llm.session(system="sys")
    s.add_message("user", "first")
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    chunks, errors = [], []
    started = threading.Event()

    def turn() -> None:
        try:
            for chunk in s.stream(params):
                chunks.append(chunk)
                started.set()
        except BaseException as exc:
            errors.append(exc)
            started.set()

    thread = threading.Thread(target=turn)
    thread.start()
    started.wait(30)
    for i in range(50):
        s.append(f"c{i} ")
    thread.join(60)
    assert not errors
    text = "".join(c.text for c in chunks)
    messages = s.info()["messages"]
    assert messages[-2] == {"role": "assistant", "content": text}
    assert messages[-1] == {"role": "user", "content": "".join(f"c{i} " for i in range(50))}
    # The same operations one after another give the same outputs.
    sequential = llm.chat([{"role": "system", "content": "sys"}, {"role": "user", "content": "first"}], params)
    assert sequential.text == text
    second = s.generate(GREEDY)
    assert second.text == llm.chat(messages, GREEDY).text
    close_all_and_check(llm, [s])


@pytest.mark.parametrize("announce", [False, True], ids=["library", "server"])
def test_a_turn_aborted_while_queued_behind_another_ends_with_abort(llm, announce):
    """Aborted by id from elsewhere (the server's DELETE /v1/requests/{id}) while it waits behind the
    running turn, a queued turn was dropped with nothing put in its stream: its caller waited for good.
    The server's turns announce their start with an empty first chunk, which the server takes for the
    start: the abort must come after one there, or the stream had no end still."""
    s = llm.session(system="sys")
    s.add_message("user", "first")
    with StepGate(llm) as gate:
        running = s.stream(SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        first = []
        runner = threading.Thread(target=lambda: first.extend(running))
        runner.start()
        assert gate.entered.wait(30)  # the first turn runs, held at a step
        request_id, start = s.start_turn(GREEDY, False, "queued-turn", announce)
        posted = threading.Event()

        def start_and_tell(sink) -> None:
            start(sink)
            posted.set()

        queued = llm.client.stream_with(request_id, start_and_tell)
        second = []
        waiter = threading.Thread(target=lambda: second.extend(queued))
        waiter.start()
        assert posted.wait(30)  # queued behind the first turn once the engine reads its inbox, then:
        llm.abort("queued-turn")
        gate.open()
    waiter.join(60)
    runner.join(60)
    assert not waiter.is_alive() and second[-1].finish_reason == "abort", second
    assert [c.finish_reason for c in second] == ([None, "abort"] if announce else ["abort"]), second
    assert first[-1].finish_reason == "length"
    close_all_and_check(llm, [s])


def test_a_fork_during_a_turn_is_refused_and_after_it_holds_the_turn(llm):
    """A fork copies the session, so it needs one that is not changing: during a turn (with a message
    queued behind it) it is refused with SessionBusyError, rather than copy a history that lacks what
    was asked for before it; after the turn it holds the reply and the queued message."""
    s = llm.session(system="sys")
    s.add_message("user", "Count to ten.")
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    with StepGate(llm) as gate:
        chunks, outcome = [], []
        turn = threading.Thread(target=lambda: chunks.extend(s.stream(params)))
        turn.start()
        assert gate.entered.wait(30)  # the turn's first step waits at the gate: it is running
        queued = threading.Thread(target=s.add_message, args=("user", "queued behind the turn"))
        queued.start()
        while queued.is_alive():  # the engine takes calls between steps: a step at a time until it has
            gate.allow(1)
            queued.join(0.05)

        def fork() -> None:
            try:
                outcome.append(s.fork())
            except SessionBusyError as exc:
                outcome.append(exc)

        forking = threading.Thread(target=fork)
        forking.start()
        while forking.is_alive():
            gate.allow(1)
            forking.join(0.05)
        assert isinstance(outcome[0], SessionBusyError) and gate.num_entered < 200  # the turn still ran
        gate.open()
        turn.join(60)
    child = s.fork()
    reply = "".join(c.text for c in chunks)
    assert child.info()["messages"][-2:] == [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "queued behind the turn"},
    ]
    assert child.info()["messages"] == s.info()["messages"]
    close_all_and_check(llm, [s, child])


def test_streamed_input_is_prefilled_eagerly(llm):
    s = llm.session()
    text = "".join(f"word{i} " for i in range(60))
    for start in range(0, len(text), 20):
        s.append(text[start : start + 20])
    counts = wait_idle(llm)  # the engine prefilled while "the user was still typing": nothing left to run
    assert not counts["running"] and not counts["waiting"]
    out = s.generate(GREEDY)
    prompt = llm.tokenizer.encode_chat([{"role": "user", "content": text}])
    assert out.text == llm.chat([{"role": "user", "content": text}], GREEDY).text
    assert out.usage.cached_tokens >= len(prompt) - 3 * llm.config.block_size
    close_all_and_check(llm, [s])


def test_fork_continues_independently(llm):
    s = llm.session(system="base")
    s.add_message("user", "shared question")
    first = s.generate(GREEDY).text
    t = s.fork()
    assert t.id != s.id
    pinned = llm.engine.call(lambda: llm.sessions.stats())["session_kv_blocks"]
    assert pinned == s.info()["kv_blocks"] == t.info()["kv_blocks"] > 0  # one set of blocks, held by both
    s.add_message("user", "branch A")
    t.add_message("user", "branch B")
    a, b = s.generate(GREEDY), t.generate(GREEDY)
    base = [
        {"role": "system", "content": "base"},
        {"role": "user", "content": "shared question"},
        {"role": "assistant", "content": first},
    ]
    assert a.text == llm.chat([*base, {"role": "user", "content": "branch A"}], GREEDY).text
    assert b.text == llm.chat([*base, {"role": "user", "content": "branch B"}], GREEDY).text
    assert b.usage.cached_tokens > 0
    assert len(s.info()["messages"]) == len(t.info()["messages"]) == 5
    close_all_and_check(llm, [s, t])


def test_aborted_turn_leaves_history_and_interrupt(llm):
    s = llm.session()
    s.add_message("user", "hello")
    for i, _ in enumerate(s.stream(SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))):
        if i == 2:
            break
    wait_idle_and_check(llm)
    assert s.info()["messages"] == [{"role": "user", "content": "hello"}]
    results = {}

    def long_turn() -> None:
        results["long"] = list(s.stream(SamplingParams(max_tokens=900, temperature=0, ignore_eos=True)))

    def quick_turn() -> None:
        results["quick"] = s.generate(GREEDY, interrupt=True)

    with StepGate(llm) as gate:
        long = threading.Thread(target=long_turn)
        long.start()
        assert gate.entered.wait(30)  # the long turn is held in its first step: it is surely running
        quick = threading.Thread(target=quick_turn)
        quick.start()
        deadline = time.monotonic() + 30
        while llm.engine.inbox.qsize() == 0 and time.monotonic() < deadline:  # the interrupting turn
            time.sleep(0.01)
        gate.open()
        long.join(60)
        quick.join(60)
    quick = results["quick"]
    assert results["long"][-1].finish_reason == "abort"
    assert quick.finish_reason == "length"
    assert s.info()["messages"][-1] == {"role": "assistant", "content": quick.text}
    close_all_and_check(llm, [s])


def test_eviction_under_a_small_pool_keeps_outputs(tiny_model_dir, tmp_path):
    with LLM(str(tiny_model_dir), dtype="float32", kv_cache_tokens=512, session_db=False, progress=False) as small:
        sessions = [small.session(system=f"session {i} " * 5) for i in range(10)]
        histories = []
        for i, s in enumerate(sessions):
            s.add_message("user", f"hello from {i} " * 3)
            first = s.generate(GREEDY)
            histories.append(
                [
                    {"role": "system", "content": f"session {i} " * 5},
                    {"role": "user", "content": f"hello from {i} " * 3},
                    {"role": "assistant", "content": first.text},
                ]
            )
        assert sum(s.info()["kv_blocks"] for s in sessions) <= small.config.num_kv_blocks
        for s, history in zip(sessions, histories, strict=True):
            s.add_message("user", "again")
            out = s.generate(GREEDY)
            assert out.text == small.chat([*history, {"role": "user", "content": "again"}], GREEDY).text
        small.check_integrity()
        close_all_and_check(small, sessions)


def test_sessions_survive_a_restart(tiny_model_dir, tmp_path):
    db = tmp_path / "persist.db"
    with LLM(str(tiny_model_dir), dtype="float32", kv_cache_tokens=4096, session_db=db, progress=False) as a:
        s = a.session(system="persist")
        s.add_message("user", "turn one")
        one = s.generate(GREEDY).text
        s.add_message("user", "turn two (acknowledged, not answered before the restart)")
        s.append("streamed ")  # input still streaming in: an open user message
        s.append("input")
        session_id = s.id
    with LLM(str(tiny_model_dir), dtype="float32", kv_cache_tokens=4096, session_db=db, progress=False) as b:
        again = b.session(id=session_id)
        messages = again.info()["messages"]
        assert messages == [
            {"role": "system", "content": "persist"},
            {"role": "user", "content": "turn one"},
            {"role": "assistant", "content": one},
            {"role": "user", "content": "turn two (acknowledged, not answered before the restart)"},
            {"role": "user", "content": "streamed input"},
        ]  # everything acknowledged was stored before it was (R8), the open message as open
        fork = again.fork()
        assert again.info()["num_turns"] == 1 == fork.info()["num_turns"]  # the reply each holds
        fork.close()
        again.append(" goes on")  # joins the streamed message, as it would have before the restart
        messages[-1] = {"role": "user", "content": "streamed input goes on"}
        assert again.info()["messages"] == messages
        out = again.generate(GREEDY)
        assert out.text == b.chat(messages, GREEDY).text
        assert again.info()["num_turns"] == 2
        again.close()
        with pytest.raises(SessionNotFoundError):
            b.session(id=session_id)  # closing deletes it from the store too
        wait_idle_and_check(b)


def test_text_that_is_not_a_string_is_refused_not_stored_as_its_repr(llm):
    s = llm.session()
    for call, param in ((lambda: s.add_message("user", None), "content"), (lambda: s.append(5), "text")):
        with pytest.raises(InvalidRequestError) as err:
            call()
        assert err.value.param == param and "must be a string" in str(err.value)
    with pytest.raises(InvalidRequestError) as err:
        llm.session(system=5)
    assert err.value.param == "system"
    assert s.info()["messages"] == []  # nothing was stored
    s.close()


def test_leaving_a_turn_aborts_that_turn_only(llm):
    """A turn's stream left early (a cancelled task, a break) aborts that turn, found by its stream, not
    by its id: a turn refused for an id another request holds, left before the refusal arrived, aborted
    that request. A turn queued behind another in its session is still dropped by its stream."""
    long = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    s = llm.session()
    s.add_message("user", "hello")

    async def left_before_its_refusal():
        with StepGate(llm) as gate:
            first = asyncio.create_task(llm.agenerate("a request that holds its id", long, request_id="taken"))
            assert await asyncio.to_thread(gate.entered.wait, 30)
            llm.pause("taken")  # applied after that step: it stays, unfinished, while the engine goes on
            gate.open()
        turn = asyncio.create_task(anext(s.astream(long, request_id="taken")))
        await asyncio.sleep(0)  # it has posted its turn, and waits for its first chunk
        turn.cancel()
        with pytest.raises(asyncio.CancelledError):
            await turn
        with pytest.raises(InvalidRequestError, match="already in use"):  # what the turn was refused with
            list(s.stream(long, request_id="taken"))
        llm.pause("taken", paused=False)
        return await first

    assert asyncio.run(left_before_its_refusal()).finish_reason == "length"

    async def left_while_queued():
        async def whole(stream):
            return [chunk async for chunk in stream]

        with StepGate(llm) as gate:
            first = asyncio.create_task(whole(s.astream(SamplingParams(max_tokens=60, ignore_eos=True))))
            assert await asyncio.to_thread(gate.entered.wait, 30)  # the first turn runs, held at a step

            async def between_steps(fn, *args):  # the engine takes calls between steps: a step at a time
                call = asyncio.create_task(asyncio.to_thread(fn, *args))
                while not call.done():
                    gate.allow(1)
                    await asyncio.sleep(0.05)
                return call.result()

            await between_steps(s.add_message, "user", "and then?")
            queued = asyncio.create_task(anext(s.astream(long)))  # it would answer "and then?" after the first
            await asyncio.sleep(0)  # it has posted its turn (posting is the stream's first, synchronous, act)
            waiting = await between_steps(s._call, lambda manager, state: [type(op).__name__ for op in state.pending])
            assert waiting[-1] == "Turn"  # queued in its session behind the first turn (and the message)
            queued.cancel()
            with pytest.raises(asyncio.CancelledError):
                await queued
            gate.open()
        return await first

    assert asyncio.run(left_while_queued())[-1].finish_reason == "length"
    # the queued turn never ran: the message queued before it is the last
    assert [m["role"] for m in s.info()["messages"]] == ["user", "assistant", "user"]
    close_all_and_check(llm, [s])


def test_limits_owner_and_ttl(tiny_model_dir):
    with LLM(
        str(tiny_model_dir),
        dtype="float32",
        kv_cache_tokens=1024,
        session_db=False,
        max_sessions=2,
        session_ttl=60.0,  # longer than any test takes: only the moved clock below expires them
        progress=False,
    ) as llm:
        a = llm.session(owner="alice")
        llm.session()
        with pytest.raises(SessionLimitError):
            llm.session()
        with pytest.raises(SessionNotFoundError):
            llm.session(id=a.id, owner="mallory")
        # The clock moves past the TTL (no sleep): the engine expires idle sessions at that time.
        llm.engine.call(lambda: llm.sessions.tick(time.monotonic() + 61.0))
        with pytest.raises(SessionNotFoundError):
            a.info()  # expired
        assert llm.stats()["num_sessions"] == 0
        wait_idle_and_check(llm)


def test_a_turn_is_announced_only_once_the_engine_knows_its_request(llm):
    """The server answers a session turn's headers on the announce chunk, and a client (the page)
    then asks GET /v1/requests/{id}/events: the engine's monitor must know the request by then, or
    the client is told it "ended too long ago". Checked on the engine thread, where the two happen."""
    from kvserve.engine.client import ThreadSink, chunks

    seen_at_admit: dict[str, int] = {}

    class AtAdmit:  # an observer ahead of the monitor: what the turn's sink held when it was admitted
        def on_admit(self, request) -> None:
            seen_at_admit[request.request_id] = sink.qsize()

        def on_finished(self, request) -> None:
            pass

    llm.engine.observers.insert(0, AtAdmit())
    s = llm.session()
    s.add_message("user", "hello")
    sink = ThreadSink()
    request_id, start = s.start_turn(GREEDY, False, "announced-turn", announce=True)
    start(sink)
    got = list(chunks(sink))
    assert got[0].text == "" and got[0].finish_reason is None  # the announce chunk comes first
    assert got[-1].finish_reason == "length"
    assert seen_at_admit == {request_id: 0}  # admitted (and known to the monitor) before it was announced
    assert llm.monitor.statuses([request_id])[request_id]["state"] == "finished"
    close_all_and_check(llm, [s])


def test_a_turn_whose_request_id_is_in_use_is_refused_and_leaves_the_other_request_alone(llm):
    """A turn given the id of a request already running is refused; the session stays usable, and
    the other request's reply never becomes the session's (it finished under the same id)."""
    from kvserve.engine.client import ThreadSink, chunks

    s = llm.session()
    s.append("hel")  # streamed in: the message stays open until a turn takes it
    with StepGate(llm) as gate:
        other = llm.client.submit(llm.request_builder.build("the other request", GREEDY, "shared-id"))
        assert gate.entered.wait(30)  # the other request is running under "shared-id", held in a step
        sink = ThreadSink()
        _, start = s.start_turn(GREEDY, False, "shared-id")
        start(sink)  # queued for the engine thread, which takes it after the step it is held in
        gate.allow(1)
        with pytest.raises(InvalidRequestError, match="already in use"):
            list(chunks(sink))
        gate.open()
        assert list(chunks(other))[-1].finish_reason == "length"
    wait_idle(llm)
    s.append("lo")  # the refused turn took nothing: this joins the open message
    assert s.info()["messages"] == [{"role": "user", "content": "hello"}]  # not the other request's reply
    reply = s.generate(GREEDY)  # the session is not stuck behind a turn that never ran
    assert reply.finish_reason == "length"
    assert s.info()["messages"][-1] == {"role": "assistant", "content": reply.text}
    close_all_and_check(llm, [s])


def test_turns_queued_behind_a_request_their_pins_crowd_out_all_finish(tiny_model_dir):
    """A pool of 16 blocks, two sessions pinning half of it, then a stateless request and both sessions'
    next turns admitted together, in that order. The turns need more blocks than are free, and so
    does the request ahead of them: their sessions' pins must give way (before, reclaim spared a
    session with a queued turn: nothing ran, and the engine thread spun). Every output equals its
    reference (the solo run; the stateless chat on the session's history), and no block leaks."""
    from kvserve.engine.client import ThreadSink

    with LLM(str(tiny_model_dir), dtype="float32", kv_cache_tokens=256, session_db=False, progress=False) as small:
        sessions, histories = [], []
        for i in range(2):
            s = small.session(system=f"system {i} " * 10)
            s.add_message("user", "hi")
            first = s.generate(GREEDY)
            s.add_message("user", "again")
            sessions.append(s)
            histories.append(
                [
                    {"role": "system", "content": f"system {i} " * 10},
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": first.text},
                    {"role": "user", "content": "again"},
                ]
            )
        assert small.stats()["session_kv_blocks"] >= 8  # pinned, of 16
        entered, release = threading.Event(), threading.Event()
        holder = threading.Thread(target=lambda: small.engine.call(lambda: (entered.set(), release.wait(30))))
        holder.start()
        assert entered.wait(30)  # the engine thread waits in this call while the three arrive
        sinks = [small.client.submit(small.request_builder.build("x" * 60, GREEDY, "stateless"))]
        for s in sessions:
            sink = ThreadSink()
            s.start_turn(GREEDY, False, None)[1](sink)
            sinks.append(sink)
        release.set()  # one drain of the inbox admits all three before the next schedule
        holder.join(30)
        outputs = []
        for sink in sinks:  # a timeout, not a hang, if they never finish
            got = []
            while not got or got[-1].finish_reason is None:
                item = sink.get(timeout=60)
                assert not isinstance(item, BaseException), item
                got.append(item)
            outputs.append("".join(c.text for c in got))
        assert outputs[0] == small.generate("x" * 60, GREEDY).text
        for out, history in zip(outputs[1:], histories, strict=True):
            assert out == small.chat(history, GREEDY).text
        close_all_and_check(small, sessions)


def test_an_llm_nobody_holds_stops_its_engine_and_lets_its_sessions_go(tiny_model_dir, tmp_path):
    """Dropped without close(): while one of its sessions or unfinished streams is held it serves them;
    once nothing is, its engine thread ends and its store lets the sessions go. Before, the engine thread
    held the LLM for good: its thread, its KV pool and its sessions' claims stayed until the process ended."""
    db = tmp_path / "dropped.db"

    def open_llm() -> LLM:
        return LLM(str(tiny_model_dir), dtype="float32", kv_cache_tokens=1024, session_db=db, progress=False)

    llm = open_llm()
    engine = llm.engine
    alone = llm.generate("x", GREEDY).text
    session, stream = llm.session(system="kept"), llm.stream("x", GREEDY)
    session_id = session.id
    del llm
    gc.collect()
    assert engine.thread.is_alive()
    assert "".join(c.text for c in stream) == alone
    session.add_message("user", "hello")
    reply = session.generate(GREEDY).text
    del session, stream
    gc.collect()
    assert not engine.thread.is_alive()
    with open_llm() as again:  # the session is free to open here (SessionBusyError while claimed)
        reopened = again.session(id=session_id)
        assert reopened.info()["messages"][-1] == {"role": "assistant", "content": reply}
        close_all_and_check(again, [reopened])


def test_closing_on_the_engine_thread_finishes_from_another_thread(tiny_model_dir, tmp_path):
    """An LLM's last reference may drop on its engine thread (a garbage collection that runs there):
    closing there cannot wait for that thread to end, so another thread finishes the close."""
    db = tmp_path / "closed-there.db"
    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_tokens=1024, session_db=db, progress=False)
    session_id = llm.session(system="kept").id
    llm.client.call(llm.close)
    for thread in threading.enumerate():
        if thread.name == "kvserve-shutdown":
            thread.join(30)
    assert not llm.engine.thread.is_alive()
    with LLM(str(tiny_model_dir), dtype="float32", kv_cache_tokens=1024, session_db=db, progress=False) as again:
        close_all_and_check(again, [again.session(id=session_id)])  # let go by the closed store


def test_a_second_close_waits_for_the_first(tiny_model_dir, tmp_path):
    """Two threads close one LLM: the second close returns once the engine has stopped and the store
    let its sessions go, as the first does (before, it returned at once, the first still joining)."""
    db = tmp_path / "closed-twice.db"
    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_tokens=1024, session_db=db, progress=False)
    session_id = llm.session(system="kept").id
    held, entered, seen = threading.Event(), threading.Event(), []
    llm.engine.post(held.wait)  # the engine thread waits here, so the first close waits for it
    first = threading.Thread(target=llm.close)
    first.start()
    deadline = time.monotonic() + 30
    while llm._finalizer.alive and time.monotonic() < deadline:  # the first close has begun
        time.sleep(0.01)

    def second() -> None:
        entered.set()
        llm.close()
        seen.append(llm.engine.thread.is_alive())

    other = threading.Thread(target=second)
    other.start()
    assert entered.wait(30)
    held.set()
    first.join(30)
    other.join(30)
    assert seen == [False]
    with LLM(str(tiny_model_dir), dtype="float32", kv_cache_tokens=1024, session_db=db, progress=False) as again:
        close_all_and_check(again, [again.session(id=session_id)])


def test_closing_a_session_twice_closes_it_once(llm):
    """As LLM.close: `with llm.session() as s: s.close()` raised SessionNotFoundError at the block's end.
    Another Session object of the same id still finds it gone."""
    with llm.session(system="x") as session:
        other = llm.session(id=session.id)
        session.close()
    session.close()
    with pytest.raises(SessionNotFoundError):
        other.close()
    wait_idle_and_check(llm)


def test_a_session_is_live_in_one_llm_of_a_process_at_a_time(tiny_model_dir, tmp_path):
    """Two LLMs of one process may share a store (they share its lock), but not a session: before,
    each took its own copy, their histories diverged, and a close in one broke the other's writes."""
    db = tmp_path / "shared.db"
    with (
        LLM(str(tiny_model_dir), dtype="float32", kv_cache_tokens=1024, session_db=db, progress=False) as a,
        LLM(str(tiny_model_dir), dtype="float32", kv_cache_tokens=1024, session_db=db, progress=False) as b,
    ):
        s = a.session(system="shared store")
        s.add_message("user", "hello")
        reply = s.generate(GREEDY).text
        with pytest.raises(SessionBusyError, match="open in another LLM of this process"):
            b.session(id=s.id)
        mine = b.session()  # a's cannot see b's either
        with pytest.raises(SessionBusyError):
            a.session(id=mine.id)
        mine.close()
        with pytest.raises(SessionNotFoundError):  # closed: gone from the store, nobody's
            a.session(id=mine.id)
        a.close()  # a lets its sessions go: b may take them up, with the history a stored
        again = b.session(id=s.id)
        assert again.info()["messages"][-1] == {"role": "assistant", "content": reply}
        again.add_message("user", "and again")
        assert again.generate(GREEDY).finish_reason == "length"
        close_all_and_check(b, [again])


def test_limits_and_ttls_hold_for_the_sessions_of_an_earlier_run(tiny_model_dir, tmp_path):
    """Stored sessions count toward the limits after a restart (a key held twice its limit, and was
    then refused even the close of a stored session), and one idle past its TTL while nobody had it
    open is gone: when asked for, and from the store (it grew for good)."""
    import sqlite3

    db = tmp_path / "s.db"

    def reopened(**options) -> LLM:
        return LLM(str(tiny_model_dir), dtype="float32", kv_cache_tokens=1024, session_db=db, progress=False, **options)

    with reopened() as first:
        kept = first.session(owner="alice").id
        stale = first.session(owner="bob", ttl=60.0).id
        also_stale, fresh = first.session(owner="bob", ttl=60.0).id, first.session(owner="bob", ttl=60.0).id
        listed_until_stale = first.session(owner="carol", ttl=60.0).id
    with reopened(max_sessions_per_owner=1) as llm:
        with pytest.raises(SessionLimitError):
            llm.session(owner="alice")  # her stored session counts
        llm.session(id=kept, owner="alice").close()  # opened and closed at the limit
        llm.session(owner="alice").close()  # room again
    with sqlite3.connect(db) as raw:
        for old in (stale, also_stale):  # their last writes, 61 s ago: deleted together
            raw.execute("UPDATE sessions SET used = used - 61 WHERE id = ?", (old,))
    with reopened() as llm:
        llm.engine.call(lambda: llm.sessions.tick(time.monotonic()))  # the store's sweep, at the latest now
        with sqlite3.connect(db) as raw:
            left = {row[0] for row in raw.execute("SELECT id FROM sessions WHERE owner = 'bob'")}
            assert left == {fresh}, left
        with pytest.raises(SessionNotFoundError):
            llm.session(id=stale, owner="bob")

    # Past its TTL between two sweeps (a minute apart), a stored session held its owner's place and was
    # listed, though opening it answered 404.
    def listed(llm: LLM, owner: str) -> list[str]:
        return [s["id"] for s in llm.engine.call(lambda: owner_sessions(llm.sessions, llm.session_store, owner))]

    with reopened(max_sessions_per_owner=1) as llm:
        llm.engine.call(lambda: llm.sessions.tick(time.monotonic()))  # the start's sweep: the next is a minute away
        assert listed(llm, "bob") == [fresh] and listed(llm, "carol") == [listed_until_stale]
        with sqlite3.connect(db) as raw:
            for old in (fresh, listed_until_stale):
                raw.execute("UPDATE sessions SET used = used - 61 WHERE id = ?", (old,))
        llm.session(owner="bob").close()  # bob's one place is free
        assert listed(llm, "carol") == []
