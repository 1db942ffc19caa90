"""The engine on the bundled SmolLM2: text, stop rules and logprobs on a real model and tokenizer."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.weights.loader import load_model
from tests.conftest import wait_idle_and_check
from tests.simple_generate import prompt_logits, stream_token_ids

pytestmark = pytest.mark.bundled
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llm(bundled_gguf):
    # float inputs: the arithmetic of the single-sequence reference below (int8 has its own test)
    with LLM(str(bundled_gguf), dtype="float32", activations="float", kv_cache_tokens=8192, progress=False) as llm:
        yield llm
        wait_idle_and_check(llm)


@pytest.fixture(scope="module")
def reference_model(bundled_gguf):
    """A second copy of the weights for the single-sequence reference path (never the engine's)."""
    return load_model(bundled_gguf, torch.float32, progress=False)


@pytest.fixture(autouse=True)
def no_leaks(llm):
    yield
    wait_idle_and_check(llm)


def test_chat_answers_and_stops_at_end_of_turn(llm):
    out = llm.chat(FRANCE, SamplingParams(max_tokens=48, temperature=0))
    assert "Paris" in out.text
    assert out.finish_reason == "stop" and out.stop_reason == llm.tokenizer.eos_token_id
    assert out.token_ids[-1] == llm.tokenizer.eos_token_id and "<|im_end|>" not in out.text
    assert out.usage.completion_tokens == len(out.token_ids)


def test_engine_tokens_equal_the_single_sequence_path(llm, reference_model):
    ids = llm.tokenizer.encode_chat(FRANCE)
    reference = list(stream_token_ids(reference_model, ids, 24))
    with_engine = llm.generate(ids, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)).token_ids
    assert with_engine == reference


def test_stop_string_is_excluded_and_streams_never_show_part_of_it(llm):
    params = SamplingParams(max_tokens=48, temperature=0, stop=["Paris"])
    full = llm.chat(FRANCE, SamplingParams(max_tokens=48, temperature=0)).text
    out = llm.chat(FRANCE, params)
    assert out.finish_reason == "stop" and out.stop_reason == "Paris"
    assert out.text == full[: full.index("Paris")]
    pieces = [c.text for c in llm.stream_chat(FRANCE, params)]
    assert "".join(pieces) == out.text
    assert not any("Par" in p for p in pieces)


def test_a_stop_string_that_the_last_allowed_token_completes_stops_the_request(llm):
    """The stop string decides the reason even at max_tokens, as OpenAI and vLLM say "stop"."""
    full = llm.chat(FRANCE, SamplingParams(max_tokens=48, temperature=0))
    decode = llm.tokenizer.decode
    k = next(k for k in range(1, len(full.token_ids) + 1) if "Paris" in decode(full.token_ids[:k]))
    out = llm.chat(FRANCE, SamplingParams(max_tokens=k, temperature=0, stop=["Paris"]))
    assert (out.finish_reason, out.stop_reason, len(out.token_ids)) == ("stop", "Paris", k)
    assert out.text == full.text[: full.text.index("Paris")]
    assert (
        list(llm.stream_chat(FRANCE, SamplingParams(max_tokens=k, temperature=0, stop=["Paris"])))[-1].finish_reason
        == "stop"
    )
    short = llm.chat(FRANCE, SamplingParams(max_tokens=k - 1, temperature=0, stop=["Paris"]))
    assert short.finish_reason == "length" and short.stop_reason is None


def test_stop_token_ids_min_tokens_and_ignore_eos(llm):
    free = llm.chat(FRANCE, SamplingParams(max_tokens=40, temperature=0))
    second = free.token_ids[1]
    stopped = llm.chat(FRANCE, SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[second]))
    assert stopped.token_ids == free.token_ids[:2] and stopped.stop_reason == second
    longer = llm.chat(FRANCE, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    assert longer.finish_reason == "length" and len(longer.token_ids) == 40
    at_least = llm.chat(FRANCE, SamplingParams(max_tokens=40, temperature=0, min_tokens=len(free.token_ids) + 3))
    assert len(at_least.token_ids) >= len(free.token_ids) + 3
    # A stop string is not looked for before min_tokens either (before: the first token's text ended it),
    # nor found later in text from before min_tokens (vLLM's rules): the first word, whole after k tokens,
    # does not end a request of min_tokens k + 1 at its k + 1st token.
    first_word = free.text.split()[0]
    assert llm.chat(FRANCE, SamplingParams(max_tokens=40, temperature=0, stop=[first_word])).text == ""
    k = next(n for n in range(1, 41) if first_word in llm.tokenizer.decode(free.token_ids[:n]))
    held = llm.chat(FRANCE, SamplingParams(max_tokens=40, temperature=0, stop=[first_word], min_tokens=k + 1))
    later = free.text.find(first_word, len(first_word))  # only a later one may end it
    assert held.text == (free.text if later < 0 else free.text[:later]) and len(held.token_ids) >= k + 1


def test_logprobs_match_the_model_distribution(llm, reference_model):
    ids = llm.tokenizer.encode_chat(FRANCE)
    out = llm.generate(ids, SamplingParams(max_tokens=3, temperature=0, logprobs=5))
    assert len(out.logprobs) == 3
    context = ids + out.token_ids[:1]
    reference = torch.log_softmax(prompt_logits(reference_model, context)[-1], -1)
    second = out.logprobs[1]
    assert second.token_id == out.token_ids[1]
    assert second.logprob == pytest.approx(float(reference[second.token_id]), abs=1e-4)
    assert [t for t, _ in second.top] == reference.topk(5).indices.tolist()


def test_second_turn_reuses_the_first_turns_prefix(llm):
    first = llm.chat(FRANCE, SamplingParams(max_tokens=16, temperature=0))
    history = [*FRANCE, {"role": "assistant", "content": first.text}, {"role": "user", "content": "And of Italy?"}]
    second = llm.chat(history, SamplingParams(max_tokens=16, temperature=0))
    assert second.usage.cached_tokens >= 32
    assert second.usage.cached_tokens % llm.config.block_size == 0


def test_int8_activations_batched_requests_equal_their_solo_runs(bundled_gguf):
    """With activations=int8 a row's int4 products do not depend on the rows batched with it (exact
    integer sums, the same float steps per row; checked bit for bit in test_fused_decode): eight
    requests batched give their solo runs' tokens, through batched prefill and decode steps alike.
    Their logprobs agree to float rounding: the lm_head and attention sum in batch-dependent orders,
    and a rounding that moved an int8 input across a step would show as a gap of about 1e-2."""
    params = SamplingParams(max_tokens=16, temperature=0, logprobs=2, ignore_eos=True)
    with LLM(str(bundled_gguf), dtype="float32", activations="int8", kv_cache_tokens=4096, progress=False) as int8:
        assert int8.weights["activations"] == "int8"
        layers = [m for m in int8.model.modules() if hasattr(m, "int8_activations")]
        assert layers and all(m.int8_activations for m in layers)
        prompts = [
            int8.tokenizer.encode(f"{n} {thing} that are {colour}:")
            for n in ("Two", "Three")
            for thing, colour in (("fruits", "red"), ("birds", "blue"), ("trees", "tall"), ("stones", "green"))
        ]
        solo = [int8.generate(p, params) for p in prompts]
        batched = int8.generate(prompts, params)
        wait_idle_and_check(int8)
    for one, many in zip(solo, batched, strict=True):
        assert one.token_ids == many.token_ids
        gaps = [abs(a.logprob - b.logprob) for a, b in zip(one.logprobs, many.logprobs, strict=True)]
        assert max(gaps) <= 1e-4


def assert_first_divergence_agrees(got, expected):
    """Greedy tokens equal, or at their first difference each engine's token is in the other's top
    logprobs (the first-divergence rule, DESIGN.md)."""
    pairs = list(zip(got.token_ids, expected.token_ids, strict=True))
    divergence = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
    if divergence is not None:
        ours, theirs = got.logprobs[divergence], expected.logprobs[divergence]
        assert expected.token_ids[divergence] in [t for t, _ in ours.top], (divergence, ours, theirs)
        assert got.token_ids[divergence] in [t for t, _ in theirs.top], (divergence, ours, theirs)


def test_float16_kv_cache_answers_like_float32(bundled_gguf, llm):
    """kv_cache_dtype=float16: the pool holds float16 (half the bytes per token), prompts and replies
    pass through it (a chat's prefill, the fused decode steps, a second turn reading the first's
    cached blocks), and greedy tokens agree with the float32 pool's under the first-divergence rule."""
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=5, ignore_eos=True)
    expected = llm.chat(FRANCE, params)
    options = dict(dtype="float32", activations="float", kv_cache_dtype="float16", kv_cache_tokens=2048)
    with LLM(str(bundled_gguf), progress=False, **options) as f16:  # only the cache differs from `llm`'s
        assert f16.kv_cache_dtype == torch.float16 and f16.dtype == torch.float32
        assert all(k.dtype == v.dtype == torch.float16 for k, v in f16.engine.runner.kv_caches)
        got = f16.chat(FRANCE, params)
        history = [*FRANCE, {"role": "assistant", "content": got.text}, {"role": "user", "content": "And of Italy?"}]
        assert f16.chat(history, SamplingParams(max_tokens=8, temperature=0)).usage.cached_tokens >= 32
        assert f16.runner_timings()["fused_steps"] > 0
        wait_idle_and_check(f16)
    assert_first_divergence_agrees(got, expected)


def test_bfloat16_engine_answers_like_float32(bundled_gguf, llm):
    """Greedy tokens agree under the first-divergence rule (DESIGN.md), with each engine's own top-5."""
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=5, ignore_eos=True)
    expected = llm.chat(FRANCE, params)
    with LLM(str(bundled_gguf), dtype="bfloat16", activations="float", kv_cache_tokens=2048, progress=False) as bf16:
        assert bf16.dtype == torch.bfloat16 and bf16.model.norm.weight.dtype == torch.bfloat16
        got = bf16.chat(FRANCE, params)
        wait_idle_and_check(bf16)
    assert_first_divergence_agrees(got, expected)
