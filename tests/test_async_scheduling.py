"""Async scheduling: the engine queues step n+1 before it takes back step n, a request's next token read
on the device (engine/core.py, engine/scheduler.py's steps ahead, engine/model_runner.py's token slots).

The scheduler's bookkeeping is checked alone, with exact block ids. Through the engine the GPU path runs
on a CPU (KVSERVE_KERNELS=triton, Triton's interpreter, the CUDA graphs' bookkeeping), where each
request's tokens and logprobs must equal those of the same engine without async scheduling: greedy,
seeded, logprobs, penalties, min_tokens, stop tokens and strings, aborts and preemption; and no KV block
may leak. On a GPU (bench/gpu.py runs this file there) the same tests run where the device really runs
ahead.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kvserve.engine.block_pool import BlockPool
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.scheduler import AHEAD, Scheduler
from kvserve.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def _scheduler(num_blocks: int = 8, block_size: int = 4, budget: int = 64) -> Scheduler:
    scheduler = Scheduler(BlockPool(num_blocks, block_size, True), 8, budget, 64)
    scheduler.run_ahead = True
    return scheduler


def _request(request_id: str, prompt: list[int], params: SamplingParams = GREEDY) -> Request:
    return Request(request_id, prompt, params, eos_token_ids=(0,))


def test_a_request_goes_ahead_of_its_sampling_step_at_the_pending_tokens_position():
    scheduler = _scheduler()
    request = _request("a", [5, 6, 7, 8, 9])
    scheduler.add_request(request)
    prefill = scheduler.schedule()
    assert [(s.token_ids, s.num_computed_tokens, s.block_ids, s.sample) for s in prefill.scheduled] == [
        ([5, 6, 7, 8, 9], 0, [0, 1], True)
    ]
    first_ahead = scheduler.schedule()  # the prefill samples token 5's slot: position 5 is in block 1
    assert [(s.token_ids, s.num_computed_tokens, s.block_ids, s.ahead) for s in first_ahead.scheduled] == [
        ([AHEAD], 5, [0, 1], True)
    ]
    assert scheduler.schedule().is_empty  # two steps in flight: nothing more
    assert scheduler.update_from_output(prefill, {"a": 11}) == [request]
    assert request.output_token_ids == [11] and request.num_computed_tokens == 5
    assert request in scheduler.in_flight  # its step ahead still computes
    second_ahead = scheduler.schedule()  # position 6 (token 11 at 5 is being computed)
    assert [(s.token_ids, s.num_computed_tokens, s.block_ids) for s in second_ahead.scheduled] == [([AHEAD], 6, [0, 1])]
    scheduler.update_from_output(first_ahead, {"a": 12})
    assert request.output_token_ids == [11, 12] and request.num_computed_tokens == 6
    third_ahead = scheduler.schedule()
    assert [(s.num_computed_tokens, s.block_ids) for s in third_ahead.scheduled] == [(7, [0, 1])]
    scheduler.update_from_output(second_ahead, {"a": 13})
    fourth_ahead = scheduler.schedule()  # position 8 opens block 2
    assert [(s.num_computed_tokens, s.block_ids) for s in fourth_ahead.scheduled] == [(8, [0, 1, 2])]
    scheduler.update_from_output(third_ahead, {"a": 14})
    fifth_ahead = scheduler.schedule()  # it samples the 6th token of 6
    assert [(s.num_computed_tokens, s.block_ids) for s in fifth_ahead.scheduled] == [(9, [0, 1, 2])]
    scheduler.update_from_output(fourth_ahead, {"a": 15})
    assert scheduler.schedule().is_empty and not scheduler.has_ready_work  # the token in flight is the last
    scheduler.update_from_output(fifth_ahead, {"a": 16})
    assert request.status == RequestStatus.FINISHED_LENGTH and request.output_token_ids == [11, 12, 13, 14, 15, 16]
    assert scheduler.pool.num_used_blocks == 0 and not scheduler.in_flight and not scheduler.ahead


def test_a_stop_drops_the_step_ahead_and_frees_the_blocks_at_once():
    scheduler = _scheduler()
    request = _request("a", [5, 6, 7, 8], SamplingParams(max_tokens=6, temperature=0))
    scheduler.add_request(request)
    prefill = scheduler.schedule()
    ahead = scheduler.schedule()
    assert ahead.scheduled[0].block_ids == [0, 1]  # position 4 needs a second block
    scheduler.update_from_output(prefill, {"a": 0})  # EOS
    assert request.status == RequestStatus.FINISHED_STOPPED and scheduler.pool.num_used_blocks == 0
    assert scheduler.update_from_output(ahead, {"a": 9}) == []  # computed, dropped
    assert request.output_token_ids == [0] and not scheduler.in_flight and not scheduler.ahead


def test_no_step_ahead_where_the_pending_token_matters_on_the_host():
    for params in (
        SamplingParams(max_tokens=6, temperature=0, repetition_penalty=1.2),
        SamplingParams(max_tokens=6, temperature=0, frequency_penalty=0.5),
        SamplingParams(max_tokens=6, temperature=0, min_tokens=3),
        SamplingParams(max_tokens=1, temperature=0),  # its pending token is its last
    ):
        scheduler = _scheduler()
        scheduler.add_request(_request("a", [5, 6, 7], params))
        scheduler.schedule()
        assert scheduler.schedule().is_empty, params
        assert not scheduler.has_ready_work


def test_requests_go_ahead_only_when_every_one_in_flight_can():
    """One that must wait for its token on the host would be left out of every other step."""
    scheduler = _scheduler()
    scheduler.add_request(_request("greedy", [5, 6, 7]))
    scheduler.add_request(_request("penalized", [5, 6, 8], SamplingParams(max_tokens=6, repetition_penalty=1.2)))
    both = scheduler.schedule()
    assert scheduler.schedule().is_empty
    scheduler.update_from_output(both, {"greedy": 3, "penalized": 4})
    again = scheduler.schedule()
    assert [(s.request_id, s.ahead) for s in again.scheduled] == [("greedy", False), ("penalized", False)]


def test_a_step_ahead_takes_only_free_blocks_and_never_preempts():
    scheduler = _scheduler(num_blocks=2, block_size=4)
    scheduler.add_request(_request("a", [1, 2, 3, 4]))
    scheduler.add_request(_request("b", [5, 6, 7, 8]))
    both = scheduler.schedule()
    assert [s.block_ids for s in both.scheduled] == [[0], [1]]
    # each step ahead needs a second block and none is free: nothing, and nobody preempted
    assert scheduler.schedule().is_empty and scheduler.stats.num_preemptions_total == 0
    scheduler.update_from_output(both, {"a": 3, "b": 4})
    assert scheduler.pool.num_used_blocks == 2


def test_a_short_pool_stops_every_step_ahead_so_preemption_takes_the_newest():
    """Request "a" needs a block for its step ahead and none is free: if "b" went ahead alone, "a" would find
    every other request in flight and preempt itself. Nobody goes ahead; then "a" preempts "b", the
    newest, as the scheduler does without async scheduling."""
    scheduler = _scheduler(num_blocks=2, block_size=4)
    scheduler.add_request(_request("a", [1, 2, 3, 4]))
    scheduler.add_request(_request("b", [5, 6, 7]))  # its step ahead, at position 3, fits its block
    both = scheduler.schedule()
    assert [s.block_ids for s in both.scheduled] == [[0], [1]]
    assert scheduler.schedule().is_empty and not scheduler.has_ready_work
    scheduler.update_from_output(both, {"a": 3, "b": 4})
    after = scheduler.schedule()
    assert after.preempted_ids == ["b"]
    assert [(s.request_id, s.token_ids, s.block_ids, s.ahead) for s in after.scheduled] == [("a", [3], [0, 1], False)]
    assert scheduler.requests["b"].status == RequestStatus.PREEMPTED and scheduler.pool.num_used_blocks == 2


def test_a_prompts_next_chunk_goes_ahead_beside_a_decode_step_ahead():
    """A chunk of a prompt in flight no longer holds the others in turn: the next chunk, whose tokens the
    host knows, goes ahead past it beside the decoding request's step ahead; the last chunk samples, and
    the step ahead of it reads its token on the device."""
    scheduler = _scheduler(budget=6)
    decoding = _request("b", [5, 6, 7])
    chunked = _request("a", list(range(10, 22)))  # 12 prompt tokens: chunks of 3, 5, then 4
    scheduler.add_request(decoding)
    scheduler.add_request(chunked)
    first = scheduler.schedule()
    assert [(s.request_id, s.token_ids, s.num_computed_tokens, s.block_ids, s.sample) for s in first.scheduled] == [
        ("b", [5, 6, 7], 0, [0], True),
        ("a", [10, 11, 12], 0, [1], False),
    ]
    second = scheduler.schedule()  # before: nothing, while a's chunk was in flight
    assert [
        (s.request_id, s.token_ids, s.num_computed_tokens, s.block_ids, s.sample, s.ahead) for s in second.scheduled
    ] == [
        ("b", [AHEAD], 3, [0], True, True),
        ("a", [13, 14, 15, 16, 17], 3, [1, 2], False, False),
    ]
    assert scheduler.schedule().is_empty  # each in flight twice
    scheduler.update_from_output(first, {"b": 30})
    assert chunked.num_computed_tokens == 3 and chunked in scheduler.in_flight
    third = scheduler.schedule()
    assert [(s.request_id, s.token_ids, s.num_computed_tokens, s.block_ids, s.sample) for s in third.scheduled] == [
        ("b", [AHEAD], 4, [0, 3], True),
        ("a", [18, 19, 20, 21], 8, [1, 2, 4], True),
    ]
    scheduler.update_from_output(second, {"b": 31})
    fourth = scheduler.schedule()  # a's last chunk samples: its next token comes from the device
    assert [(s.request_id, s.token_ids, s.num_computed_tokens, s.block_ids, s.ahead) for s in fourth.scheduled] == [
        ("b", [AHEAD], 5, [0, 3], True),
        ("a", [AHEAD], 12, [1, 2, 4, 5], True),  # position 12 opens a fourth block
    ]
    scheduler.update_from_output(third, {"b": 32, "a": 40})
    assert chunked.num_computed_tokens == 12 and chunked.output_token_ids == [40]
    for request in (decoding, chunked):
        scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
    assert scheduler.pool.num_used_blocks == 0 and not scheduler.in_flight and not scheduler.tokens_in_flight


def test_the_last_chunk_of_a_prefill_only_request_lets_the_others_go_ahead():
    scheduler = _scheduler()
    scheduler.add_request(_request("b", [5, 6, 7]))
    scheduler.add_request(Request("p", [8, 9], SamplingParams(max_tokens=1, temperature=0), prefill_only=True))
    both = scheduler.schedule()
    assert [(s.request_id, s.sample) for s in both.scheduled] == [("b", True), ("p", False)]
    ahead = scheduler.schedule()  # p ends with its step in flight: b goes ahead
    assert [(s.request_id, s.ahead) for s in ahead.scheduled] == [("b", True)]
    assert [r.request_id for r in scheduler.update_from_output(both, {"b": 30})] == ["b", "p"]
    assert scheduler.requests.keys() == {"b"}


# ----- through the engine, on the GPU path (Triton's interpreter on a CPU) ---------------------------

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def triton_kernels():
    pytest.importorskip("triton")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVSERVE_KERNELS", "triton")
        yield


def _llm(model_dir, async_scheduling: bool, **kwargs):
    from kvserve import LLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    options = dict(device=device, dtype="float32", kv_cache_tokens=2048, max_num_seqs=8, progress=False)
    return LLM(str(model_dir), session_db=False, async_scheduling=async_scheduling, **{**options, **kwargs})


def _run(llm, prompts, params) -> list[tuple]:
    """Every request at once; each one's tokens, text, finish reason and logprobs."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda pair: llm.generate(*pair), zip(prompts, params, strict=True)))
    return [
        (o.token_ids, o.text, o.finish_reason, [(lp.token_id, lp.logprob, lp.top) for lp in o.logprobs or []])
        for o in outs
    ]


PROMPTS = ["hi", "the quick brown fox", "lorem ipsum dolor sit amet", "x" * 40, "ab cd ef", "0123"]


def test_the_same_tokens_and_logprobs_with_and_without_async_scheduling(tiny_model_dir, triton_kernels):
    from tests.conftest import wait_idle_and_check

    with _llm(tiny_model_dir, False) as sync:
        assert not sync.weights["async_scheduling"]
        probe = sync.generate(PROMPTS[1], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        assert len(probe.text) >= 6
        params = [
            SamplingParams(max_tokens=7, temperature=0, ignore_eos=True, logprobs=2),
            SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[probe.token_ids[3]]),  # stops at its 4th
            SamplingParams(max_tokens=7, temperature=0.9, seed=3, ignore_eos=True),
            SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, presence_penalty=0.5),
            SamplingParams(max_tokens=9, temperature=0, ignore_eos=True, min_tokens=4),
            SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, stop=[probe.text[4:6]]),
        ]
        prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[3], PROMPTS[4], PROMPTS[1]]
        expected = _run(sync, prompts, params)
        wait_idle_and_check(sync)
    assert expected[1][2] == "stop" and len(expected[1][0]) <= 4 and expected[5][2] == "stop"
    with _llm(tiny_model_dir, True) as ahead:
        assert ahead.weights["async_scheduling"] and ahead.engine.runner.depth == 2
        assert _run(ahead, prompts, params) == expected
        assert ahead.runner_timings()["ahead_rows"] > 0  # it did run ahead, not only in turn
        assert [r[:3] for r in _run(ahead, prompts[:1], params[:1])] == [expected[0][:3]]  # alone, too
        wait_idle_and_check(ahead)


def test_chunked_prompts_running_ahead_get_the_tokens_in_turn(tiny_model_dir, triton_kernels):
    """Prompts of 40 and 71 tokens in chunks of up to 16, beside shorter ones decoding, each chunk going
    ahead of the one in flight (a last one that samples, too, with the decode step ahead of it reading
    its token on the device): the same tokens and logprobs as the engine without async scheduling."""
    from tests.conftest import wait_idle_and_check

    prompts = ["x" * 40, PROMPTS[1], "lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod", "hi"]
    params = [
        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1),
        SamplingParams(max_tokens=9, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0.9, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
    ]
    with _llm(tiny_model_dir, False, max_num_batched_tokens=16) as sync:
        expected = _run(sync, prompts, params)
    with _llm(tiny_model_dir, True, max_num_batched_tokens=16) as ahead:
        scheduler, chunks_ahead = ahead.engine.scheduler, []
        launched = scheduler._launched

        def count_chunks_ahead(out):  # known tokens for a request in flight: a chunk ahead
            chunks_ahead.extend(
                s for s in out.scheduled if not s.ahead and scheduler.requests[s.request_id] in scheduler.in_flight
            )
            return launched(out)

        scheduler._launched = count_chunks_ahead
        assert _run(ahead, prompts, params) == expected
        assert ahead.runner_timings()["ahead_rows"] > 0 and any(s.sample for s in chunks_ahead)
        wait_idle_and_check(ahead)


def test_an_abort_behind_a_step_ahead_frees_every_block(tiny_model_dir, triton_kernels):
    """Held at a known point: the request's step n is queued and its step ahead waits at the gate
    when the abort is sent; both steps are computed, the ahead one's token dropped, every block freed."""
    from tests.conftest import StepGate, wait_idle_and_check

    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    with _llm(tiny_model_dir, True) as llm:
        solo = llm.generate(PROMPTS[2], GREEDY).token_ids
        with StepGate(llm, take_back=False) as gate:
            stream = llm.stream(PROMPTS[1], params)
            gate.allow(3)  # the prefill, then two decode steps
            chunks = [next(stream), next(stream)]
            gate.step()  # step n is queued, the step ahead of it waits at the gate
            llm.abort(chunks[0].request_id)
            gate.open()
            rest = list(stream)
        assert rest[-1].finish_reason == "abort"
        assert len([t for c in chunks + rest for t in c.token_ids]) < params.max_tokens
        wait_idle_and_check(llm)
        assert llm.generate(PROMPTS[2], GREEDY).token_ids == solo  # the freed blocks serve another


def test_preemption_and_prefix_hits_running_ahead(tiny_model_dir, triton_kernels):
    """8 blocks of 16 for three requests that need 3 each as they decode: preempted ones recompute and
    go ahead again; each gets its solo run's tokens."""
    from tests.conftest import wait_idle_and_check

    prompts = [f"{i} lorem ipsum dolor sit amet" for i in range(3)]
    params = SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)
    with _llm(tiny_model_dir, True) as roomy:
        solo = [roomy.generate(p, params).token_ids for p in prompts]
    with _llm(tiny_model_dir, True, kv_cache_tokens=8 * 16) as tight:
        assert [r.token_ids for r in tight.generate(prompts, params)] == solo
        assert tight.stats()["num_preemptions_total"] > 0
        assert tight.generate(prompts[0], params).token_ids == solo[0]  # behind its cached prefix
        wait_idle_and_check(tight)


def test_a_prompt_joins_a_request_running_ahead(tiny_model_dir, triton_kernels):
    """A prompt admitted while a request runs ahead shares an eager step with that request's step ahead,
    whose token comes from the device there too: both get their solo runs' tokens."""
    from tests.conftest import StepGate, wait_idle_and_check

    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with _llm(tiny_model_dir, True) as llm:
        solo = [llm.generate(p, params).token_ids for p in PROMPTS[1:3]]
        with StepGate(llm, take_back=False) as gate, ThreadPoolExecutor(1) as pool:
            first = llm.stream(PROMPTS[1], params)
            gate.allow(3)
            head = [next(first), next(first)]
            gate.step()  # a step is queued, the step ahead of it waits at the gate
            second = pool.submit(llm.generate, PROMPTS[2], params)
            gate.open()
            tokens = [t for chunk in [*head, *first] for t in chunk.token_ids]
            assert [tokens, second.result().token_ids] == solo
        wait_idle_and_check(llm)


def test_a_prefill_only_row_in_a_graph_step_beside_a_step_ahead(tiny_model_dir, triton_kernels):
    """A session's eager prefill (prefill_only: no token sampled) of one token lands in a decode graph
    step beside a request's step ahead: the step stores the draw of its one sampling row, and the
    request gets its solo run's tokens."""
    from kvserve.engine.request import Request
    from tests.conftest import StepGate, wait_idle_and_check

    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with _llm(tiny_model_dir, True) as llm:
        solo = llm.generate(PROMPTS[1], params).token_ids
        runner, stored = llm.engine.runner, []
        graphs = runner.graphs
        store_tokens = graphs.store_tokens

        def store_and_look(tokens, sinks=None):  # the slots its requests hold, and what they hold after
            slots = sorted(runner._slot_of.values())
            store_tokens(tokens, sinks)
            stored.append((graphs._batch, sinks, slots, tokens.tolist(), runner.token_slots[slots].tolist()))

        graphs.store_tokens = store_and_look
        prefill = Request("prefill-only", [65], SamplingParams(max_tokens=1, temperature=0), prefill_only=True)
        with StepGate(llm, take_back=False) as gate:
            stream = llm.stream(PROMPTS[1], params)
            gate.allow(3)
            head = [next(stream), next(stream)]
            gate.step()  # a step is queued, the step ahead of it waits at the gate
            llm.engine.post(lambda: llm.engine.admit(prefill, None))
            gate.open()
            tokens = [t for chunk in [*head, *stream] for t in chunk.token_ids]
        assert tokens == solo
        # a graph step of two rows stored the one draw of the row that samples, in its request's slot
        partial = [(sinks, slots, drawn, held) for rows, sinks, slots, drawn, held in stored if rows == 2]
        assert partial and all(sinks == slots and drawn == held for sinks, slots, drawn, held in partial)
        wait_idle_and_check(llm)


def test_a_gate_that_takes_steps_back_early_leaves_the_tokens_alone(tiny_model_dir, triton_kernels):
    """The test suite's StepGate takes the queued step back before the next one runs (so that tests
    written for steps in turn hold on a GPU): a step ahead then finds its token on the host."""
    from tests.conftest import StepGate, wait_idle_and_check

    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    with _llm(tiny_model_dir, True) as llm:
        solo = llm.generate(PROMPTS[2], params).token_ids
        with StepGate(llm) as gate:
            stream = llm.stream(PROMPTS[2], params)
            gate.allow(2)
            first = next(stream)
            gate.step()  # every step before the one at the gate is applied
            assert llm.stats()["generation_tokens_total"] >= 2
            gate.open()
            tokens = [*first.token_ids, *(t for chunk in stream for t in chunk.token_ids)]
        assert tokens == solo
        wait_idle_and_check(llm)


def test_a_step_that_fails_for_one_request_fails_only_that_request_running_ahead(tiny_model_dir, triton_kernels):
    """R6 with async scheduling: a step raises whenever one request is in it, batched with others that
    run ahead. The others get their tokens, the one fails alone, and no block leaks."""
    from kvserve.errors import EngineError
    from tests.conftest import run_beside_a_failing_request, wait_idle_and_check

    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = PROMPTS[:3]
    with _llm(tiny_model_dir, False) as sync:
        expected = [sync.generate(p, params).token_ids for p in prompts]
    with _llm(tiny_model_dir, True) as llm:
        results = run_beside_a_failing_request(llm, prompts, params, take_back=False, wait_s=60, join_s=300)
        assert [results[p].token_ids for p in prompts] == expected
        assert isinstance(results["poison"], EngineError) and "injected fault" in str(results["poison"])
        assert llm.runner_timings()["ahead_rows"] > 0  # the others did run ahead
        wait_idle_and_check(llm)
