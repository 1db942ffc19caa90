"""The engine on a tiny random Llama: the failure reports R1-R5 of DESIGN.md as tests.

Every test ends with the engine idle, the block pool's integrity check passing and no KV block
in use (the autouse fixture `no_leaks`).
"""

from __future__ import annotations

import asyncio
import gc
import threading

import numpy as np
import pytest
import torch

from kvserve import LLM, EngineClosedError, EngineError, InvalidRequestError, SamplingParams
from tests.conftest import StepGate, wait_idle_and_check

pytest.importorskip("transformers")

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    with LLM(str(tiny_model_dir), dtype="float32", kv_cache_tokens=4096, max_num_seqs=32, progress=False) as llm:
        yield llm


@pytest.fixture(autouse=True)
def no_leaks(request):
    yield
    if "llm" in request.fixturenames:
        wait_idle_and_check(request.getfixturevalue("llm"))


def prompt(i: int, length: int = 12) -> str:
    return (f"request {i}: " + "lorem ipsum dolor sit amet " * 20)[:length]


def reference_greedy(model_dir, llm: LLM, text: str, max_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = llm.tokenizer.encode(text)
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None)
    return out[0, len(ids) :].tolist()


# ----- R2/R3: requests never inherit state --------------------------------------------------
@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded-sampling"])
def test_back_to_back_requests_equal_their_solo_runs(llm, tiny_model_dir, seeded):
    params = {
        "short": SamplingParams(max_tokens=16, temperature=0.8 if seeded else 0, seed=1, ignore_eos=True),
        "long": SamplingParams(max_tokens=40, temperature=0.8 if seeded else 0, seed=2, ignore_eos=True),
    }
    texts = [("short", prompt(1, 5)), ("long", prompt(2, 300)), ("short", prompt(3, 7))]
    back_to_back = [llm.generate(t, params[kind]).token_ids for kind, t in texts]
    # Each alone on a fresh engine, and (greedy) against transformers.
    with LLM(str(tiny_model_dir), dtype="float32", kv_cache_tokens=4096, progress=False) as fresh:
        for (kind, text), got in zip(texts, back_to_back, strict=True):
            assert fresh.generate(text, params[kind]).token_ids == got
        wait_idle_and_check(fresh)
    if not seeded:
        for (kind, text), got in zip(texts, back_to_back, strict=True):
            assert reference_greedy(tiny_model_dir, llm, text, params[kind].max_tokens) == got


# ----- R1/R4: many threads, one engine ------------------------------------------------------
def test_sixteen_threads_generate_and_stream_at_once(llm):
    params = [
        SamplingParams(max_tokens=8 + 3 * i, temperature=0 if i % 2 else 0.9, seed=i, ignore_eos=True)
        for i in range(16)
    ]
    texts = [prompt(i, 4 + 9 * i) for i in range(16)]
    solo = [llm.generate(t, p).token_ids for t, p in zip(texts, params, strict=True)]
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(16)

    def worker(i: int) -> None:
        try:
            barrier.wait()
            if i % 2:
                results[i] = llm.generate(texts[i], params[i]).token_ids
            else:
                results[i] = [t for chunk in llm.stream(texts[i], params[i]) for t in chunk.token_ids]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert [results[i] for i in range(16)] == solo


def test_batched_list_generate_equals_solo(llm):
    texts = [prompt(i, 3 + 11 * i) for i in range(8)]
    solo = [llm.generate(t, GREEDY).token_ids for t in texts]
    assert [r.token_ids for r in llm.generate(texts, GREEDY)] == solo


# ----- R5: abort stops the work at once ----------------------------------------------------
def test_break_out_of_stream_aborts_within_one_step(llm):
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    before = llm.stats()
    stream = llm.stream(prompt(5, 20), params)
    for i, _ in enumerate(stream):
        if i == 2:
            at_break = llm.stats()
            break
    del stream  # drop the generator: GeneratorExit -> abort
    counts = wait_idle_and_check(llm)
    after = llm.stats()
    assert after["num_aborted_total"] == before["num_aborted_total"] + 1
    assert after["generation_tokens_total"] - at_break["generation_tokens_total"] <= 1
    assert counts["used"] == 0


def test_two_hundred_early_breaks_leave_the_engine_healthy(llm):
    before = llm.stats()
    for i in range(200):
        for chunk_index, _ in enumerate(llm.stream(prompt(i, 8), SamplingParams(max_tokens=50, temperature=0))):
            if chunk_index == i % 3:
                break
    wait_idle_and_check(llm)
    after = llm.stats()
    assert after["num_aborted_total"] - before["num_aborted_total"] >= 190  # a few may finish by EOS first
    assert llm.generate(prompt(1, 5), GREEDY).finish_reason == "length"


def test_explicit_abort_by_request_id(llm):
    stream = llm.stream(prompt(9, 10), SamplingParams(max_tokens=500, temperature=0, ignore_eos=True))
    with StepGate(llm) as gate:
        gate.allow(1)  # the prompt's step, which samples the first token; the next one waits at the gate
        first = next(stream)
        llm.abort(first.request_id)
        llm.abort(first.request_id)  # idempotent
        gate.open()
        rest = list(stream)
    assert rest[-1].finish_reason == "abort"
    assert len(rest) <= 2  # at most one more step ran before the abort applied


def test_garbage_collected_stream_aborts(llm):
    before = llm.stats()["num_aborted_total"]
    stream = llm.stream(prompt(3, 10), SamplingParams(max_tokens=500, temperature=0, ignore_eos=True))
    next(stream)
    del stream
    gc.collect()
    wait_idle_and_check(llm)
    assert llm.stats()["num_aborted_total"] == before + 1


def test_a_loops_streams_are_woken_once_for_what_a_step_delivered():
    """The engine thread's chunks for one asyncio loop go through one mailbox: in order per stream, and
    one wake-up of the loop (a call_soon_threadsafe) for everything posted while the loop was busy."""
    from kvserve.engine.client import AsyncSink

    async def main():
        loop = asyncio.get_running_loop()
        sinks = [AsyncSink(loop) for _ in range(8)]
        wakeups = []
        schedule = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *args: (wakeups.append(args), schedule(*args))[1]
        try:
            # the loop is held here while another thread posts three "steps" of chunks to every stream
            poster = threading.Thread(
                target=lambda: [s.put((step, i)) for step in range(3) for i, s in enumerate(sinks)]
            )
            poster.start()
            poster.join()
            assert len(wakeups) == 1
            got = [[await s.queue.get() for _ in range(3)] for s in sinks]
            assert got == [[(step, i) for step in range(3)] for i in range(8)]
            sinks[0].put("next")  # the mailbox drained: the next post wakes the loop again
            assert await sinks[0].queue.get() == "next" and len(wakeups) == 2
        finally:
            del loop.call_soon_threadsafe

    asyncio.run(main())


def test_leaving_a_refused_duplicate_id_before_its_refusal_leaves_the_request_holding_the_id(llm):
    """A second request of an id in use is refused; one whose stream is left (a cancelled task, a
    timeout) before the refusal arrives aborted, by id, the first request instead."""
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)

    async def main():
        with StepGate(llm) as gate:
            first = asyncio.create_task(llm.agenerate(prompt(1, 10), params, request_id="taken"))
            await asyncio.to_thread(gate.entered.wait, 30)  # "taken" is running, held at a step
            llm.pause("taken")  # applied after that step: it stays, unfinished, while the engine goes on
            gate.open()
        second = asyncio.create_task(llm.agenerate(prompt(2, 10), params, request_id="taken"))
        await asyncio.sleep(0)  # it has sent its request, and waits for its first chunk
        second.cancel()
        with pytest.raises(asyncio.CancelledError):
            await second
        with pytest.raises(InvalidRequestError, match="already in use"):  # a thread's is refused the same way
            await asyncio.to_thread(lambda: list(llm.stream(prompt(3, 10), params, request_id="taken")))
        llm.pause("taken", paused=False)
        return await first

    assert asyncio.run(main()).finish_reason == "length"


def test_async_stream_and_task_cancellation(llm):
    async def main():
        texts = [prompt(i, 10) for i in range(4)]
        outs = await asyncio.gather(*(llm.agenerate(t, GREEDY) for t in texts))
        chat = await llm.achat([{"role": "user", "content": "hi"}], GREEDY)
        started = asyncio.Event()

        async def consume():
            async for _ in llm.astream(prompt(7, 10), SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return outs, chat

    before = llm.stats()["num_aborted_total"]
    outs, chat = asyncio.run(main())
    assert [o.token_ids for o in outs] == [llm.generate(prompt(i, 10), GREEDY).token_ids for i in range(4)]
    assert chat.token_ids == llm.chat([{"role": "user", "content": "hi"}], GREEDY).token_ids
    wait_idle_and_check(llm)
    assert llm.stats()["num_aborted_total"] == before + 1


# ----- memory pressure -----------------------------------------------------------------------
@pytest.fixture
def small_llm(tiny_model_dir):
    with LLM(
        str(tiny_model_dir), dtype="float32", kv_cache_tokens=256, block_size=16, max_num_seqs=16, progress=False
    ) as llm:
        yield llm
        wait_idle_and_check(llm)


def test_preemption_under_a_tight_pool_keeps_outputs(small_llm, llm):
    params = [SamplingParams(max_tokens=60, temperature=0 if i % 2 else 0.7, seed=i, ignore_eos=True) for i in range(8)]
    texts = [prompt(i, 30 + 5 * i) for i in range(8)]
    solo = [llm.generate(t, p).token_ids for t, p in zip(texts, params, strict=True)]
    results = generate_in_threads(small_llm, texts, params)
    assert small_llm.stats()["num_preemptions_total"] > 0
    assert results == solo


def generate_in_threads(llm: LLM, texts: list[str], params: list[SamplingParams]) -> list[list[int] | None]:
    """Each request from a thread of its own, all at once: their token ids. The engine takes them in
    together (their puts into its inbox wait for the last), so that the tests that need them batched
    never bet on how soon a thread starts: a thread late by a few steps left the first request to
    run them alone."""
    from kvserve.engine import core

    engine = llm.engine
    inbox, held, lock = engine.inbox, [], threading.Lock()

    class GatheringInbox:
        def put(self, message) -> None:
            if not isinstance(message, core._Add):
                inbox.put(message)
                return
            with lock:
                held.append(message)
                if len(held) == len(texts):
                    for added in held:
                        inbox.put(added)

        def __getattr__(self, name):
            return getattr(inbox, name)

    results: list[list[int] | None] = [None] * len(texts)

    def worker(i: int) -> None:
        results[i] = llm.generate(texts[i], params[i]).token_ids

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(texts))]
    engine.inbox = GatheringInbox()
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        engine.inbox = inbox
    return results


def test_request_larger_than_the_pool_is_refused(small_llm):
    with pytest.raises(InvalidRequestError, match="context"):
        small_llm.generate(prompt(1, 200), SamplingParams(max_tokens=100))


def test_a_max_model_len_that_cannot_be_served_is_refused_not_lowered(tiny_model_dir):
    """Before, either was lowered without a word (to the pool's 256 tokens, or the model's 1024)."""
    for settings, match in (
        (dict(kv_cache_tokens=256, max_model_len=512), "does not fit in the KV cache of 256 tokens"),
        (dict(max_model_len=4096), "longer than this model's context of 1024 tokens"),
    ):
        with pytest.raises(InvalidRequestError, match=match) as err:
            LLM(str(tiny_model_dir), dtype="float32", session_db=False, progress=False, **settings)
        assert err.value.param == "max_model_len"
    # A small kv_cache_tokens was answered "lower max_num_seqs (64 is usual)", the default it had
    with pytest.raises(InvalidRequestError, match=r"raise kv_cache_tokens .* or lower max_num_seqs to 48 or fewer"):
        LLM(str(tiny_model_dir), dtype="float32", session_db=False, progress=False, kv_cache_tokens=48)
    with LLM(str(tiny_model_dir), dtype="float32", kv_cache_tokens=256, session_db=False, progress=False) as small:
        assert small.config.max_model_len == 256  # unasked, the pool's


def test_a_gpu_the_kernels_cannot_run_on_is_refused_when_asked_for_and_passed_over_when_not(
    tiny_model_dir, monkeypatch, caplog
):
    """This machine made to report CUDA GPUs (torch.cuda's answers per device, nothing launched). Before,
    a Tesla T4 (compute capability 7.5) was taken, the model loaded in bfloat16 (which torch emulates
    there), and ptxas refused the first 4-bit launch's packed bfloat16 FMAs; a ROCm build met the
    kernels' inline PTX. Asked for by name it is refused with why; unasked, the next GPU or the CPU serves."""
    import logging

    from kvserve.llm import default_device

    gpus = [("Tesla T4", (7, 5))]  # (name, compute capability) per device index
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(gpus))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: gpus[index][0])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: gpus[index][1])
    monkeypatch.setattr(torch.version, "hip", None)
    settings = dict(dtype="float32", kv_cache_tokens=256, session_db=False, progress=False)
    refused = r"compute capability 8\.0 or later .*; Tesla T4 has 7\.5\. Use device 'cpu', or leave device out"
    for device in ("cuda", "cuda:0"):
        with pytest.raises(InvalidRequestError, match=refused) as err:
            LLM(str(tiny_model_dir), device=device, **settings)
        assert err.value.param == "device"
    with caplog.at_level(logging.WARNING, "kvserve.kernels"), LLM(str(tiny_model_dir), **settings) as llm:
        assert llm.device == torch.device("cpu")
        assert len(llm.generate(prompt(0), GREEDY).token_ids) == GREEDY.max_tokens
        wait_idle_and_check(llm)
    assert "cuda:0 passed over: " in caplog.text and "Tesla T4 has 7.5." in caplog.text
    gpus.append(("NVIDIA A100-SXM4-80GB", (8, 0)))  # Ampere, second: taken unasked, and by its index
    assert default_device() == torch.device("cuda", 1)
    with pytest.raises(InvalidRequestError, match=refused):
        LLM(str(tiny_model_dir), device="cuda:0", **settings)
    gpus.reverse()  # the A100 first, the T4 second: each index answers for its own GPU
    assert default_device() == torch.device("cuda", 0)
    with pytest.raises(InvalidRequestError, match=refused):
        LLM(str(tiny_model_dir), device="cuda:1", **settings)
    monkeypatch.setattr(torch.version, "hip", "6.2.41133")
    gpus[:] = [("AMD Instinct MI300X", (9, 4))]
    assert default_device() == torch.device("cpu")
    with pytest.raises(InvalidRequestError, match=r"written for NVIDIA GPUs .* ROCm build \(HIP 6\.2\.41133\)"):
        LLM(str(tiny_model_dir), device="cuda", **settings)


def test_weights_or_a_kv_cache_the_device_has_no_room_for_are_refused_with_what_to_lower(tiny_model_dir, monkeypatch):
    """An allocation's failure (raised here by the load or by the pool's allocation, as memory too small
    raises it: torch's on a GPU, the CPU allocator's, Triton's loading a kernel) came out of LLM() as a
    RuntimeError; it is now the user's InvalidRequestError naming what to change, with the failure's first
    line. Any other error passes as it was. Nothing is left behind: the same LLM starts after them."""
    import kvserve.engine.model_runner as model_runner
    import kvserve.pipeline.stage as stage

    settings = dict(device="cpu", dtype="float32", kv_cache_tokens=256, session_db=False, progress=False)
    cpu = "[enforce fail at alloc_cpu.cpp:117] . DefaultCPUAllocator: can't allocate memory: you tried to allocate 2 GB"
    for module, name, error, param, match in (
        (
            stage,
            "load_model",
            RuntimeError(cpu + "\nits state"),
            "weights",
            r"weights do not fit in this machine's memory \(\[enforce fail .* 2 GB\); use weights=q4 or q8 "
            r"\(--weights\) or a smaller model\.$",
        ),
        (
            model_runner,
            "allocate_kv_cache",
            torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB.\nits state"),
            "kv_cache_tokens",
            r"^A KV cache of 256 tokens \(0\.1 MiB\) .* this machine's memory \(CUDA out of "
            r"memory\. Tried to allocate 20\.00 GiB\.\); lower kv_cache_tokens or max_num_seqs\.$",
        ),
        (
            model_runner,
            "allocate_kv_cache",
            RuntimeError("Triton Error [CUDA]: out of memory"),
            "kv_cache_tokens",
            r"\(Triton Error \[CUDA\]: out of memory\); lower kv_cache_tokens",
        ),
        (stage, "load_model", RuntimeError("a damaged file"), None, "^a damaged file$"),
    ):

        def failing(*args, error=error, **kwargs):
            raise error

        with monkeypatch.context() as patched:
            patched.setattr(module, name, failing)
            with pytest.raises(InvalidRequestError if param else RuntimeError, match=match) as err:
                LLM(str(tiny_model_dir), **settings)
        assert getattr(err.value, "param", None) == param and "its state" not in str(err.value)
    with LLM(str(tiny_model_dir), **settings) as llm:
        assert len(llm.generate(prompt(1), GREEDY).token_ids) == GREEDY.max_tokens
        wait_idle_and_check(llm)


# ----- prefix caching --------------------------------------------------------------------------
def test_shared_256_token_prefix_is_computed_once(llm):
    shared = list(range(40, 40 + 256))
    first = llm.generate([*shared, 7, 8, 9], GREEDY)
    before = llm.stats()
    second = llm.generate([*shared, 10, 11, 12, 13], GREEDY)
    after = llm.stats()
    assert first.usage.cached_tokens == 0
    assert second.usage.cached_tokens == 256
    assert after["prefix_cache_hit_tokens_total"] - before["prefix_cache_hit_tokens_total"] == 256
    with LLM(
        llm.model_path, dtype="float32", kv_cache_tokens=4096, enable_prefix_caching=False, progress=False
    ) as plain:
        assert plain.generate([*shared, 10, 11, 12, 13], GREEDY).token_ids == second.token_ids
        wait_idle_and_check(plain)


# ----- errors ----------------------------------------------------------------------------------
def test_invalid_input_is_a_typed_error_naming_the_field(llm):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(top_p=0)
    assert err.value.param == "top_p"
    with pytest.raises(InvalidRequestError, match="outside the vocabulary") as err:
        llm.generate([1, 2, 10_000])
    assert err.value.param == "prompt"
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate("")
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        llm.generate("hi", SamplingParams(max_tokens=5000))
    with pytest.raises(InvalidRequestError, match="kv_cache_dtype must be one of") as err:
        LLM(llm.model_path, kv_cache_dtype="int4", progress=False)
    assert err.value.param == "kv_cache_dtype"
    # prompts and messages of the wrong shape: a typed error, never bytes read as token ids or a TypeError
    for prompt in (b"hi", None, 5, [True], [1.5], ("a", "b")):
        with pytest.raises(InvalidRequestError, match="string or a list of token ids") as err:
            llm.generate(prompt, SamplingParams(max_tokens=1))
        assert err.value.param == "prompt", prompt
    assert llm.generate(torch.tensor([1, 2]), SamplingParams(max_tokens=1)).prompt_token_ids == [1, 2]
    for messages, param in (
        ([{"role": "bogus", "content": "x"}], "messages[0].role"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        ([], "messages"),
    ):
        with pytest.raises(InvalidRequestError) as err:
            llm.chat(messages, SamplingParams(max_tokens=1))
        assert err.value.param == param, messages


def test_every_mistake_in_the_python_api_is_a_typed_error_naming_its_argument(llm, tiny_model_dir, tmp_path):
    """What an outside tester found raising AttributeError, TypeError, MemoryError or nothing at all:
    each is an InvalidRequestError naming the argument, raised before anything loads or runs."""
    for params in ({"max_tokens": 3}, 3, SamplingParams):  # a dict, a number, the class itself
        with pytest.raises(InvalidRequestError, match="must be a SamplingParams") as err:
            llm.generate("hi", params)
        assert err.value.param == "params"
    with pytest.raises(InvalidRequestError, match="one per prompt"):
        llm.generate(["a", "b"], [SamplingParams(max_tokens=1)])
    one, two = SamplingParams(max_tokens=1, temperature=0), SamplingParams(max_tokens=2, temperature=0)
    assert [len(r.token_ids) for r in llm.generate(["a", "b"], [one, two])] == [1, 2]  # as vLLM takes them
    assert llm.generate([np.int64(1), np.int64(2)], one).prompt_token_ids == [1, 2]  # one prompt, not two
    numpy_ints = SamplingParams(max_tokens=np.int64(2), seed=np.int32(3), top_k=np.int64(5), temperature=np.float32(0))
    assert (numpy_ints.max_tokens, numpy_ints.seed, numpy_ints.top_k) == (2, 3, 5)  # refused, as floats were not
    assert type(numpy_ints.max_tokens) is int and len(llm.generate("a", numpy_ints).token_ids) == 2
    for request_id in (None, 5, [5], b"id"):
        with pytest.raises(InvalidRequestError, match="request_id must be a string"):
            llm.abort(request_id)
    llm.abort({"gone": 1}.keys())  # any iterable of ids, as before
    with pytest.raises(InvalidRequestError, match="request_id must be a string"):
        llm.stream("x", one, request_id=5)
    # An empty id was replaced by a generated one, which its caller could then not abort.
    with pytest.raises(InvalidRequestError, match="request_id must be a string of one character or more"):
        llm.stream("x", one, request_id="")
    for name, value in (("id", 5), ("owner", 5), ("id", "")):  # "No session 5." and an owner of 5, before
        with pytest.raises(InvalidRequestError) as err:
            llm.session(**{name: value})
        assert err.value.param == name
    parts = [{"role": "user", "content": [{"type": "text", "text": "H"}, {"type": "text", "text": "i"}]}]
    assert llm.chat(parts, one).token_ids == llm.chat([{"role": "user", "content": "Hi"}], one).token_ids
    with pytest.raises(InvalidRequestError) as err:
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], one)
    assert err.value.param == "messages[0].content[0].type"  # as the server names it
    for messages in ("hi", ["hi"]):
        with pytest.raises(InvalidRequestError) as err:
            llm.session(messages=messages)
    with pytest.raises(InvalidRequestError, match="ttl must be from"):
        llm.session(ttl="x")
    model = str(tiny_model_dir)
    for kwargs, param in (
        ({"max_sessions": "x"}, "max_sessions"),
        ({"max_message_bytes": -1}, "max_message_bytes"),
        ({"pipeline_parallel": 0}, "pipeline_parallel"),
        ({"enable_prefix_caching": "no"}, "enable_prefix_caching"),
        ({"session_ttl": "x"}, "session_ttl"),
        ({"session_db": 123}, "session_db"),
        ({"kv_cache_tokens": 10**13}, "kv_cache_tokens"),  # more than any machine's memory: not a MemoryError
        ({"kv_cache_tokens": 10**13, "pipeline_parallel": 2}, "kv_cache_tokens"),  # nor split over two stages
        ({"max_num_seqs": 10**9}, "max_num_seqs"),  # its block table alone: 3.7 TiB at the first request
        ({"dtype": torch.int8}, "dtype"),
        ({"dtype": 5}, "dtype"),
        ({"device": "tpu"}, "device"),
        ({"device": "cuda:99"}, "device"),  # none here, nor on a GPU machine
    ):
        with pytest.raises(InvalidRequestError) as err:
            LLM(model, progress=False, **{"session_db": tmp_path / "s.db", **kwargs})
        assert err.value.param == param, kwargs
    with pytest.raises(InvalidRequestError) as err:
        LLM(123)
    assert err.value.param == "model"


def test_a_failing_step_fails_only_its_requests(llm):
    runner = llm.engine.runner
    original = runner.execute
    calls = {"n": 0}

    def flaky(out, *args):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected fault")
        return original(out, *args)

    runner.execute = flaky
    try:
        with pytest.raises(EngineError, match="injected fault"):
            llm.generate(prompt(1, 10), GREEDY)
    finally:
        runner.execute = original
    assert llm.generate(prompt(1, 10), GREEDY).finish_reason == "length"
    assert llm.stats()["num_failed_total"] >= 1


def test_a_step_that_fails_after_its_draws_is_rerun_with_the_same_seeds(llm):
    """Seeded rows take one seed a step from their streams, a block of 64 at a time. A step whose sampler
    fails after drawing (here the 10th, and the first where a stream drew its second block) puts the
    seeds back: the reruns give the tokens of runs without a fault. Both faults come in steps of both
    requests (a failed step of one request fails it): `generate_in_threads` hands them in together."""
    params = [SamplingParams(max_tokens=90, temperature=0.9, seed=seed, ignore_eos=True) for seed in (3, 4)]
    texts = [prompt(1, 20), prompt(2, 20)]
    clean = [llm.generate(t, p).token_ids for t, p in zip(texts, params, strict=True)]
    sampler = llm.engine.runner.sampler
    original = sampler.launch
    calls = {"n": 0, "faults": []}

    def fails_after_drawing(logits, rows):
        blocks = [row.generator.mark()[0] for row in rows]
        sampled = original(logits, rows)
        calls["n"] += 1
        second_block = any(b and row.generator.mark()[0] is not b for b, row in zip(blocks, rows, strict=True))
        if calls["n"] == 10 or (second_block and "block" not in calls["faults"]):
            calls["faults"].append("block" if second_block else "10th")
            raise RuntimeError("injected fault after the draws")
        return sampled

    sampler.launch = fails_after_drawing
    try:
        outputs = generate_in_threads(llm, texts, params)
    finally:
        sampler.launch = original
    assert sorted(calls["faults"]) == ["10th", "block"]
    assert outputs == clean


def test_close_aborts_in_flight_and_refuses_new_requests(tiny_model_dir):
    engine_llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_tokens=1024, progress=False)
    stream = engine_llm.stream(prompt(1, 10), SamplingParams(max_tokens=900, temperature=0, ignore_eos=True))
    next(stream)
    engine_llm.close()
    assert list(stream)[-1].finish_reason == "abort"
    assert not engine_llm.engine.thread.is_alive()
    with pytest.raises(EngineClosedError):
        engine_llm.generate("hi")
    engine_llm.engine.pool.check_integrity()
    assert engine_llm.engine.pool.num_used_blocks == 0


def test_no_engine_thread_left_after_close(tiny_model_dir):
    with LLM(str(tiny_model_dir), dtype="float32", kv_cache_tokens=512, progress=False) as tmp:
        tmp.generate("x", GREEDY)
        wait_idle_and_check(tmp)
        thread = tmp.engine.thread
        assert thread.is_alive()
    assert not thread.is_alive()


def test_a_request_queued_while_the_engine_closes_is_refused_not_left_waiting(tiny_model_dir):
    """`add` checked that the engine was open, then queued its request: an engine that closed in
    between (its inbox emptied for the last time) left the request where nobody answers it, and its
    caller waited for good. The put is held here until the engine thread has ended, or 2 s at most:
    fixed, it cannot end while a request is on its way in (the 2 s always pass), and the request is
    refused; unfixed, it ended within them, and the request was left waiting."""
    from kvserve.engine import core

    closing = LLM(str(tiny_model_dir), dtype="float32", kv_cache_tokens=512, session_db=False, progress=False)
    engine = closing.engine

    class HeldPut:  # the engine's inbox, whose next request's put waits for the engine to close first
        def __init__(self, inbox) -> None:
            self.inbox, self.reached = inbox, threading.Event()

        def put(self, message) -> None:
            if isinstance(message, core._Add) and not self.reached.is_set():
                self.reached.set()
                engine.thread.join(2)  # the engine closes meanwhile, if anything lets it
            self.inbox.put(message)

        def __getattr__(self, name):
            return getattr(self.inbox, name)

    engine.inbox = HeldPut(engine.inbox)
    outcome = []

    def submit() -> None:
        try:
            outcome.append(closing.generate("x", GREEDY))
        except EngineClosedError as exc:
            outcome.append(exc)

    submitter = threading.Thread(target=submit, daemon=True)  # left waiting, it must not hold pytest's exit
    submitter.start()
    assert engine.inbox.reached.wait(30)
    closing.close()
    submitter.join(60)
    assert not submitter.is_alive(), "a request queued as the engine closed waits for good"
    assert isinstance(outcome[0], EngineClosedError), outcome


def test_an_llm_used_in_a_forked_child_says_so_at_once(llm):
    """fork() copies the LLM but not its engine thread: a request in the child waited for good."""
    import os
    import signal

    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: answer through the pipe, whatever happens
        signal.alarm(60)  # a child that hangs dies, and says nothing
        try:
            try:
                llm.generate("x", GREEDY)
                said = "no error"
            except EngineClosedError as exc:
                said = str(exc)
            except BaseException as exc:
                said = repr(exc)
            os.write(writer, said.encode()[:4000])
        finally:
            os._exit(0)
    os.close(writer)
    with os.fdopen(reader, "rb") as pipe:
        said = pipe.read().decode()
    os.waitpid(pid, 0)
    assert "forked" in said and "create the LLM in this process" in said, said
    assert llm.generate("x", GREEDY).finish_reason == "length"  # the parent's goes on


def test_stats_fields(llm):
    stats = llm.stats()
    for key in (
        "num_running",
        "num_waiting",
        "kv_blocks_total",
        "kv_blocks_used",
        "kv_blocks_cached",
        "num_preemptions_total",
        "num_aborted_total",
        "prompt_tokens_total",
        "prefix_cache_hit_tokens_total",
        "generation_tokens_total",
        "steps_total",
    ):
        assert isinstance(stats[key], int), key
