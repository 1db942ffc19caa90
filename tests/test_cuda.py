"""The engine on a CUDA device (skipped where there is none: CI has no GPU; tests/test_gpu_path.py runs the
same path on a CPU through Triton's interpreter).

On a machine with a GPU, LLM() picks CUDA by default, so the rest of the suite runs there too; these
tests name the device and check what differs on it: the model's forward over the Triton kernels and the
decode step's CUDA graphs, against transformers on the same GPU; batching, preemption, prefix hits and
graphs on or off against solo runs (R7) in float32 and bfloat16; 4-bit weights packed on the device,
sixteen concurrent calls each equal to its solo run (the fourth failure report's case); aborts giving
blocks back; two pipeline stages.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.layers.gpu import GpuInt4Linear, GpuLinear
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


def test_engine_runs_on_the_gpu_through_triton_and_graphs(llm):
    assert llm.device.type == "cuda"
    assert next(llm.model.parameters()).device.type == "cuda"
    assert isinstance(llm.model.layers[0].mlp.gate_up_proj, GpuLinear)
    assert llm.engine.runner.graphs is not None and llm.weights["cuda_graphs"]
    before = llm.runner_timings()["graph_steps"]
    llm.generate(prompt(9, 20), GREEDY)
    assert llm.runner_timings()["graph_steps"] >= before + GREEDY.max_tokens - 1


def test_this_gpu_is_taken_by_default_and_its_launches_compile_for_its_capability(llm):
    """The GPU check (kernels.gpu.MIN_CAPABILITY) lets this GPU serve, unasked; the launch code's
    capability (the 64-row int4 x int8 tile or not: INT4_INT8_MMA_TILES_BLACKWELL) is the one Triton
    compiles for."""
    from triton.runtime import driver

    from kvserve.kernels.gpu import compiled_capability, gpu_problem
    from kvserve.llm import default_device

    assert gpu_problem(0) is None and default_device() == torch.device("cuda", 0)
    with torch.cuda.device(llm.device):
        assert compiled_capability(llm.device) == driver.active.get_current_target().arch >= 80


def test_greedy_agrees_with_transformers_on_the_same_gpu(llm, tiny_model_dir):
    """The first-divergence rule (DESIGN.md): Triton's float32 sums run in another order than cuBLAS's."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval().to("cuda")
    texts = [prompt(0, 5), prompt(1, 300), prompt(2, 40)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=5)
    for text, ours in zip(texts, llm.generate(texts, params), strict=True):  # one batch: prefills and decodes
        ids = llm.tokenizer.encode(text)
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([ids], device="cuda"),
                max_new_tokens=params.max_tokens,
                do_sample=False,
                eos_token_id=None,
                output_scores=True,
                return_dict_in_generate=True,
            )
        theirs = out.sequences[0, len(ids) :].tolist()
        divergence = next((i for i, (a, b) in enumerate(zip(ours.token_ids, theirs, strict=True)) if a != b), None)
        if divergence is not None:
            assert theirs[divergence] in [t for t, _ in ours.logprobs[divergence].top], (text, divergence)
            assert ours.token_ids[divergence] in out.scores[divergence][0].topk(5).indices.tolist(), (text, divergence)


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


def test_async_steps_queue_without_waiting_for_the_device(llm):
    """Async scheduling overlaps the host with the device only if no step waits for it: no blocking copy
    to the device, no read of a device value. Torch's sync debug mode makes such a call raise (and the
    request fail) in a decode graph step and in eager steps: prompts joining running requests, logprobs,
    seeded sampling with top-p, a logit bias; then penalties and min_tokens, whose requests take no steps
    ahead (the host needs each token first) and, while in flight, keep every other request from them."""
    assert llm.weights["async_scheduling"]
    texts = [prompt(i, 20 + 40 * i) for i in range(6)]
    params = [
        GREEDY,
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=3),
        SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logit_bias={5: 2.0}),
    ]
    held = [  # no steps ahead for these
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, repetition_penalty=1.2, frequency_penalty=0.5),
        SamplingParams(max_tokens=24, temperature=0.7, seed=3, min_tokens=12, logprobs=1),
    ]
    llm.generate(texts, params[2])  # kernels compiled, pinned memory cached
    before = llm.runner_timings()["ahead_rows"]
    torch.cuda.set_sync_debug_mode("error")
    try:
        with ThreadPoolExecutor(len(texts)) as pool:
            outs = list(pool.map(lambda i: llm.generate(texts[i], params[i % len(params)]), range(len(texts))))
            ahead = llm.runner_timings()["ahead_rows"]
            outs += list(pool.map(lambda i: llm.generate(texts[i], held[i % len(held)]), range(len(texts))))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [(len(o.token_ids), o.finish_reason) for o in outs[: len(texts)]] == [(24, "length")] * len(texts)
    assert all(len(o.token_ids) >= 12 for o in outs[len(texts) :])
    assert ahead > before


def test_penalties_on_the_gpu_are_the_cpus_bits():
    """The penalties' histories and their one gather and scatter (engine/penalties.py) on the GPU: the
    same float32 operations as on the CPU, so the same bits, step after step."""
    from kvserve.engine.penalties import Penalties
    from kvserve.engine.sampler import SamplingRow

    generator = torch.Generator().manual_seed(0)
    params = [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(repetition_penalty=0.7, frequency_penalty=0.5, presence_penalty=-0.3),
    ]
    rows = [
        SamplingRow(
            params[i % 2], torch.randint(0, 1000, (50 * i,), generator=generator).tolist(), [], None, (), key=f"{i}"
        )
        for i in range(6)
    ]
    on_gpu, on_cpu = Penalties(), Penalties()
    for step in range(5):
        for r in rows:
            r.output_token_ids.extend(torch.randint(0, 1000, (1 + step % 2,), generator=generator).tolist())
        logits = torch.randn(8, 1000, generator=generator) * 5
        gpu = logits.cuda()
        batch = [rows[0], None, *rows[1:5], None, rows[5]]  # rows 1 and 6 not penalized
        on_gpu.apply(gpu, batch, [0, 2, 3, 4, 5, 7])
        on_cpu.apply(logits, batch, [0, 2, 3, 4, 5, 7])
        assert torch.equal(gpu.cpu(), logits), step


@pytest.mark.parametrize("weights, activations", [("bf16", "auto"), ("q4", "auto"), ("q8", "auto"), ("q4", "int8")])
def test_batched_preempted_and_cached_requests_equal_their_solo_runs(tiny_model_dir, weights, activations):
    """R7 on the GPU in bfloat16 and with quantized weights (4-bit with float and with int8 inputs): 16
    at once, in a pool too small for them (preemption), again behind their cached prefixes, and with
    graphs off, each equal to its solo run."""
    texts = [prompt(i, 30 + 11 * i) for i in range(16)]
    # top_p: the sampler's cumulative sum runs row by row on CUDA (its scan differs for one row and several)
    params = [GREEDY, SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)]
    options = dict(device="cuda", weights=weights, activations=activations, max_num_seqs=16, progress=False)
    options["session_db"] = False
    with LLM(str(tiny_model_dir), kv_cache_tokens=4096, **options) as roomy:
        solo = [[roomy.generate(t, p).token_ids for t in texts] for p in params]
        for p, want in zip(params, solo, strict=True):
            assert [r.token_ids for r in roomy.generate(texts, p)] == want
            assert [r.token_ids for r in roomy.generate(texts, p)] == want  # behind cached prefixes
        assert roomy.stats()["prefix_cache_hit_tokens_total"] > 0
        wait_idle_and_check(roomy)
    with LLM(str(tiny_model_dir), kv_cache_tokens=16 * 24, **options) as tight:
        for p, want in zip(params, solo, strict=True):
            assert [r.token_ids for r in tight.generate(texts, p)] == want
        assert tight.stats()["num_preemptions_total"] > 0
        wait_idle_and_check(tight)
    with LLM(str(tiny_model_dir), kv_cache_tokens=4096, cuda_graphs=False, **options) as eager:
        for p, want in zip(params, solo, strict=True):
            assert [r.token_ids for r in eager.generate(texts, p)] == want
        wait_idle_and_check(eager)


@pytest.mark.parametrize("weights, activations", [("bf16", "auto"), ("q4", "auto")])  # (int8 inputs: the kernel test)
def test_the_projections_epilogues_give_the_tokens_and_logprobs_of_their_kernels(
    tiny_model_dir, monkeypatch, weights, activations
):
    """The gated activation and RoPE with the KV cache's write in the projections' epilogues (layers/gpu.
    FUSE_GATED_ACTIVATIONS, FUSE_ROPE), in the CUDA graphs, batched and behind cached prefixes: the tokens
    and logprobs of the same engine with the activation's and RoPE's own kernels."""
    from kvserve.layers import gpu

    texts = [prompt(i, 30 + 11 * i) for i in range(16)]
    params = SamplingParams(max_tokens=16, temperature=0, logprobs=2, ignore_eos=True)
    options = dict(device="cuda", weights=weights, activations=activations, max_num_seqs=16, progress=False)
    runs = []
    for fused in (True, False):
        monkeypatch.setattr(gpu, "FUSE_GATED_ACTIVATIONS", fused)
        monkeypatch.setattr(gpu, "FUSE_ROPE", fused)
        with LLM(str(tiny_model_dir), kv_cache_tokens=4096, session_db=False, **options) as llm:
            assert (llm.model.layers[0].self_attn.qkv_rope is not None) == fused
            runs.append([[(r.token_ids, r.logprobs) for r in llm.generate(texts, params)] for _ in range(2)])
            assert llm.stats()["prefix_cache_hit_tokens_total"] > 0
            wait_idle_and_check(llm)
    assert runs[0] == runs[1]


@pytest.mark.parametrize("weights", ["bf16", "q4"])
def test_the_norms_in_the_matmuls_give_the_tokens_and_logprobs_of_their_kernel(tiny_model_dir, monkeypatch, weights):
    """Each layer's two norms in the prologues of the matmuls after them (layers/gpu.FUSE_NORMS), in the
    CUDA graphs (one stream's rows), batched and behind cached prefixes: the tokens and logprobs of the same
    engine with the norm's own kernel."""
    from kvserve.layers import gpu

    texts = [prompt(i, 30 + 11 * i) for i in range(16)]
    params = SamplingParams(max_tokens=16, temperature=0, logprobs=2, ignore_eos=True)
    options = dict(device="cuda", weights=weights, max_num_seqs=16, progress=False)
    runs = []
    for fused in (True, False):
        monkeypatch.setattr(gpu, "FUSE_NORMS", fused)
        with LLM(str(tiny_model_dir), kv_cache_tokens=4096, session_db=False, **options) as llm:
            assert llm.model.layers[0].attn_norm.into_matmul == fused
            runs.append([[(r.token_ids, r.logprobs) for r in llm.generate(texts[:n], params)] for n in (1, 4, 16)])
            assert llm.stats()["prefix_cache_hit_tokens_total"] > 0
            wait_idle_and_check(llm)
    assert runs[0] == runs[1]


def test_the_persistent_step_gives_the_tokens_and_logprobs_of_a_kernel_a_phase(tmp_path, monkeypatch):
    """The one-row decode graph's layers in one kernel (layers/persistent_step.PERSISTENT_STEP, its grid
    barriers waiting on real programs here): one stream's tokens and logprobs, and 4 and 16 streams' (a kernel
    a phase, as without it), are those of the same engine without it (R7: a request alone or batched)."""
    from kvserve.layers import persistent_step
    from tests.conftest import make_tiny_llama, write_byte_tokenizer

    make_tiny_llama(tmp_path, seed=5, intermediate_size=128, max_position_embeddings=1024)
    write_byte_tokenizer(tmp_path)
    texts = [prompt(i, 30 + 11 * i) for i in range(16)]
    params = SamplingParams(max_tokens=16, temperature=0, logprobs=2, ignore_eos=True)
    options = dict(device="cuda", weights="q4", dtype="bfloat16", max_num_seqs=16, progress=False)
    runs = []
    for on in (True, False):
        monkeypatch.setattr(persistent_step, "PERSISTENT_STEP", on)
        with LLM(str(tmp_path), kv_cache_tokens=4096, session_db=False, **options) as llm:
            step = llm.engine.runner.graphs.persistent
            assert (step is not None) == on
            runs.append([[(r.token_ids, r.logprobs) for r in llm.generate(texts[:n], params)] for n in (1, 4, 16)])
            runs[-1].append([(r.token_ids, r.logprobs) for r in (llm.generate(t, params) for t in texts[:4])])
            assert step is None or step.work.timed_out.item() == 0  # no barrier gave up
            wait_idle_and_check(llm)
    assert runs[0] == runs[1]


def test_four_bit_model_serves_sixteen_concurrent_calls_like_solo(tiny_model_dir):
    """The fourth failure report: a 4-bit model on a GPU crashed under two concurrent calls. Here 16
    threads call at once; each gets the tokens it gets alone, and the weights stay packed."""
    texts = [prompt(i, 40 + 9 * i) for i in range(16)]
    with LLM(str(tiny_model_dir), device="cuda", weights="q4", progress=False, session_db=False) as q4:
        assert isinstance(q4.model.layers[0].self_attn.qkv_proj, GpuInt4Linear)
        solo = [q4.generate(t, GREEDY).token_ids for t in texts]
        with ThreadPoolExecutor(16) as pool:
            together = list(pool.map(lambda t: q4.generate(t, GREEDY).token_ids, texts))
        assert together == solo
        wait_idle_and_check(q4)


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


def _needs_pdl() -> None:
    from kvserve.kernels.gpu import supports_pdl

    if not supports_pdl(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs compute capability 9.0 (Hopper) or later")


def _pdl(mode: str, monkeypatch) -> None:
    """For the kernels launched from here on: "pdl", programmatic dependent launch on (KVSERVE_PDL=1);
    "prefetch", with the matmuls' weights prefetched into L2 before its wait (KVSERVE_PDL=prefetch);
    "plain", neither."""
    import kvserve.kernels.gpu

    monkeypatch.setattr(kvserve.kernels.gpu, "PDL", mode != "plain")
    monkeypatch.setattr(kvserve.kernels.gpu, "PREFETCH", mode == "prefetch")
    device = torch.device("cuda")
    assert kvserve.kernels.gpu.uses_pdl(device) == (mode != "plain")
    assert kvserve.kernels.gpu.prefetch_lines(device, 512) == (4 if mode == "prefetch" else 0)


@pytest.mark.parametrize("pdl", ["plain", "pdl", "prefetch"])
def test_the_last_programs_sums_hold_across_programs_and_graph_replays(pdl, monkeypatch):
    """The kernels whose last program of a tile adds the others' partial results (a matmul's K splits,
    attention's key splits, the sampler's pick) give the bits of the separate sum kernels, launch after
    launch and as a CUDA graph replayed on new inputs, and leave every counter at 0. The interpreter
    runs a grid's programs one after another, so only a GPU tests their order and visibility; with
    programmatic dependent launch, also each kernel's wait for the one before it (and the matmuls' weights
    prefetched before it)."""
    from kvserve.kernels.gpu import attention, matmul, sample

    if pdl != "plain":
        _needs_pdl()
    _pdl(pdl, monkeypatch)

    device, bf16 = "cuda", torch.bfloat16
    generator = torch.Generator().manual_seed(0)

    def randn(*shape, dtype=bf16):
        return torch.randn(*shape, generator=generator).to(dtype).to(device)

    mine = matmul.split_counters(device), attention.attention_counters(device), sample.counters(device)
    codes = torch.randint(0, 16, (4096, 4096), generator=generator, dtype=torch.uint8)
    packed = matmul.pack_int4(codes).to(device)
    scales = (torch.rand(4096, 128, generator=generator) / 64).half().to(device)
    weight = randn(2048, 8192) / 64
    head = randn(49152, 4096) / 64  # reads the int4 matmul's output: each kernel waits for the one before
    cache = randn(64, 16, 8, 128)  # 64 blocks of 16: one sequence of 1,024 keys, two splits of 512
    tables = torch.arange(64, dtype=torch.int32, device=device).view(1, 64)
    positions = torch.tensor([64 * 16 - 1], dtype=torch.int32, device=device)
    zero = torch.zeros(1, dtype=torch.int32, device=device)

    def step(x, x_int4, q, logits, counted: bool):
        m, a, s = mine if counted else (None, None, None)
        int4 = matmul.int4_matmul(x_int4, packed, scales, scales, counters=m)
        chained = matmul.matmul(int4, head, out_dtype=torch.float32, counters=m)
        return (
            int4,
            matmul.matmul(x, weight, counters=m),
            attention.paged_attention(q, cache, cache, tables, positions, zero, zero, zero + 1, 0.08, 0, 2, counters=a),
            sample.pick(logits, s) if counted else logits.argmax(dim=-1),
            chained,
            sample.pick(chained, s) if counted else chained.argmax(dim=-1),
        )

    def inputs():
        return randn(3, 8192), randn(3, 4096), randn(1, 32, 128), randn(5, 49152, dtype=torch.float32)

    for _ in range(50):
        given = inputs()
        for got, want in zip(step(*given, counted=True), step(*given, counted=False), strict=True):
            assert torch.equal(got, want)
    assert not any(c.any() for c in mine)
    static = inputs()
    step(*static, counted=True)  # compiled before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step(*static, counted=True)
    for _ in range(50):
        for held, new in zip(static, inputs(), strict=True):
            held.copy_(new)
        graph.replay()
        for got, want in zip(outs, step(*static, counted=False), strict=True):
            assert torch.equal(got, want)
    torch.cuda.synchronize()
    assert not any(c.any() for c in mine)


@pytest.mark.parametrize("mode", ["pdl", "prefetch"])
@pytest.mark.parametrize("weights, activations", [("bf16", "auto"), ("q4", "int8")])
def test_programmatic_dependent_launch_gives_the_same_tokens(tiny_model_dir, weights, activations, mode, monkeypatch):
    """KVSERVE_PDL=1: each kernel's launch overlaps the end of the one before it, in the decode graphs and
    in eager steps. Every kernel waits for the one before it before it touches memory (=prefetch: but the
    matmuls' weights, which no kernel writes, prefetched into L2), so 16 requests at once, and each alone,
    give the tokens they give without it."""
    _needs_pdl()
    texts = [prompt(i, 30 + 11 * i) for i in range(16)]
    params = [GREEDY, SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)]
    options = dict(device="cuda", weights=weights, activations=activations, max_num_seqs=16, progress=False)
    with LLM(str(tiny_model_dir), session_db=False, **options) as plain:
        want = [[r.token_ids for r in plain.generate(texts, p)] for p in params]
        wait_idle_and_check(plain)
    _pdl(mode, monkeypatch)
    with LLM(str(tiny_model_dir), session_db=False, **options) as overlapped:
        for p, tokens in zip(params, want, strict=True):
            assert [r.token_ids for r in overlapped.generate(texts, p)] == tokens
            assert [overlapped.generate(t, p).token_ids for t in texts[:4]] == tokens[:4]
        wait_idle_and_check(overlapped)


def test_pytorchs_int4_kernel_computes_the_weights_it_was_given_with_each_rows_own_bits():
    """The tinygemm candidate (kernels/gpu/tinygemm.py) on a 1B qkv projection's shape: x times the
    weights `dequantized` says the kernel makes of the packed codes, scales and zeros (their order
    included), within its bfloat16 output's rounding; and each row's bits the same alone as among 3, 16,
    17 and 64 rows (R7: one configuration for every row count)."""
    from kvserve.kernels.gpu import tinygemm

    gen = torch.Generator(device="cuda").manual_seed(0)
    n, k = 3072, 2048
    codes = torch.randint(0, 16, (n, k), device="cuda", generator=gen, dtype=torch.uint8)
    scales = torch.rand(n, k // 32, device="cuda", generator=gen) * 0.02 + 0.001
    mins = -torch.rand(n, k // 32, device="cuda", generator=gen) * 0.1
    packed, scales_zeros = tinygemm.pack(codes, scales, mins)
    weight = tinygemm.dequantized(tinygemm.code_pairs(codes), scales_zeros)
    x = torch.randn(64, k, device="cuda", generator=gen).to(torch.bfloat16)
    out = tinygemm.matmul(x, packed, scales_zeros)
    want = x.float() @ weight.T
    assert out.dtype == torch.bfloat16 and out.shape == (64, n)
    assert (out.float() - want).abs().max() <= 2**-7 * want.abs().max()
    for rows in (slice(0, 3), slice(0, 16), slice(0, 17), slice(5, 6), slice(63, 64)):
        assert torch.equal(tinygemm.matmul(x[rows], packed, scales_zeros), out[rows]), rows


def test_pytorchs_int4_kernel_serves_sixteen_at_once_like_solo(tiny_model_dir, monkeypatch):
    """4-bit weights through PyTorch's int4 kernel (bench/gpu.py's `q4-tinygemm`): every 4-bit layer uses
    it, with float inputs even where int8 inputs are asked for (the int8 lm_head keeps them); 16 requests
    at once, again behind their cached prefixes, each give their solo run's tokens."""
    from kvserve.layers.gpu import GpuInt8GroupLinear

    monkeypatch.setattr(GpuInt4Linear, "tinygemm", True)
    texts = [prompt(i, 30 + 11 * i) for i in range(16)]
    options = dict(device="cuda", weights="q4", activations="int8", max_num_seqs=16, progress=False)
    with LLM(str(tiny_model_dir), session_db=False, **options) as q4:
        four_bit = [m for m in q4.model.modules() if isinstance(m, GpuInt4Linear)]
        assert four_bit and all(m.tinygemm and not m.int8_activations for m in four_bit)
        assert isinstance(q4.model.lm_head, GpuInt8GroupLinear) and q4.model.lm_head.int8_activations
        solo = [q4.generate(t, GREEDY).token_ids for t in texts]
        assert [r.token_ids for r in q4.generate(texts, GREEDY)] == solo
        assert [r.token_ids for r in q4.generate(texts, GREEDY)] == solo  # behind cached prefixes
        wait_idle_and_check(q4)
