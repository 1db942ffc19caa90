"""The engine on a CUDA device (skipped where there is none: CI has no GPU).

On a machine with a GPU, LLM() picks CUDA by default, so the rest of the suite runs there too; these
tests name the device and check what differs on it: the PyTorch forward (the fused decode step is
CPU-only) against transformers on the same GPU, batching against solo runs, aborts giving blocks
back, and the CPU-only weight formats refused with a typed error.
"""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, InvalidRequestError, SamplingParams
from tests.conftest import wait_idle_and_check

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
pytest.importorskip("transformers")

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    with LLM(
        str(tiny_model_dir), device="cuda", dtype="float32", kv_cache_tokens=4096, max_num_seqs=32, progress=False
    ) as llm:
        yield llm


@pytest.fixture(autouse=True)
def no_leaks(request):
    yield
    if "llm" in request.fixturenames:
        wait_idle_and_check(request.getfixturevalue("llm"))


def prompt(i: int, length: int) -> str:
    return (f"request {i}: " + "lorem ipsum dolor sit amet " * 40)[:length]


def test_engine_runs_on_the_gpu(llm):
    assert llm.device.type == "cuda"
    assert next(llm.model.parameters()).device.type == "cuda"


def test_greedy_equals_transformers_on_the_same_gpu(llm, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval().to("cuda")
    texts = [prompt(0, 5), prompt(1, 300), prompt(2, 40)]
    got = [r.token_ids for r in llm.generate(texts, GREEDY)]  # one batch: prefill and decode together
    for text, tokens in zip(texts, got, strict=True):
        ids = llm.tokenizer.encode(text)
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([ids], device="cuda"), max_new_tokens=GREEDY.max_tokens, do_sample=False, eos_token_id=None
            )
        assert out[0, len(ids) :].tolist() == tokens


@pytest.mark.parametrize("temperature", [0, 0.9], ids=["greedy", "seeded-sampling"])
def test_sixteen_batched_requests_equal_their_solo_runs(llm, temperature):
    params = SamplingParams(max_tokens=20, temperature=temperature, seed=7, ignore_eos=True)
    texts = [prompt(i, 4 + 17 * i) for i in range(16)]
    solo = [llm.generate(t, params).token_ids for t in texts]
    assert [r.token_ids for r in llm.generate(texts, params)] == solo


def test_breaking_out_of_a_stream_gives_the_blocks_back(llm):
    stream = llm.stream(prompt(3, 50), SamplingParams(max_tokens=500, temperature=0, ignore_eos=True))
    for i, _ in enumerate(stream):
        if i == 2:
            break
    del stream
    assert wait_idle_and_check(llm)["used"] == 0


@pytest.mark.parametrize("weights", ["q4", "q8"])
def test_cpu_weight_formats_are_refused_with_a_typed_error(tiny_model_dir, weights):
    with pytest.raises(InvalidRequestError, match="bf16 or auto"):
        LLM(str(tiny_model_dir), device="cuda", weights=weights, progress=False)


def test_two_pipeline_stages_on_the_gpu_give_one_process_tokens(llm, tiny_model_dir):
    """Issue 23 on CUDA: two local stages share the GPU, their activations cross in host memory over
    gloo; greedy and seeded tokens equal the one-process engine's, batched and after each other."""
    texts = [prompt(i, 4 + 37 * i) for i in range(8)]
    params = [GREEDY, SamplingParams(max_tokens=20, temperature=0.9, seed=7, ignore_eos=True)]
    with LLM(
        str(tiny_model_dir),
        device="cuda",
        dtype="float32",
        kv_cache_tokens=4096,
        max_num_seqs=32,
        progress=False,
        pipeline_parallel=2,
    ) as piped:
        assert piped.device.type == "cuda"
        for p in params:
            want = [r.token_ids for r in llm.generate(texts, p)]
            assert [r.token_ids for r in piped.generate(texts, p)] == want
            assert piped.generate(texts[5], p).token_ids == want[5]
        wait_idle_and_check(piped)
