"""The GPU path on a CPU: the model's forward over the Triton kernels (layers/gpu.py,
layers/attention_triton.py) and the CUDA graphs' bookkeeping (engine/cuda_graphs.py), through the
whole engine, with Triton's interpreter running the kernels (KVSERVE_KERNELS=triton). The capture here
records nothing and a replay runs the step over the static buffers (engine/cuda_graphs.eager_capture), so
everything but the capture itself is what a GPU runs: the buckets, the padding rows, the one-copy inputs,
the eager steps between graphs.

Checked against independent references: transformers' greedy tokens, each request's solo run (R7), a
run without graphs, the CPU path's 4-bit arithmetic (first-divergence rule), and the block pool after
every test. tests/test_cuda.py runs the same path on a real GPU, where there is one.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # before triton is imported: the kernels run in its interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
pytest.importorskip("transformers")

from kvserve import LLM, SamplingParams
from kvserve.engine.cuda_graphs import buckets_for
from kvserve.kernels.gpu import elementwise, matmul
from kvserve.layers.gpu import GpuInt4Linear, GpuInt8GroupLinear, GpuLinear, GpuRMSNorm
from tests.conftest import wait_idle_and_check
from tests.test_engine_bundled import assert_first_divergence_agrees

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU, tests/test_cuda.py runs this path")

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=6, temperature=0.9, seed=11, ignore_eos=True)
# distinct lengths: a decode-only batch pads to a bucket; the 70-token prompt spans several attention tiles
PROMPTS = ["hi", "the quick brown fox", "lorem ipsum dolor sit amet, consectetur", "x" * 70, "ab cd ef"]


@pytest.fixture(scope="module")
def triton_kernels():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVSERVE_KERNELS", "triton")
        yield


def _llm(model_dir, **kwargs) -> LLM:
    options = dict(device="cpu", dtype="float32", kv_cache_tokens=2048, max_num_seqs=8, progress=False)
    return LLM(str(model_dir), session_db=False, **{**options, **kwargs})


@pytest.fixture(scope="module")
def llm(tiny_model_dir, triton_kernels):
    with _llm(tiny_model_dir) as llm:
        yield llm


@pytest.fixture(autouse=True)
def no_leaks(request):
    yield
    if "llm" in request.fixturenames:
        wait_idle_and_check(request.getfixturevalue("llm"))


def test_gpu_forms_run_pytorchs_attention_metadata_too(tiny_model_dir, triton_kernels):
    """A model in its GPU forms driven with PyTorch's attention metadata (tests/simple_generate.py, as
    references and bench/numerics.py do) takes the two-kernel RoPE path and PyTorch's cache write: the
    same greedy tokens as through the engine."""
    from kvserve.weights.loader import load_model
    from tests.simple_generate import stream_token_ids

    model = load_model(tiny_model_dir, torch.float32, progress=False)
    assert model.layers[0].self_attn.rotate_and_store is not None
    ids = [5, 17, 99, 3]
    got = list(stream_token_ids(model, ids, 4))
    with _llm(tiny_model_dir) as llm:
        expected = llm.generate(ids, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        wait_idle_and_check(llm)
    assert got == expected.token_ids


def test_buckets_cover_every_batch_up_to_max_num_seqs():
    assert buckets_for(1) == [1]
    assert buckets_for(8) == [1, 2, 4, 8]
    assert buckets_for(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert buckets_for(50) == [1, 2, 4, 8, 16, 32, 48, 50]
    assert buckets_for(5) == [1, 2, 4, 5]


def test_the_model_runs_its_gpu_forms_and_decode_graphs(llm):
    runner = llm.engine.runner
    assert runner.triton and runner.fused is None and not runner.wants_fused
    layer = llm.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, GpuLinear) and isinstance(layer.attn_norm, GpuRMSNorm)
    assert layer.self_attn.rotate_and_store is not None  # RoPE and the KV write in one kernel
    assert isinstance(llm.model.lm_head, GpuLinear) and llm.model.lm_head.out_dtype == torch.float32
    assert runner.graphs is not None and runner.graphs.buckets == [1, 2, 4, 8] and llm.weights["cuda_graphs"]


def test_greedy_equals_transformers(llm, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    before = llm.runner_timings()["graph_steps"]
    got = [r.token_ids for r in llm.generate(PROMPTS[1:4], GREEDY)]  # prefills together, then decode graphs
    assert llm.runner_timings()["graph_steps"] > before
    for text, tokens in zip(PROMPTS[1:4], got, strict=True):
        ids = llm.tokenizer.encode(text)
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=GREEDY.max_tokens, do_sample=False, eos_token_id=None)
        assert out[0, len(ids) :].tolist() == tokens


def test_short_prompts_and_chunks_run_in_the_graphs_with_the_eager_steps_bits(tiny_model_dir, triton_kernels):
    """A step of at most the largest bucket's tokens runs in the graphs, a row a token: a lone prompt's
    prefill, two prompts' prefills together, a prompt in chunks of 8 beside another's decode steps. Each
    gives the tokens and logprobs of the same requests with every step eager (--cuda-graphs off), and
    a prompt longer than the largest bucket still prefills eagerly."""
    params = SamplingParams(max_tokens=5, temperature=0, logprobs=2, ignore_eos=True)
    seeded = SamplingParams(max_tokens=5, temperature=0.9, seed=3, ignore_eos=True)
    lone, pair, long = "lorem ipsum", ["hi", "ab cd ef"], "x" * 40  # 11, 2 + 8, 40 tokens; largest bucket 16

    def run(llm: LLM) -> tuple[list, list[int]]:
        eager, outputs = [], []
        for prompts, sampling in [(lone, params), (pair, params), (pair, seeded), (long, params)]:
            before = llm.runner_timings()
            outputs.append(llm.generate(prompts, sampling))
            eager.append(_eager_steps_since(llm, before))
        chunked = llm.engine.scheduler.max_num_batched_tokens
        llm.engine.scheduler.max_num_batched_tokens = 8  # the 40 x's in chunks, the decoding "hi" beside them
        try:
            before = llm.runner_timings()
            outputs.append(llm.generate(["hi", long], params))
            eager.append(_eager_steps_since(llm, before))
        finally:
            llm.engine.scheduler.max_num_batched_tokens = chunked
        wait_idle_and_check(llm)
        return [[(r.token_ids, r.logprobs) for r in (o if isinstance(o, list) else [o])] for o in outputs], eager

    with _llm(tiny_model_dir, max_num_seqs=16) as graphs:
        assert graphs.engine.runner.graphs.buckets[-1] == 16
        got, eager_steps = run(graphs)
    with _llm(tiny_model_dir, max_num_seqs=16, cuda_graphs=False) as plain:
        expected, _ = run(plain)
    assert got == expected
    assert eager_steps == [0, 0, 0, 1, 0]  # the 40-token prompt's prefill alone


def test_seeded_samples_batched_equal_solo_with_and_without_graphs(llm, tiny_model_dir):
    """(Greedy batches against solo runs: the preemption test below.)"""
    solo = [llm.generate(p, SEEDED).token_ids for p in PROMPTS]
    assert [r.token_ids for r in llm.generate(PROMPTS, SEEDED)] == solo
    with _llm(tiny_model_dir, cuda_graphs=False) as eager:
        assert eager.engine.runner.graphs is None
        assert [r.token_ids for r in eager.generate(PROMPTS, SEEDED)] == solo
        wait_idle_and_check(eager)


def test_preemption_prefix_hits_and_aborts_keep_every_token(llm, tiny_model_dir):
    """A pool of 8 blocks of 16 for three requests that need 2 each for their prompts (28 tokens) and a
    third as they decode (past 32): preempted requests recompute (eagerly) and decode again in graphs;
    a prompt behind a cached prefix attends over blocks it did not write; a stream left after two
    chunks gives its blocks back. (Short prompts and few tokens: each step runs in Triton's
    interpreter.)"""
    prompts = [f"{i} lorem ipsum dolor sit amet" for i in range(3)]
    params = SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)
    solo = [llm.generate(p, params).token_ids for p in prompts]
    with _llm(tiny_model_dir, kv_cache_tokens=8 * 16) as tight:
        assert [r.token_ids for r in tight.generate(prompts, params)] == solo
        assert tight.stats()["num_preemptions_total"] > 0
        hits = tight.stats()["prefix_cache_hit_tokens_total"]
        assert tight.generate(prompts[0], params).token_ids == solo[0]
        assert tight.generate(prompts[0], params).token_ids == solo[0]  # behind the blocks the first left cached
        assert tight.stats()["prefix_cache_hit_tokens_total"] > hits
        stream = tight.stream(prompts[1], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
        for i, _ in enumerate(stream):
            if i == 1:
                break
        del stream
        wait_idle_and_check(tight)


def test_four_bit_weights_packed_and_batched_like_solo(tiny_model_dir, triton_kernels):
    """The fourth report's case on the GPU path: 4-bit weights, concurrent requests, each equal to its
    solo run; and the tokens agree with the CPU's 4-bit kernels under the first-divergence rule."""
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=3, ignore_eos=True)
    with _llm(tiny_model_dir, weights="q4") as q4:
        assert isinstance(q4.model.layers[0].self_attn.qkv_proj, GpuInt4Linear)
        assert q4.weights["layers"]["int4"] > 0
        solo = [q4.generate(p, params) for p in PROMPTS]
        batched = q4.generate(PROMPTS, params)
        assert [r.token_ids for r in batched] == [r.token_ids for r in solo]
        wait_idle_and_check(q4)
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("KVSERVE_KERNELS")
        with _llm(tiny_model_dir, weights="q4", activations="float") as cpu:
            assert not cpu.engine.runner.triton
            expected = [cpu.generate(p, params) for p in PROMPTS]
            wait_idle_and_check(cpu)
    for got, want in zip(solo, expected, strict=True):
        assert_first_divergence_agrees(got, want)


def test_four_bit_weights_with_int8_inputs_batched_like_solo_and_like_the_cpu(tiny_model_dir, triton_kernels):
    """--activations int8 on the GPU path: the int4 layers quantize their inputs and sum in integers
    (int4_int8_matmul), each request's tokens batched are those of its solo run, and they agree with the
    CPU's int4 x int8 arithmetic under the first-divergence rule (the layers give the CPU's bits; the
    attention and norms are the GPU path's own)."""
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=3, ignore_eos=True)
    with _llm(tiny_model_dir, weights="q4", activations="int8") as q4:
        layer = q4.model.layers[0].self_attn.qkv_proj
        assert isinstance(layer, GpuInt4Linear) and layer.int8_activations
        assert q4.weights["activations"] == "int8"
        solo = [q4.generate(p, params) for p in PROMPTS]
        batched = q4.generate(PROMPTS, params)
        assert [r.token_ids for r in batched] == [r.token_ids for r in solo]
        # the norms hand qkv_proj, gate_up_proj and the (Q8_0) lm_head their inputs' int8 form: the same
        # bits as each layer's own quantizing, which then runs for o_proj alone (head_dim 16; down_proj's
        # 112 inputs keep it a float layer), and for the lm_head in an eager step, which takes the rows
        # that sample
        assert isinstance(q4.model.lm_head, GpuInt8GroupLinear) and q4.model.lm_head.int8_activations
        norms = [m for m in q4.model.modules() if isinstance(m, GpuRMSNorm) and m.int8_output]
        assert len(norms) == 2 * len(q4.model.layers) + 1
        calls = []
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(matmul, "quantize_int8", lambda x, own=matmul.quantize_int8: calls.append(x) or own(x))
            before = q4.runner_timings()
            handed = q4.generate(PROMPTS[1], params)
            eager_steps = _eager_steps_since(q4, before)
            assert len(calls) == len(q4.model.layers) * len(handed.token_ids) + eager_steps  # a forward per token
            for norm in norms:
                patch.setattr(norm, "int8_output", False)
            own = q4.generate(PROMPTS[1], params)
        assert handed.token_ids == own.token_ids == solo[1].token_ids and handed.logprobs == own.logprobs
        wait_idle_and_check(q4)
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("KVSERVE_KERNELS")
        with _llm(tiny_model_dir, weights="q4", activations="int8") as cpu:
            assert not cpu.engine.runner.triton and cpu.weights["activations"] == "int8"
            expected = [cpu.generate(p, params) for p in PROMPTS]
            wait_idle_and_check(cpu)
    for got, want in zip(solo, expected, strict=True):
        assert_first_divergence_agrees(got, want)


def _eager_steps_since(llm: LLM, before: dict) -> int:
    """Steps run without a CUDA graph since the runner's timings were `before`."""
    after = llm.runner_timings()
    return round((after["steps"] - before["steps"]) - (after["graph_steps"] - before["graph_steps"]))


def test_every_int4_layers_int8_inputs_come_from_the_kernel_before_it(tmp_path, triton_kernels):
    """With head_dim 32 and an MLP of 128, all four int4 layers of a decoder layer take their int8
    inputs from the kernel that made their input (the norms, the attention, the gated activation), and
    the lm_head from the final norm in a CUDA graph's step: no quantizing launch of their own, and the
    same tokens and logprobs as each layer quantizing its own."""
    from tests.conftest import make_tiny_llama, write_byte_tokenizer

    shapes = dict(num_attention_heads=2, num_key_value_heads=1, intermediate_size=128)
    make_tiny_llama(tmp_path, seed=7, initializer_range=0.2, **shapes)
    write_byte_tokenizer(tmp_path)
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=2, ignore_eos=True)
    with _llm(tmp_path, weights="q4", activations="int8") as q4:
        layers = q4.model.layers
        assert all(layer.self_attn.int8_output for layer in layers)
        calls = []
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(matmul, "quantize_int8", lambda x, own=matmul.quantize_int8: calls.append(x) or own(x))
            before = q4.runner_timings()
            handed = q4.generate(PROMPTS[1], params)
            assert len(calls) == _eager_steps_since(q4, before)  # the lm_head's, on the rows that sample
            for layer in layers:  # now each layer quantizes its own inputs
                patch.setattr(layer.attn_norm, "int8_output", False)
                patch.setattr(layer.ffn_norm, "int8_output", False)
                patch.setattr(layer.self_attn, "int8_output", False)
                patch.setattr(layer.mlp, "gated_activation", elementwise.gated_activation)
            calls.clear()
            before = q4.runner_timings()
            own = q4.generate(PROMPTS[1], params)
            # four a layer and forward, and the lm_head's in an eager step
            assert len(calls) == 4 * len(layers) * len(own.token_ids) + _eager_steps_since(q4, before)
        assert handed.token_ids == own.token_ids and handed.logprobs == own.logprobs
        wait_idle_and_check(q4)


def test_four_bit_bfloat16_models_take_packed_bfloat16_fmas_batched_like_solo(tiny_model_dir, triton_kernels):
    """The int4 kernel's packed bfloat16 FMAs, the default for a bfloat16 model: the layers keep
    bfloat16 scales and mins, and each request's tokens batched are those of its solo run (its numerics
    against a reference: test_triton_kernels.py). A float32 model keeps its scales as stored, and so does
    a bfloat16 model with int8 inputs."""
    with _llm(tiny_model_dir, weights="q4", dtype="bfloat16") as q4:
        layer = q4.model.layers[0].self_attn.qkv_proj
        assert layer.packed_bf16 and layer.scales.dtype == layer.mins.dtype == torch.bfloat16
        params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        solo = [q4.generate(p, params) for p in PROMPTS[:2]]
        batched = q4.generate(PROMPTS[:2], params)
        assert [r.token_ids for r in batched] == [r.token_ids for r in solo]
        wait_idle_and_check(q4)
    with _llm(tiny_model_dir, weights="q4") as q4:  # float32
        layer = q4.model.layers[0].self_attn.qkv_proj
        assert not layer.packed_bf16 and layer.scales.dtype != torch.bfloat16
        wait_idle_and_check(q4)
    # int8 inputs take the CPU's int4 x int8 arithmetic, which reads the scales as stored
    with _llm(tiny_model_dir, weights="q4", dtype="bfloat16", activations="int8") as q4:
        layer = q4.model.layers[0].self_attn.qkv_proj
        assert layer.int8_activations and not layer.packed_bf16 and layer.scales.dtype != torch.bfloat16
        wait_idle_and_check(q4)


@pytest.mark.parametrize("weights", ["q4", "q8"])
def test_programs_of_several_row_tiles_give_the_tokens_and_logprobs_of_a_tile_a_program(
    tiny_model_dir, triton_kernels, monkeypatch, weights
):
    """The int4 and int8 kernels' programs of up to 4 row tiles (`matmul.row_tiles_for`, here by the
    rows alone: the tiny model's layers have few programs) through the engine: a batch's prefill of 5
    prompts (up to 71 tokens) runs programs of 4 tiles, and every request's tokens and logprobs, alone
    and batched, are those of a program a tile."""
    monkeypatch.setattr(matmul, "ROW_TILE_PROGRAMS", 1)
    tiles = []
    launch = matmul._launch
    monkeypatch.setattr(
        matmul, "_launch", lambda kernel, *a, **kw: tiles.append(kw.get("ROW_TILES", 1)) or launch(kernel, *a, **kw)
    )
    params = SamplingParams(max_tokens=3, temperature=0, logprobs=2, ignore_eos=True)
    results = []
    for most in (4, 1):
        monkeypatch.setattr(matmul, "MAX_ROW_TILES", most)
        with _llm(tiny_model_dir, weights=weights, dtype="bfloat16", activations="float") as llm:
            kind = GpuInt4Linear if weights == "q4" else GpuInt8GroupLinear
            assert isinstance(llm.model.layers[0].mlp.gate_up_proj, kind)
            tiles.clear()
            batched = llm.generate(PROMPTS, params)
            assert max(tiles) == most, tiles
            alone = llm.generate(PROMPTS[3], params)  # the 70-token prompt's prefill alone: 5 tiles of 16
            results.append(([(r.token_ids, r.logprobs) for r in batched], (alone.token_ids, alone.logprobs)))
            wait_idle_and_check(llm)
    assert results[0] == results[1]
    assert results[0][1] == results[0][0][3]


@pytest.mark.parametrize("activations", ["float", "int8"])
def test_four_bit_codes_group_major_give_the_same_tokens_and_logprobs(
    tiny_model_dir, triton_kernels, monkeypatch, activations
):
    """GpuInt4Linear.group_major (the codes, scales and mins in matmul.to_group_major's layout, a candidate
    for the GPU's loads) through the engine: the tokens and logprobs of the row-major layout, batched."""
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=2, ignore_eos=True)
    results = []
    for group_major in (False, True):
        monkeypatch.setattr(GpuInt4Linear, "group_major", group_major)
        with _llm(tiny_model_dir, weights="q4", dtype="bfloat16", activations=activations) as q4:
            layer = q4.model.layers[0].mlp.gate_up_proj
            assert layer.group_major == group_major and layer.packed.dim() == (3 if group_major else 2)
            results.append([(r.token_ids, r.logprobs) for r in q4.generate(PROMPTS[:3], params)])
            wait_idle_and_check(q4)
    assert results[1] == results[0]


def test_the_code_words_over_the_threads_give_the_same_tokens_and_logprobs(tmp_path, triton_kernels, monkeypatch):
    """matmul.WORDS_IN_THREADS (a candidate, off) through the engine with int8 inputs, where every int4
    layer's K is a whole number of its splits (hidden 256, an MLP of 512): the words kernel runs them,
    alone, batched and behind a prefix hit, with the tokens and logprobs of the kernels before it."""
    from tests.conftest import make_tiny_llama, write_byte_tokenizer

    shapes = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    make_tiny_llama(tmp_path, seed=9, initializer_range=0.2, **shapes)
    write_byte_tokenizer(tmp_path)
    options = dict(weights="q4", activations="int8", batch_invariant=True)
    before = _alone_then_a_prefix_hit(tmp_path, **options)
    launched = _Launches(matmul._int4_int8_words_kernel)
    monkeypatch.setattr(matmul, "_int4_int8_words_kernel", launched)
    monkeypatch.setattr(matmul, "WORDS_IN_THREADS", 1024)
    assert _alone_then_a_prefix_hit(tmp_path, **options) == before
    assert launched.launches > 0


class _Launches:
    """Stands in for a Triton kernel, counting its launches and running it."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


FORMS = pytest.mark.parametrize(
    "weights, dtype, batch_invariant",
    [("auto", "float32", True), ("auto", "bfloat16", False), ("q4", "bfloat16", True), ("q8", "float32", True)],
    ids=["float", "float-cublas", "q4-bf16x2", "q8"],
)


def _alone_then_a_prefix_hit(model_dir, **options) -> list:
    """The tokens and logprobs of PROMPTS[3] alone, then of a batch of it extended (a prefix-cache hit on
    its first blocks) and another prompt, from a fresh LLM with `options`."""
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=2, ignore_eos=True)
    with _llm(model_dir, **options) as llm:
        alone = llm.generate(PROMPTS[3], params)
        batch = llm.generate([PROMPTS[3] + " and more", PROMPTS[1]], params)
        assert batch[0].usage.cached_tokens > 0 and batch[1].usage.cached_tokens == 0
        wait_idle_and_check(llm)
    return [(r.token_ids, r.logprobs) for r in (alone, *batch)]


def _with_and_without(model_dir, monkeypatch, kernel: str, switch: str, **options) -> None:
    """`_alone_then_a_prefix_hit` with an epilogue (layers/gpu's `switch` on) and without it: the same
    tokens and logprobs; elementwise's `kernel`, whose work the epilogue does, launched only without it
    (and without batch invariance, where cuBLAS multiplies and the kernel follows)."""
    from kvserve.layers import gpu

    launched = _Launches(getattr(elementwise, kernel))
    monkeypatch.setattr(elementwise, kernel, launched)
    fused = _alone_then_a_prefix_hit(model_dir, **options)
    assert (launched.launches > 0) == (not options["batch_invariant"])
    monkeypatch.setattr(gpu, switch, False)
    launches = launched.launches
    assert _alone_then_a_prefix_hit(model_dir, **options) == fused
    assert launched.launches > launches


@FORMS
def test_the_gate_up_projections_kernel_applies_the_activation_with_its_bits(
    tiny_model_dir, triton_kernels, monkeypatch, weights, dtype, batch_invariant
):
    """Each MLP's gate and up projection applies the gated activation in its matmul's kernel
    (layers/gpu.fuse_gated_activations: its rows interleaved), so a step launches no activation kernel
    (without batch invariance cuBLAS multiplies, unfused, and the activation's kernel follows); the tokens and
    logprobs, alone, batched and behind a prefix hit, are those of a fresh LLM that keeps [gate | up] and
    the activation's own kernel."""
    options = dict(weights=weights, dtype=dtype, batch_invariant=batch_invariant)
    with _llm(tiny_model_dir, **options) as llm:
        mlps = [layer.mlp for layer in llm.model.layers]
        kind = {"auto": GpuLinear, "q4": GpuInt4Linear, "q8": GpuInt8GroupLinear}[weights]
        assert all(isinstance(mlp.gate_up_proj, kind) for mlp in mlps)
        # (cuBLAS, without batch invariance, has no epilogue: the activation's kernel follows it)
        assert all(mlp.activation_in_gate_up == batch_invariant for mlp in mlps)
        assert ("silu gated" in repr(mlps[0].gate_up_proj)) == batch_invariant
        wait_idle_and_check(llm)
    _with_and_without(tiny_model_dir, monkeypatch, "_gated_kernel", "FUSE_GATED_ACTIVATIONS", **options)


@pytest.mark.parametrize(
    "weights, dtype, batch_invariant, activations",
    [*((*form, "auto") for form in FORMS.args[1]), ("q4", "float32", True, "int8")],
    ids=[*FORMS.kwargs["ids"], "q4-int8"],
)
def test_the_norms_in_the_matmuls_prologues_give_the_tokens_and_logprobs_of_their_kernel(
    tiny_model_dir, triton_kernels, monkeypatch, weights, dtype, batch_invariant, activations
):
    """With FUSE_NORMS each decoder layer's two norms hand up to NORM_IN_MATMUL_ROWS rows to the q/k/v and
    gate/up matmuls, which normalize them in their own kernels (kernels/gpu/norm.NormedRows): the tokens and
    logprobs, alone, batched and behind a prefix hit (whose few new rows take that path in a prefill too),
    are those of a fresh LLM with the norm's kernel, which then runs fewer times. Not through cuBLAS (no
    batch invariance), nor where the norm makes int8 inputs: there nothing changes."""
    from kvserve.kernels.gpu import norm
    from kvserve.layers import gpu

    options = dict(weights=weights, dtype=dtype, batch_invariant=batch_invariant, activations=activations)
    fusable = batch_invariant and activations != "int8"
    launched = _Launches(norm._rms_norm_kernel)
    monkeypatch.setattr(norm, "_rms_norm_kernel", launched)
    monkeypatch.setattr(gpu, "FUSE_NORMS", True)
    with _llm(tiny_model_dir, **options) as llm:
        layers = llm.model.layers
        assert all(layer.attn_norm.into_matmul == layer.ffn_norm.into_matmul == fusable for layer in layers)
        assert not llm.model.norm.into_matmul  # (the final norm's rows are picked before the lm_head)
        wait_idle_and_check(llm)
    launched.launches = 0
    fused = _alone_then_a_prefix_hit(tiny_model_dir, **options)
    launches = launched.launches
    monkeypatch.setattr(gpu, "FUSE_NORMS", False)
    launched.launches = 0
    assert _alone_then_a_prefix_hit(tiny_model_dir, **options) == fused
    # each LLM starts alike (its warm-up as well), so the counts differ by the calls handed to the matmuls
    assert (launched.launches > launches) == fusable and launched.launches >= launches, (launches, launched.launches)


def test_int8_inputs_and_the_switches_off_keep_the_activations_and_ropes_kernels(
    tiny_model_dir, triton_kernels, monkeypatch
):
    """With int8 inputs the gate and up projection keeps [gate | up] and the activation's kernel runs (it
    makes down_proj's int8 form; the int8-input kernels have RoPE's epilogue only); with FUSE_GATED_ACTIVATIONS
    and FUSE_ROPE off, the gate and up and the q/k/v projections keep the checkpoint's row order and the
    activation's and RoPE's kernels run. (PyTorch's int4 kernel, on a GPU only, keeps both: layers/gpu.
    _has_epilogues.)"""
    from kvserve.layers import gpu

    def fused(llm, gated: bool, rope: bool):
        for layer in llm.model.layers:
            assert layer.mlp.activation_in_gate_up == gated == (layer.mlp.gate_up_proj.activation is not None)
            assert (layer.self_attn.qkv_rope is not None) == rope == (layer.self_attn.qkv_proj.rope_heads is not None)
        wait_idle_and_check(llm)

    params = SamplingParams(max_tokens=3, temperature=0, logprobs=2, ignore_eos=True)
    with _llm(tiny_model_dir, weights="q4", activations="int8") as q4:
        fused(q4, gated=False, rope=True)
        expected = [(r.token_ids, r.logprobs) for r in q4.generate(PROMPTS[:2], params)]
    with _llm(tiny_model_dir, weights="q4") as q4:  # fused at load, then int8 inputs: the activation's undone
        fused(q4, gated=True, rope=True)
        q4.engine.call(lambda: gpu.set_int8_inputs(q4.model, True))
        fused(q4, gated=False, rope=True)
        assert [(r.token_ids, r.logprobs) for r in q4.generate(PROMPTS[:2], params)] == expected
    monkeypatch.setattr(gpu, "FUSE_GATED_ACTIVATIONS", False)
    monkeypatch.setattr(gpu, "FUSE_ROPE", False)
    with _llm(tiny_model_dir) as llm:
        fused(llm, gated=False, rope=False)


@pytest.mark.parametrize(
    "weights, dtype, batch_invariant, activations",
    [
        ("auto", "float32", True, "auto"),
        ("auto", "bfloat16", False, "auto"),
        ("q4", "bfloat16", True, "auto"),
        ("q8", "float32", True, "auto"),
        ("q4", "float32", True, "int8"),
    ],
    ids=["float", "float-cublas", "q4-bf16x2", "q8", "q4-int8"],
)
def test_the_qkv_projections_kernel_applies_rope_and_writes_the_cache_with_their_bits(
    tiny_model_dir, triton_kernels, monkeypatch, weights, dtype, batch_invariant, activations
):
    """Each attention's q/k/v projection rotates q and k and writes k and v into the KV cache in its
    matmul's epilogue (layers/gpu.fuse_rope_into_qkv: q's and k's rows paired), so a step launches no RoPE
    kernel (without batch invariance cuBLAS multiplies, unfused, and the RoPE kernel follows); the tokens and
    logprobs, alone, batched and behind a prefix hit (keys and values the epilogue wrote), are those of a
    fresh LLM that keeps the checkpoint's row order and the RoPE kernel. With float and int8 inputs."""
    options = dict(weights=weights, dtype=dtype, batch_invariant=batch_invariant, activations=activations)
    with _llm(tiny_model_dir, **options) as llm:
        attns = [layer.self_attn for layer in llm.model.layers]
        assert all((a.qkv_rope is not None) == (a.qkv_proj.rope_heads is not None) == batch_invariant for a in attns)
        assert ("RoPE and the KV cache's write" in repr(attns[0].qkv_proj)) == batch_invariant
        wait_idle_and_check(llm)
    _with_and_without(tiny_model_dir, monkeypatch, "_rotate_store_kernel", "FUSE_ROPE", **options)


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "gemma3", "phi3-longrope-partial", "mistral"])
def test_every_family_gives_the_same_tokens_with_the_epilogues_as_without(tmp_path, triton_kernels, monkeypatch, name):
    """Each family's differences through the epilogues: Qwen2's q/k/v bias, Gemma 3's GELU and sandwich
    norms, Mistral's head_dim and window (the q/k norms of Qwen3 and Gemma 3 and Phi-3's partial rotary
    keep the RoPE kernel): the tokens and logprobs of a fresh LLM without them."""
    from kvserve.layers import gpu
    from tests.conftest import write_byte_tokenizer
    from tests.test_architectures import make_model

    make_model(name, seed=3).save_pretrained(tmp_path, safe_serialization=True)
    write_byte_tokenizer(tmp_path)
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=2, ignore_eos=True)
    results = []
    for fused in (True, False):
        monkeypatch.setattr(gpu, "FUSE_GATED_ACTIVATIONS", fused)
        monkeypatch.setattr(gpu, "FUSE_ROPE", fused)
        with _llm(tmp_path) as llm:
            layer = llm.model.layers[0]
            assert layer.mlp.activation_in_gate_up == fused
            rope = fused and name in ("qwen2", "mistral")
            assert (layer.self_attn.qkv_rope is not None) == rope
            results.append([(r.token_ids, r.logprobs) for r in llm.generate(PROMPTS[:3], params)])
            wait_idle_and_check(llm)
    assert results[0] == results[1]


def test_the_persistent_step_gives_the_tokens_and_logprobs_of_a_kernel_a_phase(tmp_path, triton_kernels, monkeypatch):
    """With the persistent step on (layers/persistent_step.PERSISTENT_STEP), the one-row decode graph runs a 4-bit
    model's decoder layers as one kernel (kernels/gpu/persistent.py: the norms in the prologues, RoPE and the
    cache's write, the attention in two key splits merged by counters, down's K in two splits): the tokens and
    logprobs alone (at 80 and at 530 keys), batched and behind a prefix hit are those of a kernel a phase.
    Each kind of the layers' weights is then one buffer, the layers' tensors views of it; a model it cannot
    take keeps a kernel a phase."""
    from kvserve.kernels.gpu import persistent
    from kvserve.layers import persistent_step
    from tests.conftest import make_tiny_llama, write_byte_tokenizer

    shapes = dict(hidden_size=128, intermediate_size=640, num_attention_heads=4, num_key_value_heads=2)
    make_tiny_llama(tmp_path, seed=12, initializer_range=0.2, max_position_embeddings=1024, **shapes)
    write_byte_tokenizer(tmp_path)
    options = dict(weights="q4", dtype="bfloat16")
    launched = _Launches(persistent._decode_layers_kernel)
    monkeypatch.setattr(persistent, "_decode_layers_kernel", launched)
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=2, ignore_eos=True)

    def runs() -> list:  # and a lone request past the first key split (512 keys)
        with _llm(tmp_path, **options) as llm:
            long = llm.generate("lorem ipsum " * 44, params)
            wait_idle_and_check(llm)
        return [(long.token_ids, long.logprobs), *_alone_then_a_prefix_hit(tmp_path, **options)]

    phases = runs()
    assert launched.launches == 0
    monkeypatch.setattr(persistent_step, "PERSISTENT_STEP", True)
    assert runs() == phases
    assert launched.launches >= 6  # the lone requests' decode steps
    with _llm(tmp_path, **options) as llm:
        step = llm.engine.runner.graphs.persistent
        layers = llm.model.layers
        assert step is not None and llm.engine.runner.graphs.covers([1], [80], [6])
        packed = [layer.mlp.down_proj.packed for layer in layers]
        assert all(p.data_ptr() == step.weights["down"][0][i].data_ptr() for i, p in enumerate(packed))
        assert step.norm_weights[1, 1].data_ptr() == layers[1].ffn_norm.weight.data_ptr()
        wait_idle_and_check(llm)
    with _llm(tmp_path, weights="q4") as llm:  # float32
        assert llm.engine.runner.graphs.persistent is None
        assert "bfloat16" in persistent_step.PersistentStep.unsupported(llm.model)
        wait_idle_and_check(llm)
