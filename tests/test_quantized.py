"""Weights kept quantized: exact repacking of GGML blocks, the int4/int8 kernels against
dequantized matmuls, loading in every --weights form, and the option's errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from kvserve import LLM, SamplingParams
from kvserve.errors import InvalidRequestError
from kvserve.layers.quantized import (
    Int4Groups,
    Int4Linear,
    Int4QuadsLinear,
    Int8Embedding,
    Int8GroupLinear,
    Int8Linear,
    int8_groups_from_float,
)
from kvserve.weights import plan
from kvserve.weights.dequant import dequantize, int4_groups, q8_0_groups
from kvserve.weights.loader import load_model, weight_summary
from kvserve.weights.plan import resolve_activations, resolve_weights
from tests.conftest import make_tiny_llama, wait_idle_and_check
from tests.test_gguf import _logits, quantize_q6_k, random_blocks, write_llama_gguf

pytestmark = pytest.mark.threaded  # the C++ kernels' splits over threads stay tested under xdist

T = GGMLQuantizationType
# Dimensions the int4 kernel takes whole (outputs in 16s, inputs in groups of 32).
INT4_FRIENDLY = dict(hidden_size=64, intermediate_size=128, vocab_size=320)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q4_K], ids=lambda t: t.name)
def test_int4_groups_reproduce_the_dequantized_values(qtype):
    rng = np.random.default_rng(int(qtype))
    block_elements = GGML_QUANT_SIZES[qtype][0]
    rows, blocks_per_row = 16, 256 // block_elements * 2
    raw = torch.from_numpy(random_blocks(qtype, rows * blocks_per_row, rng).reshape(rows, -1).copy())
    expected = dequantize(raw, qtype, block_elements * blocks_per_row)
    groups = Int4Groups(*int4_groups(raw, qtype))
    assert groups.codes.dtype == torch.uint8 and int(groups.codes.max()) <= 15
    assert groups.codes.shape == expected.shape and groups.scales.shape == (rows, expected.shape[1] // 32)
    got = groups.dequantize()
    if qtype == T.Q4_0:  # d * (q - 8) versus d * q - 8d: equal up to float rounding
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6 * float(expected.abs().max()))
    else:
        assert torch.equal(got, expected)


def test_q8_0_groups_reproduce_the_dequantized_values():
    raw = torch.from_numpy(random_blocks(T.Q8_0, 8 * 6, np.random.default_rng(3)).reshape(8, -1).copy())
    codes, scales = q8_0_groups(raw)
    embedding = Int8Embedding(codes, scales, torch.float32)
    ids = torch.tensor([7, 0, 3, 3])
    assert torch.equal(embedding(ids), dequantize(raw, T.Q8_0, 192)[ids])


def _random_groups(rows: int, cols: int, seed: int) -> Int4Groups:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, cols), generator=g, dtype=torch.uint8)
    scales = torch.rand(rows, cols // 32, generator=g) * 0.1 + 0.01
    mins = -torch.rand(rows, cols // 32, generator=g)
    return Int4Groups(codes, scales, mins)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_int4_linear_equals_a_matmul_with_the_dequantized_weight(dtype):
    groups = _random_groups(48, 96, seed=1)
    bias = torch.randn(48)
    layer = Int4Linear(groups, dtype, bias)
    x = torch.randn(2, 5, 96)
    expected = x @ groups.dequantize().T + bias  # [2, 5, 48]
    got = layer(x.to(dtype)).float()
    assert got.shape == (2, 5, 48)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2 * float(expected.abs().max())
    assert (got - expected).abs().max().item() <= tolerance
    # a wrong zero point (the kernel's "- 8" convention ignored) would be caught
    assert (Int4Linear(Int4Groups(groups.codes, groups.scales, groups.mins - 8 * groups.scales), dtype)(x.to(dtype))
            .float() + bias - expected).abs().max().item() > 10 * tolerance  # fmt: skip


def test_int8_linear_is_within_its_rounding_of_the_float_matmul():
    weight = torch.randn(40, 72)
    layer = Int8Linear(weight, torch.float32)
    x = torch.randn(6, 72)
    step = weight.abs().amax(1) / 127  # one rounding step per output row
    bound = (x.abs().sum(1, keepdim=True) * step[None, :] / 2) + 1e-4  # |x| . |error| <= sum|x| * step/2
    assert ((layer(x) - x @ weight.T).abs() <= bound).all()
    dequantized = layer.weight_int8.float() * layer.scales[:, None]
    torch.testing.assert_close(layer(x), x @ dequantized.T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 3, 6, 13, 16, 17, 40, 64, 300], ids=lambda n: f"{n}-rows")
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "pure-torch"])
def test_int8_group_linear_equals_the_dequantized_matmul(rows, compiled, monkeypatch):
    # 83 output rows: the kernel's tiles of code rows and of x rows both end in a partial tile, and
    # so do its panels of code rows (16 to 64 rows of x, in row tiles of 6 ending in 4 or 5 rows);
    # 300 rows is past FEW_ROWS, the dequantized GEMM.
    if not compiled:
        monkeypatch.setenv("KVSERVE_FUSED_DECODE", "0")
    assert 64 < Int8GroupLinear.FEW_ROWS == 256 < 300
    codes, scales = int8_groups_from_float(torch.randn(83, 96))
    layer = Int8GroupLinear(codes, scales, torch.float32)
    x = torch.randn(rows, 96)
    expected = x @ (codes.view(83, 3, 32).float() * scales[..., None]).view(83, 96).T
    assert (layer(x) - expected).abs().max().item() <= 1e-4
    # bfloat16 inputs: only the inputs are rounded; the logits come out in float32 from every path
    # (the C++ kernels and the dequantized GEMM alike), not rounded to bfloat16's 8-bit significand.
    x_bf16 = x.bfloat16()
    bf16 = Int8GroupLinear(codes, scales, torch.bfloat16)(x_bf16)
    expected_bf16 = x_bf16.double() @ (codes.view(83, 3, 32).double() * scales.double()[..., None]).view(83, 96).T
    assert bf16.dtype == torch.float32
    assert (bf16.double() - expected_bf16).abs().max().item() <= 1e-5 * expected_bf16.abs().max().item()


@pytest.mark.parametrize("rows", [1, 3, 4, 16, 17, 40, 64], ids=lambda n: f"{n}-rows")
def test_int8_group_linear_sums_bfloat16_inputs_in_float32(rows):
    """bfloat16 inputs times int8 codes: every product is exact in float32 (8-bit significands), so
    whichever kernel serves (AMX tiles from 4 rows where the CPU has them, else the pairs of
    int8_pairs.cpp on AVX512-BF16, else the float kernels),
    the result is the float64 product of the same bfloat16 inputs up to float32 summation. 83 code
    rows and 40 input rows end in partial blocks of 16; 32 groups of inputs."""
    codes, scales = int8_groups_from_float(torch.randn(83, 1024, generator=torch.Generator().manual_seed(3)))
    x = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(rows)).bfloat16()
    weight = (codes.view(83, 32, 32).double() * scales.double()[..., None]).view(83, 1024)
    expected = x.double() @ weight.T
    got = Int8GroupLinear(codes, scales, torch.bfloat16)(x)
    assert got.dtype == torch.float32
    assert (got.double() - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()


def test_int4_from_float_round_trips_within_half_a_step():
    weight = torch.randn(32, 64)
    groups = Int4Groups.from_float(weight)
    error = (groups.dequantize() - weight).abs().reshape(32, 2, 32)
    assert (error <= groups.scales[..., None] / 2 + 1e-6).all()


def test_a_4bit_gguf_is_repacked_exactly(tmp_path):
    """Q4_1 linear layers kept as int4 give the same logits as the same file dequantized (float32 compute)."""
    pytest.importorskip("transformers")
    hf_model = make_tiny_llama(tmp_path / "hf", seed=21, **INT4_FRIENDLY)
    write_llama_gguf(tmp_path / "tiny-q4.gguf", hf_model, qtype=T.Q4_1)
    dequantized = load_model(tmp_path / "tiny-q4.gguf", progress=False, weights="float")
    kept = load_model(tmp_path / "tiny-q4.gguf", progress=False, weights="auto")
    assert weight_summary(kept)["layers"] == {"int4": 8, "int8 groups": 1, "int8 embedding": 1}  # 4 per layer
    assert isinstance(kept.layers[0].self_attn.qkv_proj, Int4Linear)
    assert kept.layers[0].self_attn.qkv_proj.scales_mins.dtype == torch.float16  # Q4_1 stores them so
    # The embedding and lm_head are re-quantized (4-bit rows to int8 groups); compare the layers only.
    with torch.inference_mode():
        dequantized.embed_tokens.weight.copy_(kept.embed_tokens(torch.arange(320)))
        head = kept.lm_head
        dequantized.lm_head.weight.copy_((head.codes.view(320, 2, 32) * head.scales[..., None]).view(320, 64))
    tokens = list(range(3, 300, 7))
    assert (_logits(kept, tokens) - _logits(dequantized, tokens)).abs().max().item() <= 1e-4
    assert weight_summary(kept)["bytes"] < 0.45 * weight_summary(dequantized)["bytes"]


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1], ids=lambda t: t.name)
def test_a_4bit_gguf_with_int8_inputs_holds_its_layers_as_4bit_quads(tmp_path, monkeypatch, extension, qtype):
    """With int8 inputs (AVX2 and up) Q4_0 and Q4_1 layers are held as 4-bit quads from load
    (Int4QuadsLinear): in the file's bytes for Q4_1, and every layer's output the bits of the same layer
    held for int4_mm (as on a CPU without the quads kernel), whatever the number of rows."""
    if not extension.int8_quads_usable():
        pytest.skip("the quads kernel needs AVX2, FMA and F16C")
    pytest.importorskip("transformers")
    from kvserve.weights import loader
    from kvserve.weights.footprint import footprint
    from kvserve.weights.gguf_file import GGUFFile

    hf_model = make_tiny_llama(tmp_path / "hf", seed=27, **INT4_FRIENDLY)
    path = tmp_path / "tiny-q4.gguf"
    write_llama_gguf(path, hf_model, qtype=qtype)
    monkeypatch.setattr(loader, "int4_quads_cpu", lambda: True)  # as without AMX (with it: int4_mm's tiles)
    held = load_model(path, progress=False, weights="auto", activations="int8")
    assert weight_summary(held)["layers"]["int4 quads (Q4_0, Q4_1, Q4_K)"] == 8  # 4 per layer
    monkeypatch.setattr(loader, "quads_cpu", lambda: False)
    packed = load_model(path, progress=False, weights="auto", activations="int8")
    assert weight_summary(packed)["layers"]["int4"] == 8
    names = [n for n, m in held.named_modules() if isinstance(m, Int4QuadsLinear)]
    assert len(names) == 8 and all(isinstance(packed.get_submodule(n), Int4Linear) for n in names)
    for name in names:
        layer = held.get_submodule(name)
        x = torch.randn(9, layer.in_features, generator=torch.Generator().manual_seed(len(name)))
        assert torch.equal(layer(x), packed.get_submodule(name)(x)), name
    if qtype == T.Q4_1:
        quads_bytes = sum(t.numel() * t.element_size() for n in names for t in held.get_submodule(n).buffers())
        stored = GGUFFile(path).stored()
        file_bytes = sum(size for name, kind, size, _ in stored if name.startswith("layers.") and kind == "Q4_1")
        assert quads_bytes == file_bytes
    assert footprint(held, GGUFFile(path).stored())["F32"]["memory_per_file"] == 1.0


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q5_0], ids=lambda t: t.name)
def test_a_q8_0_or_q5_0_gguf_keeps_its_codes_exact(tmp_path, qtype):
    """Q8_0 and Q5_0 are int8 codes times a scale per 32: every layer keeps them so (Int8GroupLinear),
    the embedding too, each equal to the gguf package's dequantization."""
    pytest.importorskip("transformers")
    hf_model = make_tiny_llama(tmp_path / "hf", seed=22, **INT4_FRIENDLY)
    write_llama_gguf(tmp_path / "tiny-q.gguf", hf_model, qtype=qtype)
    model = load_model(tmp_path / "tiny-q.gguf", progress=False, weights="auto")
    assert weight_summary(model)["layers"] == {"int8 groups": 9, "int8 embedding": 1}

    def dequantized(weight: torch.Tensor) -> np.ndarray:
        return quants.dequantize(quants.quantize(weight.detach().numpy(), qtype), qtype)

    assert np.array_equal(
        model.embed_tokens(torch.arange(320)).numpy(), dequantized(hf_model.model.embed_tokens.weight)
    )
    for ours, theirs in (
        (model.lm_head, hf_model.lm_head),
        (model.layers[1].mlp.down_proj, hf_model.model.layers[1].mlp.down_proj),
    ):
        rows, cols = ours.codes.shape
        got = (ours.codes.view(rows, -1, 32).float() * ours.scales[..., None]).view(rows, cols)
        assert np.array_equal(got.numpy(), dequantized(theirs.weight))


def test_a_q4_0_embedding_is_held_exactly(tmp_path):
    """Q4_0 is int8 codes (-8..7) times a scale per 32, as Q5_0 is: its embedding (and a tied head's
    codes) was rounded to int8 from the float values instead, up to a 32nd of a step off each (0.5 nats
    in the logits of a tied tiny model, in an outside test)."""
    pytest.importorskip("transformers")
    hf_model = make_tiny_llama(tmp_path / "hf", seed=26, **INT4_FRIENDLY)
    write_llama_gguf(tmp_path / "tiny-q4_0.gguf", hf_model, qtype=T.Q4_0)
    model = load_model(tmp_path / "tiny-q4_0.gguf", progress=False, weights="auto")
    embedding = hf_model.model.embed_tokens.weight.detach().numpy()
    stored = quants.dequantize(quants.quantize(embedding, T.Q4_0), T.Q4_0)
    assert np.array_equal(model.embed_tokens(torch.arange(320)).numpy(), stored)


def test_other_quantized_types_are_rounded_to_int8_groups(tmp_path):
    """Q5_1 (an offset per block: not int8 codes times a scale) is rounded to nearest, per group of 32,
    from its exact dequantization."""
    pytest.importorskip("transformers")
    hf_model = make_tiny_llama(tmp_path / "hf", seed=25, **INT4_FRIENDLY)
    write_llama_gguf(tmp_path / "tiny-q51.gguf", hf_model, qtype=T.Q5_1)
    model = load_model(tmp_path / "tiny-q51.gguf", progress=False, weights="auto")
    assert weight_summary(model)["layers"] == {"int8 groups": 9, "int8 embedding": 1}
    down = hf_model.model.layers[1].mlp.down_proj.weight.detach().numpy()
    stored = torch.from_numpy(quants.dequantize(quants.quantize(down, T.Q5_1), T.Q5_1))
    codes, scales = int8_groups_from_float(stored)
    assert torch.equal(model.layers[1].mlp.down_proj.codes, codes)
    assert torch.equal(model.layers[1].mlp.down_proj.scales, scales)


@pytest.mark.parametrize("mode", ["q4", "q8"])
def test_a_float_checkpoint_is_quantized_at_load(tmp_path, mode):
    """A safetensors folder with weights=q4/q8 equals the float model whose linear weights went
    through the same quantize-dequantize round trip (the kernels and packing are what is tested)."""
    pytest.importorskip("transformers")
    make_tiny_llama(tmp_path, seed=23, **INT4_FRIENDLY)
    quantized = load_model(tmp_path, progress=False, weights=mode)
    reference = load_model(tmp_path, progress=False, weights="float")
    form = {"q4": Int4Linear, "q8": Int8Linear}[mode]
    assert all(isinstance(m, form) for n, m in quantized.named_modules() if n.endswith("_proj"))
    assert isinstance(quantized.lm_head, {"q4": Int4Linear, "q8": Int8GroupLinear}[mode])
    with torch.inference_mode():
        for name, module in reference.named_modules():
            if isinstance(module, torch.nn.Linear):
                w = module.weight
                if name == "lm_head" and mode == "q8":
                    codes, scales = int8_groups_from_float(w)
                    module.weight.copy_((codes.view(320, 2, 32) * scales[..., None]).view(320, 64))
                elif mode == "q4":
                    module.weight.copy_(Int4Groups.from_float(w).dequantize())
                else:
                    int8 = Int8Linear(w, torch.float32)
                    module.weight.copy_(int8.weight_int8 * int8.scales[:, None])
        reference.embed_tokens.weight.copy_(quantized.embed_tokens(torch.arange(320)))
    tokens = list(range(5, 300, 9))
    assert (_logits(quantized, tokens) - _logits(reference, tokens)).abs().max().item() <= 1e-4


def test_layers_the_int4_kernel_cannot_take_fall_back_to_int8(tmp_path):
    pytest.importorskip("transformers")
    make_tiny_llama(tmp_path, seed=24)  # vocab 300 (not a multiple of 16), intermediate 112 (not of 32)
    model = load_model(tmp_path, progress=False, weights="q4")
    assert isinstance(model.lm_head, Int8Linear) and isinstance(model.layers[0].mlp.down_proj, Int8Linear)
    assert isinstance(model.layers[0].self_attn.qkv_proj, Int4Linear)


def test_weight_choices_and_their_errors():
    cpu, cuda, mps = torch.device("cpu"), torch.device("cuda"), torch.device("mps")
    assert resolve_weights("auto", None, cpu) == ("auto", None)
    assert resolve_weights("bf16", None, cpu) == ("float", torch.bfloat16)
    assert resolve_weights("f32", torch.float32, cpu) == ("float", torch.float32)
    # a GPU keeps quantized weights packed (layers/gpu.py), as the CPU does
    assert resolve_weights("auto", None, cuda) == ("auto", None)
    assert resolve_weights("q4", None, cuda) == ("q4", None)
    assert resolve_weights("auto", None, mps) == ("float", None)
    with pytest.raises(InvalidRequestError, match="weights must be one of") as info:
        resolve_weights("q3", None, cpu)
    assert info.value.param == "weights"
    with pytest.raises(InvalidRequestError, match="drop dtype"):
        resolve_weights("bf16", torch.float32, cpu)
    with pytest.raises(InvalidRequestError, match="CPU or CUDA kernels; on mps use weights=bf16 or auto"):
        resolve_weights("q4", None, mps)
    assert resolve_activations("int8", cpu, "auto") == "int8" and resolve_activations("float", cuda, "float") == "float"
    with pytest.raises(InvalidRequestError, match="activations must be one of") as info:
        resolve_activations("int4", cpu, "auto")
    assert info.value.param == "activations"
    assert resolve_activations("int8", cuda, "auto") == "int8"  # the GPU's int4 layers by dp4a
    with pytest.raises(InvalidRequestError, match="on mps use activations=float") as info:
        resolve_activations("int8", mps, "float")
    assert info.value.param == "activations"


@pytest.mark.parametrize("avx2", [True, False])
def test_auto_activations_are_int8_for_quantized_weights_on_an_avx2_cpu(monkeypatch, avx2):
    monkeypatch.setattr(plan, "_cpu_has_avx2", lambda: avx2)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_activations("auto", cpu, "auto") == ("int8" if avx2 else "float")
    assert resolve_activations("auto", cpu, "q4") == ("int8" if avx2 else "float")
    assert resolve_activations("auto", cpu, "float") == "float"  # nothing would quantize its inputs
    assert resolve_activations("auto", cuda, "float") == "float"
    assert resolve_activations("auto", cuda, "auto") == "float"  # int8 on a GPU only when asked for, as yet
    assert resolve_activations("float", cpu, "auto") == "float"  # asked for: kept
    monkeypatch.setenv("KVSERVE_KERNELS", "triton")  # the GPU's kernels on this CPU: the GPU's choice
    assert resolve_activations("auto", cpu, "auto") == "float"


def test_llm_reports_int8_activations_only_where_a_layer_takes_them(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(plan, "_cpu_has_avx2", lambda: True)  # auto resolves to int8 here
    with LLM(str(tiny_model_dir), session_db=False, progress=False) as llm:  # float32 safetensors, kept float
        assert llm.weights["activations"] == "float" and not any("int" in form for form in llm.weights["layers"])
        wait_idle_and_check(llm)
    with LLM(str(tiny_model_dir), weights="q4", session_db=False, progress=False) as llm:
        assert llm.weights["activations"] == "int8"
        quantized = [m for m in llm.model.modules() if isinstance(m, (Int4Linear, Int8GroupLinear))]
        assert quantized and all(m.int8_activations for m in quantized)
        wait_idle_and_check(llm)


@pytest.mark.parametrize(("qtype", "per_file"), [(T.Q4_1, 1.0), (T.Q8_0, 36 / 34), (T.Q5_0, 36 / 22)])
def test_weights_in_memory_per_stored_type(tmp_path, qtype, per_file):
    """footprint() (bench/compare.py's report) against the gguf package's reader and the forms' exact
    sizes: Q4_1 held as int4 with float16 scale and min (20 bytes per 32, as the file), Q8_0 and Q5_0 as
    int8 codes with a float32 scale (36 bytes per 32, against 34 and 22). Every byte of the model counted once."""
    pytest.importorskip("transformers")
    from gguf import GGUFReader

    from kvserve.weights.footprint import footprint
    from kvserve.weights.gguf_file import GGUFFile

    hf_model = make_tiny_llama(tmp_path / "hf", seed=26, **INT4_FRIENDLY)
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, hf_model, qtype=qtype)
    model = load_model(path, progress=False, weights="auto")
    report = footprint(model, GGUFFile(path).stored())
    reader = GGUFReader(path)
    file_bytes: dict[str, int] = {}
    for tensor in reader.tensors:
        file_bytes[tensor.tensor_type.name] = file_bytes.get(tensor.tensor_type.name, 0) + int(tensor.n_bytes)
    assert {kind: row["file_bytes"] for kind, row in report.items()} == file_bytes
    assert sum(row["memory_bytes"] for row in report.values()) == weight_summary(model)["bytes"]
    if qtype != T.Q4_1:
        assert report[qtype.name]["memory_per_file"] == round(per_file, 3)
    else:  # the 4-bit file's embedding and lm_head are rounded to int8 groups; the layers are held as stored
        layers = [m for m in model.modules() if isinstance(m, Int4Linear)]
        held = sum(t.numel() * t.element_size() for m in layers for t in m.buffers())
        kept = [t for t in reader.tensors if t.tensor_type == T.Q4_1 and t.name.startswith("blk.")]
        assert held == sum(int(t.n_bytes) for t in kept) * per_file
    assert report["F32"]["memory_per_file"] == 1.0  # the norms' weights


@pytest.mark.parametrize(("qtype", "bits"), [(T.Q8_0, 8), (T.Q5_0, 5)], ids=lambda v: getattr(v, "name", v))
def test_q8_0_and_q5_0_are_held_at_the_files_width_where_their_inputs_are_int8(tmp_path, qtype, bits):
    """With int8 inputs (AVX2 and up) every int8-group layer and the embedding are held as quads from load
    (layers/quads.py): Q5_0 at 5 bits and Q8_0 at 8, with the file's float16 scales, so the weights take
    the file's bytes (footprint 1.0 per type), and their codes are still the gguf package's."""
    pytest.importorskip("transformers")
    from kvserve.layers import quads
    from kvserve.weights.footprint import footprint
    from kvserve.weights.gguf_file import GGUFFile

    if not quads.quads_cpu():
        pytest.skip("the quads layout serves int8 inputs (AVX2 and up)")
    hf_model = make_tiny_llama(tmp_path / "hf", seed=27, **INT4_FRIENDLY)
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, hf_model, qtype=qtype)
    model = load_model(path, progress=False, weights="auto", activations="int8")
    report = footprint(model, GGUFFile(path).stored())
    assert report[qtype.name]["memory_per_file"] == 1.0
    layers = [m for m in model.modules() if isinstance(m, Int8GroupLinear)]
    assert len(layers) == 9 and model.embed_tokens.codes is None
    for held in (*layers, model.embed_tokens):
        assert held.codes is None and quads.code_bits(held.quads) == bits and held.quad_scales.dtype == torch.float16

    def dequantized(weight: torch.Tensor) -> np.ndarray:
        return quants.dequantize(quants.quantize(weight.detach().numpy(), qtype), qtype)

    assert np.array_equal(
        model.embed_tokens(torch.arange(320)).numpy(), dequantized(hf_model.model.embed_tokens.weight)
    )
    ours, theirs = model.layers[1].mlp.down_proj, hf_model.model.layers[1].mlp.down_proj
    codes, scales = quads.to_row_major(ours.quads, ours.quad_scales, ours.out_features)
    got = (codes.view(ours.out_features, -1, 32).float() * scales[..., None]).view(ours.out_features, -1)
    assert np.array_equal(got.numpy(), dequantized(theirs.weight))


def _smollm2_tokenizer_fields() -> dict:
    """SmolLM2's tokenizer as GGUF metadata, for an engine on a tiny model whose prompts are token ids:
    without its chat template, whose tokens are past the tiny model's 320 rows (the engine refuses a
    tokenizer whose own tokens the model has no row for; its BOS and EOS, ids 1 and 2, have one)."""
    from gguf import GGUFReader

    from kvserve.weights.registry import DEFAULT_MODEL, pull

    reader = GGUFReader(pull(DEFAULT_MODEL, progress=False))
    return {
        name: (field.contents(), field.types[0], field.types[1] if len(field.types) > 1 else None)
        for name, field in reader.fields.items()
        if name.startswith("tokenizer.") and name != "tokenizer.chat_template"
    }


def test_q6_k_layers_are_held_as_stored_where_their_inputs_are_int8(tmp_path, monkeypatch):
    """A Q6_K file with int8 inputs (AVX2 and up): every matrix, the lm_head too, is an Int6Linear in
    the file's own bytes whose weight is the gguf package's dequantization bit for bit; the fused layer
    loop takes them, and an engine serves greedy tokens equal to the module path's."""
    pytest.importorskip("transformers")
    from kvserve.kernels import ops
    from kvserve.layers import quads
    from kvserve.layers.fused_decode import FusedDecoder
    from kvserve.layers.quantized import Int6Linear
    from tests.simple_generate import stream_token_ids

    if not quads.quads_cpu():
        pytest.skip("Q6_K is held as stored where the quads kernel serves (int8 inputs, AVX2 and up)")
    hf_model = make_tiny_llama(tmp_path / "hf", seed=28, hidden_size=256, intermediate_size=256, vocab_size=320)
    path = tmp_path / "tiny-q6_k.gguf"
    from kvserve.llm import default_dtype

    fields = _smollm2_tokenizer_fields()
    write_llama_gguf(path, hf_model, qtype=T.Q6_K, fields=fields)

    dtype = default_dtype(torch.device("cpu"))  # the engine's below
    model = load_model(path, dtype, progress=False, weights="auto", activations="int8")
    assert weight_summary(model)["layers"] == {"int6 (Q6_K)": 9, "int8 embedding": 1}
    layers = [m for m in model.modules() if isinstance(m, Int6Linear)]
    held = sum(t.numel() * t.element_size() for m in layers for t in m.buffers())
    size = GGML_QUANT_SIZES[T.Q6_K]
    assert held == sum(m.out_features * m.in_features // size[0] * size[1] for m in layers)
    for ours, theirs in (
        (model.lm_head, hf_model.lm_head),
        (model.layers[1].mlp.down_proj, hf_model.model.layers[1].mlp.down_proj),
    ):
        stored = quants.dequantize(quantize_q6_k(theirs.weight.detach().numpy()), T.Q6_K)
        assert np.array_equal(quads.k6_dequantize(ours.quads, ours.k_scales).numpy(), stored)
    assert FusedDecoder.supports(model)
    with monkeypatch.context() as patch:  # the runner asks at its start, before the C++ kernels have loaded
        patch.setattr(ops, "available", lambda: False)
        assert FusedDecoder.supports(model)
    prompt = list(range(5, 45))
    expected = list(stream_token_ids(model, prompt, 8))
    with LLM(str(path), session_db=False, progress=False) as llm:
        assert any(isinstance(m, Int6Linear) for m in llm.model.modules())
        out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        assert out[0].token_ids == expected
        wait_idle_and_check(llm)


def test_a_tied_q6_k_head_shares_the_embeddings_table(tmp_path):
    """A tied Q6_K embedding and lm_head stay one table (the head reads the embedding's int8 codes), not a
    rounded embedding beside a second, 6-bit copy for the head; the other Q6_K matrices are held as stored."""
    pytest.importorskip("transformers")
    from kvserve.layers import quads

    if not quads.quads_cpu():
        pytest.skip("Q6_K is held as stored where the quads kernel serves (int8 inputs, AVX2 and up)")
    hf_model = make_tiny_llama(
        tmp_path / "hf", seed=29, hidden_size=256, intermediate_size=256, vocab_size=320, tie_word_embeddings=True
    )
    write_llama_gguf(tmp_path / "tied.gguf", hf_model, qtype=T.Q6_K)
    model = load_model(tmp_path / "tied.gguf", progress=False, weights="auto", activations="int8")
    assert weight_summary(model)["layers"] == {"int8 embedding": 1, "int6 (Q6_K)": 8, "int8 groups": 1}
    head, embedding = model.lm_head, model.embed_tokens
    assert embedding.codes is head.codes and embedding.quads is head.quads


@pytest.mark.parametrize("qtype", [T.Q5_1, T.Q5_K], ids=lambda t: t.name)
def test_q5_layers_are_held_at_their_width_where_their_inputs_are_int8(tmp_path, qtype):
    """A Q5_1 or Q5_K file with int8 inputs (AVX2 and up): every matrix, the lm_head too, is an
    Int5Linear at the file's width (Q5_K: 1.023x, its scales a byte each) whose weight is the gguf
    package's dequantization bit for bit; the fused layer loop takes them, and an engine serves greedy
    tokens the module path agrees with."""
    pytest.importorskip("transformers")

    from kvserve.layers import quads
    from kvserve.layers.fused_decode import FusedDecoder
    from kvserve.layers.quantized import Int5Linear
    from kvserve.llm import default_dtype
    from tests.test_gguf import quantize_q5_k

    if not quads.quads_cpu():
        pytest.skip("Q5_1 and Q5_K are held as stored where the quads kernel serves (int8 inputs, AVX2 and up)")
    hf_model = make_tiny_llama(tmp_path / "hf", seed=29, hidden_size=256, intermediate_size=256, vocab_size=320)
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    fields = _smollm2_tokenizer_fields()
    write_llama_gguf(path, hf_model, qtype=qtype, fields=fields)

    model = load_model(path, default_dtype(torch.device("cpu")), progress=False, weights="auto", activations="int8")
    assert weight_summary(model)["layers"] == {"int5 (Q5_1, Q5_K)": 9, "int8 embedding": 1}
    layers = [m for m in model.modules() if isinstance(m, Int5Linear)]
    held = sum(t.numel() * t.element_size() for m in layers for t in m.buffers())
    size = GGML_QUANT_SIZES[qtype]
    in_file = sum(m.out_features * m.in_features // size[0] * size[1] for m in layers)
    assert held == in_file if qtype == T.Q5_1 else held * 2816 == in_file * 2880
    for ours, theirs in (
        (model.lm_head, hf_model.lm_head),
        (model.layers[1].mlp.down_proj, hf_model.model.layers[1].mlp.down_proj),
    ):
        weight = theirs.weight.detach().numpy()
        stored = quantize_q5_k(weight) if qtype == T.Q5_K else quants.quantize(weight, qtype)
        assert ours.kind == qtype.name
        assert np.array_equal(quads.q5_dequantize(ours.quads, ours.q5_scales).numpy(), quants.dequantize(stored, qtype))
    assert FusedDecoder.supports(model)
    prompt = list(range(5, 45))
    with LLM(str(path), session_db=False, progress=False) as llm:
        assert any(isinstance(m, Int5Linear) for m in llm.model.modules())
        out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        assert llm.runner_timings()["fused_steps"] >= 7
        wait_idle_and_check(llm)
    # The layer loop and the module path round in different orders (test_fused_decode: within 10% of the
    # largest logit with int8 inputs), and this random model's best logits lie closer than that: each
    # token the engine chose is, on the module path given the same tokens before it, within that of the best.
    tokens = out[0].token_ids
    logits = _logits(model, prompt + tokens)[len(prompt) - 1 : -1]
    assert tokens[0] == int(logits[0].argmax())  # the prompt's last row: the same in both
    best = logits.max(-1).values
    assert (logits[torch.arange(len(tokens)), tokens] >= best - 0.1 * logits.abs().amax(-1)).all()
