"""Batch invariance (R7): a request's tokens are the same bits whatever runs beside it.

Kernels: every row of a product computed in a batch of 1, 2, 5, 16, 33, 64 or 512 rows equals that
row computed in any other batch. Engine, on the bundled model in each configuration this CPU runs:
16 requests at once against each alone, seeded samples likewise, prompts behind a cached 256-token
prefix against no prefix cache, prompts prefilled in chunks, a tight KV pool that preempts and
recomputes, and a session's second turn against the same history sent statelessly. With structured
output (issue 34): 16 at once, half of them constrained by a grammar, against their solo runs.
"""

from __future__ import annotations

import threading

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.layers.quantized import Int4Groups, Int4Linear, Int8GroupLinear, float32_linear, int8_groups_from_float
from kvserve.llm import default_dtype
from kvserve.structured_output import StructuredOutput
from tests.conftest import wait_idle_and_check

pytestmark = pytest.mark.threaded  # the C++ kernels' splits over threads stay tested under xdist

ROWS = (1, 2, 5, 16, 33, 64, 512)


def assert_rows_invariant(layer, dtype: torch.dtype, in_features: int) -> None:
    x = torch.randn(max(ROWS), in_features, generator=torch.Generator().manual_seed(3)).to(dtype)
    full = layer(x)
    for rows in ROWS:
        part = layer(x[:rows])
        for i in range(rows):
            assert torch.equal(part[i], full[i]), f"row {i} of {rows} differs from the same row among {max(ROWS)}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("activations", ["float", "int8"])
def test_int4_rows_do_not_depend_on_the_batch(extension, dtype, activations):
    if activations == "int8" and not extension.int8_activations():
        pytest.skip("int8 activations need AVX2 with F16C and FMA")
    groups = Int4Groups.from_float(torch.randn(192, 320, generator=torch.Generator().manual_seed(1)))
    layer = Int4Linear(groups, dtype, int8_activations=activations == "int8")
    assert_rows_invariant(layer, dtype, 320)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("activations", ["float", "int8"])
def test_lm_head_rows_do_not_depend_on_the_batch(extension, dtype, activations):
    if activations == "int8" and not extension.int8_activations():
        pytest.skip("int8 activations need AVX2 with F16C and FMA")
    codes, scales = int8_groups_from_float(torch.randn(1000, 96, generator=torch.Generator().manual_seed(2)))
    layer = Int8GroupLinear(codes, scales, dtype)
    layer.int8_activations = activations == "int8"
    assert layer.takes_int8() == (activations == "int8")
    assert_rows_invariant(layer, dtype, 96)
    if activations == "int8":
        return
    linear = torch.nn.Linear(96, 1000, bias=False).to(dtype)
    assert_rows_invariant(lambda x: float32_linear(x, linear), dtype, 96)


def test_batch_invariance_can_be_turned_off_for_the_gemm(extension):
    """Off, many rows take the GEMM over the dequantized weight: the same values within rounding,
    not the same bits (which is why it is not the default)."""
    groups = Int4Groups.from_float(torch.randn(192, 320, generator=torch.Generator().manual_seed(1)))
    layer = Int4Linear(groups, torch.float32)
    x = torch.randn(100, 320, generator=torch.Generator().manual_seed(4))
    invariant = layer(x)
    layer.batch_invariant = False
    gemm = layer(x)
    assert torch.allclose(gemm, invariant, atol=1e-4) and not torch.equal(gemm, invariant)


# ----- the engine on the bundled model ------------------------------------------------------------
PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "List three uses of copper:",
]
PREFIX = " ".join(["In this report we study the behaviour of large language models under load."] * 18)
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
CONFIGS = {  # (dtype, activations, kv_cache_dtype)
    "bf16": ("bfloat16", "float", "auto"),
    "bf16-int8": ("bfloat16", "int8", "auto"),
    "f32": ("float32", "float", "auto"),
    "f32-int8": ("float32", "int8", "auto"),
    "bf16-f16kv": ("bfloat16", "float", "float16"),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def config(request, extension, bundled_gguf):
    dtype, activations, kv_cache_dtype = CONFIGS[request.param]
    if dtype == "bfloat16" and default_dtype(torch.device("cpu")) != torch.bfloat16:
        pytest.skip("this CPU has no native bfloat16")
    if activations == "int8" and not extension.int8_activations():
        pytest.skip("int8 activations need AVX2 with F16C and FMA")
    # on the CPU: the C++ path is what batch invariance is claimed for (CUDA runs the PyTorch forward)
    options = dict(dtype=dtype, activations=activations, kv_cache_dtype=kv_cache_dtype, device="cpu", progress=False)
    with LLM(str(bundled_gguf), session_db=False, **options) as llm:
        solo = [llm.generate(p, GREEDY).token_ids for p in PROMPTS]
        yield {"options": options, "llm": llm, "solo": solo, "gguf": str(bundled_gguf)}
        wait_idle_and_check(llm)


def at_once(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> list[list[int]]:
    """Each prompt from its own thread, released together."""
    out: list = [None] * len(prompts)
    barrier = threading.Barrier(len(prompts))

    def run(i: int) -> None:
        barrier.wait()
        out[i] = llm.generate(prompts[i], params[i]).token_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def sixteen(items: list) -> list:
    return [items[i % len(items)] for i in range(16)]


def test_sixteen_at_once_equal_their_solo_runs(config):
    llm = config["llm"]
    assert at_once(llm, sixteen(PROMPTS), [GREEDY] * 16) == sixteen(config["solo"])
    wait_idle_and_check(llm)


def test_seeded_samples_at_once_equal_their_solo_runs(config):
    llm = config["llm"]
    params = [SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95, seed=i, ignore_eos=True) for i in range(16)]
    params[3] = SamplingParams(max_tokens=16, temperature=1.0, top_k=40, min_p=0.05, seed=3, ignore_eos=True)
    solo = [llm.generate(p, s).token_ids for p, s in zip(sixteen(PROMPTS), params, strict=True)]
    assert at_once(llm, sixteen(PROMPTS), params) == solo
    wait_idle_and_check(llm)


ANSWER = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "maxLength": 40},
        "score": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["answer", "score"],
    "additionalProperties": False,
}


def test_sixteen_at_once_half_constrained_equal_their_solo_runs(config):
    """A grammar's mask is its own row's: the unconstrained requests keep their solo bits beside
    constrained ones, and each constrained one (greedy or seeded) gives its solo output."""
    llm = config["llm"]
    grammar = StructuredOutput.json_schema(ANSWER)
    kinds = [
        SamplingParams(max_tokens=16, temperature=0, structured_output=grammar),
        SamplingParams(max_tokens=16, temperature=0.8, seed=5, structured_output=grammar),
    ]
    prompts = sixteen(PROMPTS)
    params = [GREEDY if i % 2 == 0 else kinds[(i // 4) % 2] for i in range(16)]
    solo_constrained = {}
    for i in range(1, 16, 2):
        key = (prompts[i], (i // 4) % 2)
        if key not in solo_constrained:
            solo_constrained[key] = llm.generate(prompts[i], params[i]).token_ids
    solo = [config["solo"][i % 4] if i % 2 == 0 else solo_constrained[(prompts[i], (i // 4) % 2)] for i in range(16)]
    assert at_once(llm, prompts, params) == solo
    wait_idle_and_check(llm)


def test_prefix_hits_and_chunked_prefill_equal_whole_prompts_without_a_cache(config):
    llm = config["llm"]
    prompts = [f"{PREFIX} {p}" for p in PROMPTS]
    hits = [llm.generate(p, GREEDY) for p in prompts]
    assert sum(r.usage.cached_tokens for r in hits[1:]) >= 3 * 240, "the shared prefix was not a cache hit"
    with LLM(config["gguf"], session_db=False, enable_prefix_caching=False, **config["options"]) as whole:
        assert [whole.generate(p, GREEDY).token_ids for p in prompts] == [r.token_ids for r in hits]
        wait_idle_and_check(whole)
    with LLM(config["gguf"], session_db=False, max_num_batched_tokens=7, **config["options"]) as chunked:
        assert [chunked.generate(p, GREEDY).token_ids for p in PROMPTS] == config["solo"]
        wait_idle_and_check(chunked)


def test_preemption_and_recompute_leave_outputs_unchanged(config):
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    with LLM(config["gguf"], session_db=False, kv_cache_tokens=256, **config["options"]) as tight:
        outputs = at_once(tight, sixteen(PROMPTS)[:8], [params] * 8)
        assert tight.stats()["num_preemptions_total"] > 0, "the pool was not tight enough to preempt"
        wait_idle_and_check(tight)
    assert [o[:16] for o in outputs] == sixteen(config["solo"])[:8]


def test_a_session_turn_equals_the_same_history_sent_statelessly(config, tmp_path):
    with LLM(config["gguf"], session_db=tmp_path / "sessions.db", **config["options"]) as llm:
        with llm.session() as session:
            session.add_message("user", PROMPTS[0])
            first = session.generate(GREEDY)
            session.add_message("user", PROMPTS[1])
            second = session.generate(GREEDY)
        history = [
            {"role": "user", "content": PROMPTS[0]},
            {"role": "assistant", "content": first.text},
            {"role": "user", "content": PROMPTS[1]},
        ]
        assert second.usage.cached_tokens > 0
        assert second.token_ids == llm.chat(history, GREEDY).token_ids
        wait_idle_and_check(llm)
