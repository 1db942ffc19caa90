"""Pipeline parallelism (kvserve/pipeline) with two stages over gloo on this host: the same tokens as
one process (single requests, sixteen at once, a second request after the first, session turns, an
abort mid-stream, preemption in a tight pool, seeded samples), no block leaked; a stage that dies or
stops answering ends every request with a clear error and turns /health to 503, with no process
left behind; a rank started with another model file is refused; two "hosts" (two `kvserve serve`
processes, --nnodes 2) serve as one; SIGTERM on rank 0 stops every stage."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import pickle
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import torch
import torch.distributed as dist

from kvserve import LLM, EngineClosedError, EngineError, SamplingParams
from kvserve.engine.block_pool import BlockPool
from kvserve.engine.request import Request
from kvserve.engine.scheduler import ScheduledRequest, Scheduler
from kvserve.errors import InvalidRequestError
from kvserve.pipeline import deltas, wire
from kvserve.pipeline.rendezvous import PipelineError, identity, introduce
from kvserve.pipeline.topology import Topology, stage_layers
from tests.conftest import make_tiny_llama, wait_idle_and_check, write_byte_tokenizer
from tests.server_harness import descendants, free_port
from tests.test_batch_invariance import GREEDY as BUNDLED_GREEDY
from tests.test_batch_invariance import PROMPTS as BUNDLED_PROMPTS
from tests.test_batch_invariance import at_once, config, sixteen  # noqa: F401 (config: a fixture)

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
PROMPTS = ["hello there", "The quick brown fox", "zz", "a longer prompt of several words, to prefill more"]
OPTIONS = dict(dtype="float32", kv_cache_tokens=4096, progress=False)


@pytest.fixture(scope="module")
def single(tiny_model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("single") / "sessions.db"
    with LLM(str(tiny_model_dir), session_db=path, **OPTIONS) as llm:
        yield llm


@pytest.fixture(scope="module")
def piped(tiny_model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("piped") / "sessions.db"
    with LLM(str(tiny_model_dir), session_db=path, pipeline_parallel=2, **OPTIONS) as llm:
        yield llm
    assert all(p.returncode == 0 for p in llm.engine.runner.workers.values()), "a stage did not stop cleanly"


def stage_pids(llm: LLM) -> list[int]:
    return [p.pid for p in llm.engine.runner.workers.values()]


# The stall tests' stage timeout: the subject is the timeout, not its length; 3 s, not 1, so that a
# healthy stage's heartbeats (BEAT_INTERVAL apart) starved on a loaded machine are not declared a stall.
STALL_TIMEOUT = 3.0


def wait_for(condition, timeout: float = 60.0):
    """Poll until `condition()` is truthy (returned); fail after `timeout` s (a hang, not a race)."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, "the condition did not come true"
        time.sleep(0.05)
    return value


# ----- the split --------------------------------------------------------------------------------
def test_stages_split_the_layers_evenly_and_refuse_what_cannot_be_split():
    assert [stage_layers(30, 2, r) for r in range(2)] == [(0, 15), (15, 30)]
    assert [stage_layers(30, 4, r) for r in range(4)] == [(0, 8), (8, 16), (16, 23), (23, 30)]
    with pytest.raises(InvalidRequestError, match="cannot exceed the model's 2 layers"):
        stage_layers(2, 3, 0)
    with pytest.raises(InvalidRequestError, match="multiple of nnodes"):
        Topology(3, nnodes=2, master_port=1)
    assert Topology(4, nnodes=2, node_rank=1, master_port=1).local_ranks == [2, 3]


def test_the_scheduler_keeps_requests_in_flight_out_of_the_next_micro_batch():
    """Exact: with two micro-batches of two, the second takes the two requests the first did not, a
    request in flight is neither scheduled nor preempted, and its result frees it for the next."""
    scheduler = Scheduler(BlockPool(8, 4), max_num_seqs=8, max_num_batched_tokens=64, max_model_len=32)
    requests = [Request(f"r{i}", [1, 2, 3], GREEDY) for i in range(4)]
    for request in requests:
        scheduler.add_request(request)
    first = scheduler.schedule(2)
    second = scheduler.schedule(2)
    assert [s.request_id for s in first.scheduled] == ["r0", "r1"]
    assert [s.request_id for s in second.scheduled] == ["r2", "r3"]
    assert scheduler.schedule(2).is_empty  # all four in flight
    scheduler.update_from_output(first, {"r0": 7, "r1": 7})
    third = scheduler.schedule(2)
    assert [s.request_id for s in third.scheduled] == ["r0", "r1"] and not third.preempted_ids
    assert scheduler.in_flight == {requests[0], requests[1], requests[2], requests[3]}


# ----- a request's lists, sent once ---------------------------------------------------------------
def _through_the_wire(ticket, outbound, items, released=()):
    """Rank 0's plan of `items` as a later stage receives it (pickled and unpickled, as wire.send and
    wire.recv do), and its size in bytes."""
    trimmed, histories, tables = outbound.trim(items)
    plan = wire.StepPlan(ticket, trimmed, list(released), histories=histories, tables=tables)
    data = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
    return pickle.loads(data), len(data)


def test_plans_carry_a_requests_lists_once_then_only_what_is_new():
    """pipeline/deltas.py, 40 decode steps of three requests at 2,000 tokens: the first plan carries each
    block table whole, later ones a table's new blocks only (one every 16 tokens); a penalized request's
    prompt once and then its new outputs; a min_tokens request its outputs (their count), no prompt;
    another request none. So a plan's bytes do not grow with the conversations, and the later stages'
    copies give their runners each request's whole table after every plan, and the last stage (which
    samples) its whole prompt and outputs where sampling reads them."""
    penalized = SamplingParams(max_tokens=100, repetition_penalty=1.2, frequency_penalty=0.3)
    requests = [
        Request("pen", list(range(1000, 3000)), penalized),
        Request("min", list(range(2000)), SamplingParams(max_tokens=100, min_tokens=50)),
        Request("plain", list(range(2000)), SamplingParams(max_tokens=100)),
    ]
    scheduler = Scheduler(BlockPool(600, 16), 8, 8192, 4096)
    for request in requests:
        scheduler.add_request(request)
    outbound, middle, last = deltas.Outbound(), deltas.Mirror(histories=False), deltas.Mirror(histories=True)
    sizes = []
    for step in range(40):
        out = scheduler.schedule()
        plan, size = _through_the_wire(step, outbound, out.scheduled)
        sizes.append(size)
        scheduled = {item.request_id: item for item in out.scheduled}
        for stage in (middle, last):
            items = {item.request_id: item for item in stage.apply(plan.items, plan.histories, plan.tables)}
            for request in requests:
                assert items[request.request_id].block_ids == request.block_ids
                assert items[request.request_id].token_ids == scheduled[request.request_id].token_ids
            if stage is middle:  # it does not sample
                assert all(item.prompt_token_ids == item.output_token_ids == [] for item in items.values())
        assert (items["pen"].prompt_token_ids, items["pen"].output_token_ids) == (
            requests[0].prompt_token_ids,
            requests[0].output_token_ids,
        )
        assert (items["min"].prompt_token_ids, items["min"].output_token_ids) == ([], requests[1].output_token_ids)
        assert (items["plain"].prompt_token_ids, items["plain"].output_token_ids) == ([], [])
        if step:  # decode: a token each, and a table's new block at most
            assert all(len(item.block_ids) <= 1 and len(item.token_ids) == 1 for item in plan.items)
        scheduler.update_from_output(out, {r.request_id: 7 + step for r in requests})
    assert sizes[0] > 20_000 and max(sizes[1:]) < 1500 and max(sizes[1:]) - min(sizes[1:]) < 32, sizes
    assert middle.num_requests == last.num_requests == 3


def test_a_new_table_goes_whole_a_released_id_starts_whole_and_a_lost_plan_is_an_error():
    """A table that is not the last plan's with blocks added (a preempted request's new blocks) travels
    whole. A finished request's id that comes back for a new request: its first plan carries its own
    prompt, after the release that travels with it. A plan that does not continue a stage's copies (one
    lost or out of order) raises rather than run on the wrong blocks or penalize from the wrong history,
    and leaves the other requests' copies up to date."""
    outbound, mirror = deltas.Outbound(), deltas.Mirror(histories=True)
    penalized = SamplingParams(max_tokens=10, presence_penalty=0.5)

    def item(request_id, prompt, outputs, table):
        return ScheduledRequest(request_id, [1], len(prompt), table, True, penalized, prompt, outputs)

    def step(ticket, items, released=()):
        plan, _ = _through_the_wire(ticket, outbound, items, released)
        mirror.release(plan.released)
        return plan, mirror.apply(plan.items, plan.histories, plan.tables)

    _, whole = step(0, [item("r", [1, 2, 3], [], [10])])
    plan, whole = step(1, [item("r", [1, 2, 3], [4], [10, 11])])
    assert plan.items[0].block_ids == [11] and plan.tables == {"r": 1} and whole[0].block_ids == [10, 11]
    plan, whole = step(2, [item("r", [1, 2, 3], [4, 5], [12])])  # preempted: other blocks
    assert plan.items[0].block_ids == [12] and plan.tables == {} and whole[0].block_ids == [12]
    outbound.release(["r"])
    plan, whole = step(3, [item("r", [7, 8], [9], [20])], released=["r"])
    assert plan.histories == {"r": (0, [7, 8])}
    assert (whole[0].prompt_token_ids, whole[0].output_token_ids) == ([7, 8], [9])
    lost, _ = _through_the_wire(4, outbound, [item("r", [7, 8], [9, 10], [20, 21])])
    later, _ = _through_the_wire(5, outbound, [item("r", [7, 8], [9, 10, 11], [20, 21]), item("s", [1], [], [30])])
    with pytest.raises(RuntimeError, match=r"copies: request r's block table \(2 blocks kept, 1 held\)$"):
        mirror.apply(later.items, later.histories, later.tables)
    assert mirror.num_requests == 2  # s's copy made all the same
    whole = mirror.apply(lost.items, lost.histories, lost.tables)  # r's copies are still as of plan 3
    assert (whole[0].block_ids, whole[0].output_token_ids) == ([20, 21], [9, 10])


# ----- the same tokens ----------------------------------------------------------------------------
def test_greedy_seeded_and_penalized_requests_equal_one_process(single, piped):
    params = [
        GREEDY,
        SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.7, seed=5, repetition_penalty=1.3, presence_penalty=0.5),
        SamplingParams(max_tokens=24, temperature=0, min_tokens=20, logprobs=3),
    ]
    for prompt, p in zip(PROMPTS, params, strict=True):
        want, got = single.generate(prompt, p), piped.generate(prompt, p)
        assert got.token_ids == want.token_ids and got.text == want.text
        assert got.logprobs == want.logprobs
    wait_idle_and_check(piped)


def test_sixteen_penalized_or_min_tokens_requests_at_once_equal_one_process(single, piped):
    """Their histories reach the last stage once, then only new outputs (pipeline/deltas.py): sixteen at
    once, seeded with penalties or greedy held to min_tokens, each gives its one-process tokens; once
    they are done the stages hold no copies for them."""
    params = [
        SamplingParams(max_tokens=24, temperature=0.7, seed=i, repetition_penalty=1.3, frequency_penalty=0.4)
        if i % 2
        else SamplingParams(max_tokens=24, temperature=0, min_tokens=20)
        for i in range(16)
    ]
    prompts = [f"{i}: {p}" for i, p in enumerate(sixteen(PROMPTS))]
    want = [single.generate(p, q).token_ids for p, q in zip(prompts, params, strict=True)]
    assert at_once(piped, prompts, params) == want
    wait_idle_and_check(piped)
    assert piped.engine.runner._deltas.num_requests == 0


def test_a_prefill_only_request_leaves_no_copies_behind(piped):
    """A session's eager prefill computes a prompt's KV and finishes without sampling: released like any
    finished request, so neither rank 0 nor the stages keep its block table (sessions make one per
    streamed prompt)."""
    prefill = Request("eager", [65] * 40, SamplingParams(max_tokens=1, temperature=0), prefill_only=True)
    piped.engine.call(lambda: piped.engine.admit(prefill, None))
    wait_idle_and_check(piped)
    assert prefill.is_finished and piped.engine.runner._deltas.num_requests == 0


def test_sixteen_at_once_and_a_second_longer_request_equal_their_solo_runs(single, piped):
    solo = [single.generate(p, GREEDY).token_ids for p in PROMPTS]
    assert at_once(piped, sixteen(PROMPTS), [GREEDY] * 16) == sixteen(solo)
    # R2: back to back, a longer prompt after a short one, with nothing reset in between
    short, long = piped.generate("zz", GREEDY), piped.generate(PROMPTS[3] * 3, GREEDY)
    assert (short.token_ids, long.token_ids) == (solo[2], single.generate(PROMPTS[3] * 3, GREEDY).token_ids)
    wait_idle_and_check(piped)


def test_micro_batches_split_the_running_requests_between_the_stages(piped):
    """With eight requests and two stages, every step takes at most four (the other four are in flight
    or go next): each stage has a micro-batch to work on."""
    runner = piped.engine.runner
    sizes: list[int] = []
    execute = type(runner).execute.__get__(runner)

    def recording(out, *args):
        sizes.append(len(out.scheduled))
        return execute(out, *args)

    runner.execute = recording
    try:
        piped.generate(sixteen(PROMPTS)[:8], GREEDY)  # one call: all eight in the engine from its first steps
    finally:
        del runner.execute
    assert max(sizes) <= 4 and sizes.count(4) >= GREEDY.max_tokens
    wait_idle_and_check(piped)


def test_session_turns_equal_one_process(single, piped):
    replies = []
    for llm in (single, piped):
        with llm.session(system="be brief") as session:
            turns = []
            for text in ("hi", "tell me more", "and then?"):
                session.add_message("user", text)
                turns.append(session.generate(GREEDY))
            replies.append([(t.token_ids, t.usage.cached_tokens) for t in turns])
        wait_idle_and_check(llm)
    assert replies[1] == replies[0] and replies[1][2][1] > 0  # later turns reuse the session's blocks


def test_an_abort_mid_stream_frees_every_block_on_every_stage(single, piped):
    params = SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)
    for i, _ in enumerate(piped.stream(PROMPTS[1], params)):
        if i == 3:
            break  # leaving the stream aborts the request at the next step boundary
    wait_idle_and_check(piped)
    assert piped.stats()["num_aborted_total"] >= 1
    assert piped.generate(PROMPTS[1], GREEDY).token_ids == single.generate(PROMPTS[1], GREEDY).token_ids


def test_preemption_in_a_tight_pool_leaves_outputs_unchanged(tiny_model_dir, single):
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    options = {**OPTIONS, "kv_cache_tokens": 128, "block_size": 8}
    with LLM(str(tiny_model_dir), session_db=False, pipeline_parallel=2, **options) as tight:
        outputs = at_once(tight, sixteen(PROMPTS)[:8], [params] * 8)
        assert tight.stats()["num_preemptions_total"] > 0, "the pool was not tight enough to preempt"
        wait_idle_and_check(tight)
    assert outputs == [single.generate(p, params).token_ids for p in sixteen(PROMPTS)[:8]]


@pytest.mark.bundled
def test_two_stages_give_the_same_bits_in_every_batch_invariant_configuration(config):  # noqa: F811
    """The bundled model in each configuration tests/test_batch_invariance.py covers (bfloat16 and
    float32, int8 activations, a float16 cache): sixteen at once over two stages equal their solo runs
    in one process, bit for bit."""
    with LLM(config["gguf"], session_db=False, pipeline_parallel=2, **config["options"]) as piped:
        assert at_once(piped, sixteen(BUNDLED_PROMPTS), [BUNDLED_GREEDY] * 16) == sixteen(config["solo"])
        wait_idle_and_check(piped)


# ----- faults -------------------------------------------------------------------------------------
def test_a_stage_that_dies_fails_every_request_and_the_engine_says_why(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), session_db=False, pipeline_parallel=2, **OPTIONS)
    stream = llm.stream(PROMPTS[0], SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True))
    next(stream)
    (pid,) = stage_pids(llm)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(EngineError, match=f"pipeline stage 1 \\(pid {pid}\\) exited with code -9"):
        for _ in stream:
            pass
    assert "pipeline stage 1" in llm.problem()
    with pytest.raises(EngineClosedError, match="pipeline stage 1"):
        llm.generate("hi", GREEDY)
    llm.close()
    assert all(p.returncode is not None for p in llm.engine.runner.workers.values())


def test_a_stage_that_stops_answering_is_declared_gone_and_stopped(tiny_model_dir):
    topology = Topology(2, stage_timeout=STALL_TIMEOUT)
    llm = LLM(str(tiny_model_dir), session_db=False, pipeline=topology, **OPTIONS)
    (pid,) = stage_pids(llm)
    os.kill(pid, signal.SIGSTOP)  # alive, but computing nothing and beating no more
    try:
        reason = wait_for(llm.problem)
        assert "pipeline stage 1 stopped answering" in reason
        with pytest.raises(EngineClosedError):
            llm.generate("hi", GREEDY)
        llm.close()  # kills the stopped stage: nothing lingers
        assert all(p.returncode == -signal.SIGKILL for p in llm.engine.runner.workers.values())
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_stage_stopped_mid_stream_ends_every_stream_with_an_error(tiny_model_dir):
    """Issue 33 (1): with requests running, rank 0's engine thread waits on a send to the stopped stage
    (gloo's send completes only once the peer posts its receive), so it must not be the thread that
    has to hear of the stall: every stream ends with an error, and new requests are refused."""
    topology = Topology(2, stage_timeout=STALL_TIMEOUT)
    llm = LLM(str(tiny_model_dir), session_db=False, pipeline=topology, **OPTIONS)
    (pid,) = stage_pids(llm)
    long = SamplingParams(max_tokens=900, temperature=0, ignore_eos=True)
    streams = [llm.stream(p, long) for p in PROMPTS]
    for stream in streams:
        next(stream)  # running: each has its first token
    os.kill(pid, signal.SIGSTOP)
    errors: list[BaseException] = []

    def drain(stream) -> None:
        try:
            for _ in stream:
                pass
        except BaseException as exc:
            errors.append(exc)

    readers = [threading.Thread(target=drain, args=(s,), daemon=True) for s in streams]
    try:
        for reader in readers:
            reader.start()
        deadline = time.monotonic() + 60  # a hang guard, not a timing: the streams end at the watchdog's verdict
        for reader in readers:
            reader.join(max(0.0, deadline - time.monotonic()))
        assert not any(r.is_alive() for r in readers), "a stream still hangs behind the stopped stage"
        assert len(errors) == len(streams)
        assert all(isinstance(e, EngineError) and "stopped answering" in str(e) for e in errors), errors
        assert "pipeline stage 1 stopped answering" in llm.problem()
        with pytest.raises(EngineClosedError):
            llm.generate("hi", GREEDY)
        llm.close()
        assert all(p.returncode == -signal.SIGKILL for p in llm.engine.runner.workers.values())
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# ----- two hosts (two processes standing for them) ------------------------------------------------
def _node(model, port: int, *flags: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "kvserve.cli", "serve", "--model", str(model), "--dtype", "float32"]
    command += ["--pipeline-parallel", "2", "--nnodes", "2", "--node-rank", "1", "--master-port", str(port), *flags]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def test_two_nodes_serve_as_one_and_rank_0_stops_both(tiny_model_dir, single):
    port = free_port()
    node1 = _node(tiny_model_dir, port)
    try:
        topology = Topology(2, nnodes=2, node_rank=0, master_port=port)
        with LLM(str(tiny_model_dir), session_db=False, pipeline=topology, **OPTIONS) as llm:
            assert llm.engine.runner.workers == {}  # rank 1 is the other node's
            assert [llm.generate(p, GREEDY).token_ids for p in PROMPTS] == [
                single.generate(p, GREEDY).token_ids for p in PROMPTS
            ]
        assert node1.wait(30) == 0  # the shutdown went down the pipeline
    finally:
        node1.kill()


def test_a_rank_started_with_another_model_file_is_refused(tiny_model_dir, tmp_path):
    other = tmp_path / "other"
    make_tiny_llama(other, seed=7, max_position_embeddings=1024)
    write_byte_tokenizer(other)
    port = free_port()
    node1 = _node(other, port)
    try:
        topology = Topology(2, nnodes=2, node_rank=0, master_port=port)
        with pytest.raises(PipelineError, match=r"rank 1 .* was started differently .* model file"):
            LLM(str(tiny_model_dir), session_db=False, pipeline=topology, **OPTIONS)
        assert node1.wait(30) == 2
        assert "refused" in node1.stderr.read()
    finally:
        node1.kill()


def test_rank_0_refuses_another_kvserve_version_or_settings_and_names_them(tiny_model_dir):
    """Exact: the meeting's verdict, both sides, on an in-process store (the version cannot be changed
    in a real second process short of installing another kvserve)."""
    ours = identity(0, tiny_model_dir, {"stages": 2, "dtype": torch.float32})
    theirs = dataclasses.replace(
        identity(1, tiny_model_dir, {"stages": 2, "dtype": torch.bfloat16}), version="0.0.1-other"
    )
    for other, refused in [(dataclasses.replace(ours, rank=1), False), (theirs, True)]:
        store, answers = dist.HashStore(), {}

        def meet(who, store=store, answers=answers):
            try:
                introduce(store, who, 2)
                answers[who.rank] = "ok"
            except PipelineError as exc:
                answers[who.rank] = str(exc)

        threads = [threading.Thread(target=meet, args=(who,)) for who in (ours, other)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        if not refused:
            assert answers == {0: "ok", 1: "ok"}
            continue
        assert "kvserve version '0.0.1-other' where rank 0 has" in answers[0]
        assert "dtype 'torch.bfloat16' where rank 0 has 'torch.float32'" in answers[0]
        assert answers[1].startswith("Rank 0 refused this rank: rank 1")
        assert "model file '" not in answers[0]  # the same file is not named as a difference


# ----- the server -----------------------------------------------------------------------------------
def test_serve_with_two_stages_answers_and_sigterm_stops_every_stage(tiny_model_dir, single, tmp_path):
    port = free_port()
    env = {**os.environ, "KVSERVE_SESSION_DB": str(tmp_path / "sessions.db")}
    command = [sys.executable, "-m", "kvserve.cli", "serve", "--model", str(tiny_model_dir), "--dtype", "float32"]
    command += [
        "--port",
        str(port),
        "--served-model-name",
        "tiny",
        "--pipeline-parallel",
        "2",
        "--log-level",
        "warning",
    ]
    server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _healthy(base))
        stages = wait_for(lambda: descendants(server.pid, b"pipeline.worker"))
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        greedy = dict(model="tiny", temperature=0, max_tokens=24, extra_body={"ignore_eos": True})
        batch = client.completions.create(prompt=PROMPTS, **greedy)
        assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == [
            single.generate(p, GREEDY).text for p in PROMPTS
        ]
        server.send_signal(signal.SIGTERM)
        assert server.wait(60) == 0
        assert not [pid for pid in stages if _alive(pid)], "a pipeline stage outlived the server"
    finally:
        server.kill()


def _healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.parametrize("engine_process", ["off", "on"])
def test_serve_exits_1_when_a_stage_dies_and_says_which(tiny_model_dir, tmp_path, engine_process):
    """A lost stage stops the engine for good, and the server exits with status 1 for a supervisor,
    saying why: with `--engine-process off` it did not exit at all, and with the engine in a process of
    its own its reason was "the engine process exited with code 0"."""
    port = free_port()
    env = {**os.environ, "KVSERVE_SESSION_DB": str(tmp_path / "sessions.db")}
    command = [sys.executable, "-m", "kvserve.cli", "serve", "--model", str(tiny_model_dir), "--dtype", "float32"]
    command += ["--port", str(port), "--pipeline-parallel", "2", "--engine-process", engine_process]
    command += ["--log-level", "warning"]
    server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: _healthy(f"http://127.0.0.1:{port}"))
        (stage,) = wait_for(lambda: descendants(server.pid, b"pipeline.worker"))
        os.kill(stage, signal.SIGKILL)
        assert server.wait(60) == 1
        (fatal,) = [line for line in server.stderr.read().splitlines() if "the server exits with status 1" in line]
        assert "pipeline stage 1" in fatal, fatal
    finally:
        server.kill()


def test_a_stage_whose_rank_0_is_stopped_exits(tiny_model_dir, tmp_path):
    """Rank 0's process stopped (SIGSTOP) keeps the store the stages' watchdogs ask: each call waited
    ten minutes (the store's meeting timeout), so a stage outlived its engine. Now a store that does
    not answer within the stage timeout counts as rank 0 gone, and the stage exits."""
    script = (
        "import sys, time\n"
        "from kvserve import LLM\n"
        f"llm = LLM({str(tiny_model_dir)!r}, pipeline_parallel=2, session_db=False, **{OPTIONS!r})\n"
        "print('ready', flush=True)\n"
        "time.sleep(600)\n"
    )
    rank0 = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert rank0.stdout.readline().strip() == "ready"
        (stage,) = descendants(rank0.pid, b"pipeline.worker")
        os.kill(rank0.pid, signal.SIGSTOP)
        wait_for(lambda: not _running(stage))  # within the stage timeout (5 s), not the store's 10 minutes
    finally:
        rank0.kill()
        rank0.wait(30)


def _running(pid: int) -> bool:
    """Alive and not a zombie (a stopped parent does not reap its exited child)."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
