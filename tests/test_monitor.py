"""The engine's status monitor (engine/monitor.py) on a tiny random Llama: each request's lifecycle
events in order, exact block ids on the block map, shared blocks after a fork, preemptions and
evictions as events. The engine is held at known points by a StepGate; every test ends with the
pool checked."""

from __future__ import annotations

import threading

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.monitor import CACHED, FREE, HOLDER_BASE, build_view
from tests.conftest import StepGate, wait_idle_and_check

pytest.importorskip("transformers")

BLOCK = 16


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    with LLM(str(tiny_model_dir), dtype="float32", kv_cache_tokens=64 * BLOCK, session_db=False, progress=False) as llm:
        yield llm


@pytest.fixture(autouse=True)
def pool_checked(llm):
    yield
    wait_idle_and_check(llm, pinned=sum(len(s.pinned_block_ids) for s in llm.sessions.sessions.values()))


def blocks_of(view: dict) -> dict[str, list[int]]:
    """Block ids by holder id (a shared block under each of its holders), from the run-length map."""
    by_holder: dict[str, list[int]] = {}
    block_id = 0
    for code, count in view["map"]:
        if code >= HOLDER_BASE:
            holder = view["holders"][code - HOLDER_BASE]
            members = [view["holders"][i] for i in holder["members"]] if holder["kind"] == "shared" else [holder]
            for member in members:
                by_holder.setdefault(member["id"], []).extend(range(block_id, block_id + count))
        block_id += count
    return by_holder


def kinds(llm: LLM, request_id: str) -> list[str]:
    return [e["kind"] for e in llm.monitor.read()["events"] if e["request_id"] == request_id]


def held_blocks(llm: LLM) -> dict[str, list[int]]:
    """Each request's blocks, read while the engine waits at a StepGate (it changes nothing meanwhile)."""
    return {rid: list(r.block_ids) for rid, r in llm.engine.scheduler.requests.items()}


@pytest.fixture(autouse=True)
def watched(llm):
    """A reader watching for the whole test: the engine copies its state at the end of each turn that
    logged an event, so a read while a StepGate holds a step returns the state that step started from."""
    llm.monitor.read(watch_s=600)
    yield
    llm.monitor.read(watch_s=0)


def test_a_requests_lifecycle_is_queued_scheduled_first_token_finished_freed(llm):
    prompt = list(range(10, 10 + 40))  # 40 tokens: 3 blocks, then 24 more tokens: 63 computed, 4 blocks
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    with StepGate(llm) as gate:
        reader = threading.Thread(target=lambda: list(llm.stream(prompt, params, request_id="life")))
        reader.start()
        assert gate.entered.wait(30)
        gate.step()  # the prompt's step ran (and its turn ended); the engine waits before the second
        status = llm.monitor.statuses(["life"])["life"]
        assert status["state"] == "decoding" and status["num_output_tokens"] == 1
        assert status["kv_blocks"] == 3 and status["timings"]["ttft_s"] is not None
        view = build_view(llm.monitor.read())
        assert blocks_of(view) == held_blocks(llm) and len(held_blocks(llm)["life"]) == 3
        assert view["running"] == ["life"] and view["waiting"] == []
        gate.open()
        reader.join(30)
    status = llm.monitor.statuses(["life"])["life"]
    assert status["state"] == "finished" and status["finish_reason"] == "length"
    assert status["num_output_tokens"] == 24 and status["kv_blocks"] == 0
    assert status["max_tokens"] == 24  # kept once it ends (the page shows 24/24, not 24)
    assert status["num_blocks_freed"] == 4  # ceil(63 / 16): all back to the pool (cached or free)
    assert kinds(llm, "life") == ["queued", "scheduled", "first_token", "finished", "freed"]
    freed = next(e for e in llm.monitor.read()["events"] if e["request_id"] == "life" and e["kind"] == "freed")
    assert (freed["num_blocks"], freed["num_kept"]) == (4, 0)
    view = build_view(llm.monitor.read())
    assert "life" not in blocks_of(view)
    assert {code for code, _ in view["map"]} <= {FREE, CACHED}


def test_an_aborted_request_ends_aborted_and_its_blocks_go_back(llm):
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    chunks = []
    with StepGate(llm) as gate:
        reader = threading.Thread(
            target=lambda: chunks.extend(llm.stream(list(range(20, 60)), params, request_id="gone"))
        )
        reader.start()
        assert gate.entered.wait(30)
        gate.step()
        assert blocks_of(build_view(llm.monitor.read()))["gone"] == held_blocks(llm)["gone"]
        llm.abort("gone")
        gate.open()
        reader.join(30)
    assert chunks[-1].finish_reason == "abort"
    wait_idle_and_check(llm)
    status = llm.monitor.statuses(["gone"])["gone"]
    assert status["state"] == "aborted" and status["num_blocks_freed"] == 3
    assert kinds(llm, "gone")[-2:] == ["finished", "freed"]


def test_a_fork_shares_its_parents_blocks_on_the_map(llm):
    session = llm.session(system="You are terse.")
    session.add_message("user", "Tell me about caches, please, in some detail.")
    list(session.stream(SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)))
    child = session.fork()
    pinned = {s.session_id: list(s.pinned_block_ids) for s in llm.sessions.sessions.values()}
    assert pinned[session.id] and pinned[child.id] == pinned[session.id]
    view = build_view(llm.monitor.read())
    shared = [h for h in view["holders"] if h["kind"] == "shared"]
    assert [{view["holders"][i]["id"] for i in h["members"]} for h in shared] == [{session.id, child.id}]
    assert blocks_of(view) == {session.id: pinned[session.id], child.id: pinned[session.id]}
    assert {s["id"]: s["kv_blocks"] for s in view["sessions"]} == {
        session.id: len(pinned[session.id]),
        child.id: len(pinned[session.id]),
    }
    child.close()
    session.close()


def test_preemptions_and_evictions_are_events(tiny_model_dir):
    # 8 blocks: two requests of 40 + 60 tokens (7 blocks each at the end) cannot both hold theirs.
    with LLM(
        str(tiny_model_dir), dtype="float32", kv_cache_tokens=8 * BLOCK, session_db=False, progress=False
    ) as small:
        params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
        # One call, so both are in the engine at once (from two threads, a late second one found the
        # first's blocks taken and waited for its end: no preemption).
        small.generate([list(range(i, i + 40)) for i in (1, 100)], params)
        wait_idle_and_check(small)
        state = small.monitor.read()
        preempted = [e for e in state["events"] if e["kind"] == "preempted"]
        assert len(preempted) == state["counters"]["num_preemptions_total"] > 0
        statuses = small.monitor.statuses([e["request_id"] for e in preempted])
        assert sum(s["num_preemptions"] for s in statuses.values()) == len(preempted)
        evicted = sum(e["num_blocks"] for e in state["events"] if e["kind"] == "evicted")
        assert evicted == state["counters"]["num_evictions_total"] > 0  # cached blocks reused for new work


def test_the_first_read_after_nobody_watched_shows_now_not_the_last_watch(tiny_model_dir):
    """While nobody watches, a busy engine copies nothing; the copy a new reader got was the one of
    the last watch (a viewer of /v1/engine/events saw a request that had ended minutes before, and
    not the one running). That first read now waits for the step boundary and shows this moment, and
    so does a second reader arriving with it."""
    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    with LLM(str(tiny_model_dir), dtype="float32", kv_cache_tokens=64 * BLOCK, session_db=False, progress=False) as own:
        inbox = own.engine.inbox

        def read_between_steps(gate: StepGate, readers: int = 1) -> list[dict]:
            reads: list[dict] = []
            threads = [
                threading.Thread(target=lambda: reads.append(own.monitor.read(watch_s=600))) for _ in range(readers)
            ]
            for reader in threads:  # each reader in turn has asked the engine, or has its answer
                queued = inbox.qsize()
                reader.start()
                while reader.is_alive() and inbox.qsize() == queued:
                    reader.join(0.001)
            while any(reader.is_alive() for reader in threads):  # answered at a step boundary
                gate.step()
                threads[0].join(0.01)
            return reads

        def switch_unwatched(gate: StepGate, stream: threading.Thread, request_id: str, earlier: str) -> None:
            gate.step()  # watched: the engine copies its state at the end of this turn
            own.monitor._watched_until = 0.0  # the watch is over (as 8 s without a reader would end it)
            own.abort(earlier)
            stream.start()
            while request_id not in own.engine.scheduler.requests:  # read while the gate holds the engine
                gate.step()

        ids = ("earlier", "now", "later")
        streams = [threading.Thread(target=lambda i=i: list(own.stream([5, 6, 7], params, request_id=i))) for i in ids]
        with StepGate(own) as gate:
            streams[0].start()
            assert gate.entered.wait(30)
            assert [read["running"] for read in read_between_steps(gate)] == [["earlier"]]
            switch_unwatched(gate, streams[1], "now", "earlier")
            assert [read["running"] for read in read_between_steps(gate)] == [["now"]]
            switch_unwatched(gate, streams[2], "later", "now")
            assert [read["running"] for read in read_between_steps(gate, readers=2)] == [["later"], ["later"]]
            own.abort("later")
            gate.open()
        for stream in streams:
            stream.join(60)
        wait_idle_and_check(own)
