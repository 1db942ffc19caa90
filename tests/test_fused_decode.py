"""The fused C++ decode step against the model's Python forward (the reference), the int4 kernels
(float or int8 inputs, dequantize-then-GEMM) against their references, and the attention groups'
cost bound."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.engine.kv_cache import allocate_kv_cache
from kvserve.layers import quantized
from kvserve.layers.attention import _partition, build_batch
from kvserve.layers.fused_decode import FusedDecoder
from kvserve.layers.quantized import Int4Groups, Int4Linear, Int8GroupLinear, int8_groups_from_float
from kvserve.weights.loader import load_model
from tests.conftest import make_tiny_llama, wait_idle_and_check

pytestmark = pytest.mark.threaded  # the C++ kernels' splits over threads stay tested under xdist

VARIANTS = {
    "gqa-q4": (dict(hidden_size=64, intermediate_size=128, vocab_size=320), "q4"),
    "gqa-q4-dequantized-gemm": (dict(hidden_size=64, intermediate_size=128, vocab_size=320), "q4"),
    "gqa-q4-int8-activations": (dict(hidden_size=64, intermediate_size=128, vocab_size=320), "q4"),
    "gqa-q8": (dict(hidden_size=64, intermediate_size=128, vocab_size=320), "q8"),
    "mha-tied-float": (dict(num_key_value_heads=4, tie_word_embeddings=True), "float"),
    # head_dim 24: prefill attention's fallback (PyTorch's SDPA); intermediate 100: SiLU's leftover lanes
    "mqa-bias-float": (dict(num_key_value_heads=1, attention_bias=True, head_dim=24, intermediate_size=100), "float"),
    # head_dim 80: attention's vector path (64 dimensions at a time on AVX2) and its leftover dimensions
    "gqa-head-dim-80-float": (dict(head_dim=80), "float"),
    "gqa-head-dim-80-float-bf16": (dict(head_dim=80), "float", torch.bfloat16),
    # KV caches of another dtype than the compute's (LLM's kv_cache_dtype)
    "gqa-q4-float16-cache": (
        dict(hidden_size=64, intermediate_size=128, vocab_size=320),
        "q4",
        torch.float32,
        torch.float16,
    ),
    "mha-tied-float-bfloat16-cache": (
        dict(num_key_value_heads=4, tie_word_embeddings=True),
        "float",
        torch.float32,
        torch.bfloat16,
    ),
    "gqa-head-dim-80-bf16-float16-cache": (dict(head_dim=80), "float", torch.bfloat16, torch.float16),
}
BLOCK_SIZE = 4


def _variant(name):
    """(config overrides, weights, compute dtype, KV cache dtype) of VARIANTS[name]."""
    overrides, weights, *dtypes = VARIANTS[name]
    dtype = dtypes[0] if dtypes else torch.float32
    return overrides, weights, dtype, dtypes[1] if len(dtypes) > 1 else dtype


def _prefilled(model, lengths, tables, seed, kv_dtype=torch.float32):
    """Prefill random prompts of `lengths` through the Python forward; return the KV pool."""
    kv = allocate_kv_cache(model.config, 64, BLOCK_SIZE, kv_dtype, "cpu")
    model.bind_kv_cache(kv)
    g = torch.Generator().manual_seed(seed)
    with torch.inference_mode():
        for length, table in zip(lengths, tables, strict=True):
            positions, metadata = build_batch([table], [0], [length], BLOCK_SIZE)
            model(torch.randint(0, 300, (length,), generator=g), positions, metadata)
    return kv


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fused_decode_step_equals_the_python_forward(tmp_path, extension, variant, monkeypatch):
    pytest.importorskip("transformers")
    overrides, weights, dtype, kv_dtype = _variant(variant)
    if variant.endswith("dequantized-gemm"):  # int4 layers as for a batch of many rows, float inputs
        monkeypatch.setattr(quantized, "INT4_FEW_ROWS", 0)
    activations = "int8" if variant.endswith("int8-activations") else "float"
    if activations == "int8" and not extension.int8_activations():
        pytest.skip("int8 activations need AVX2 with F16C and FMA")
    make_tiny_llama(tmp_path, seed=31, **overrides)
    model = load_model(tmp_path, dtype, progress=False, weights=weights, activations=activations)
    quantized.set_batch_invariant(model, not variant.endswith("dequantized-gemm"))
    assert FusedDecoder.supports(model)
    lengths = [9, 1, 30, 17]  # different contexts; blocks scattered and interleaved below
    tables = [[3, 40, 7], [12], [5, 20, 21, 22, 23, 24, 60, 61], [30, 31, 2, 33, 34]]
    kv = _prefilled(model, lengths, tables, seed=1, kv_dtype=kv_dtype)
    # Garbage where no sequence has a token (past each length in its blocks, and unused blocks):
    # the fused loop reads each sequence's own keys only, so the result stays finite.
    for k_cache, v_cache in kv:
        mask = torch.ones(64, BLOCK_SIZE, dtype=torch.bool)
        for table, length in zip(tables, lengths, strict=True):
            for pos in range(length):
                mask[table[pos // BLOCK_SIZE], pos % BLOCK_SIZE] = False
        k_cache[mask] = float("nan")
        v_cache[mask] = float("nan")
    snapshot = [(k.clone(), v.clone()) for k, v in kv]
    ids = torch.tensor([5, 77, 123, 250])
    positions, metadata = build_batch(tables, lengths, [1, 1, 1, 1], BLOCK_SIZE)
    fused = FusedDecoder(model)
    assert fused.int8_activations == (activations == "int8")
    width = max(len(t) for t in tables)
    with torch.inference_mode():
        got = fused.forward(
            ids,
            positions,
            metadata.slot_mapping,
            torch.tensor([t + [0] * (width - len(t)) for t in tables]),
            torch.tensor([n + 1 for n in lengths]),
        )
        fused_kv = [(k.clone(), v.clone()) for k, v in kv]
        clean = [(torch.nan_to_num(k, nan=0.0), torch.nan_to_num(v, nan=0.0)) for k, v in snapshot]
        for (k, v), (k0, v0) in zip(kv, clean, strict=True):
            k.copy_(k0)
            v.copy_(v0)
        expected = model(ids, positions, metadata)
    assert torch.isfinite(got).all()
    # bfloat16: the two paths round the same values, but sum in different orders (a few units in
    # the last place of bfloat16's 8-bit mantissa); float32 agrees to rounding.
    relative = 1e-5 if dtype == torch.float32 else 0.02
    if variant.endswith("int8-activations"):
        # Both paths quantize each int4 layer's input with the same kernel, but the inputs differ by
        # float rounding (sums in other orders), and where that moves a value across an int8 rounding
        # boundary the input changes by a whole step (max|x| / 127 of its group). On this random tiny
        # model, perturbing the embeddings by 1e-7 (relative) moves the Python forward's output by up
        # to 2.5% of its largest value; the kernel itself is checked exactly in the test further below.
        relative = 0.1
    assert (got - expected).float().abs().max().item() <= max(1e-4, relative * expected.float().abs().max().item())
    for (k, v), (k_ref, v_ref) in zip(fused_kv, kv, strict=True):  # the new K/V landed where Python puts them
        slots = metadata.slot_mapping
        for new, ref in (
            (k.flatten(0, 1)[slots], k_ref.flatten(0, 1)[slots]),
            (v.flatten(0, 1)[slots], v_ref.flatten(0, 1)[slots]),
        ):
            # A float16 cache rounds each value once: where the two paths' float32 values straddle a rounding
            # boundary, the stored values differ by one unit in float16's last place (with the random weights
            # of transformers 5.24, one K value of 0.0314 did), so that much is allowed per element.
            one_unit = ref.float().abs() * torch.finfo(ref.dtype).eps
            allowed = torch.clamp(one_unit, min=max(1e-5, relative * ref.float().abs().max().item()))
            assert ((new - ref).float().abs() <= allowed).all()


@pytest.mark.parametrize(
    "variant",
    ["gqa-q4", "gqa-q4-dequantized-gemm", "mqa-bias-float", "gqa-head-dim-80-float-bf16", "gqa-q4-float16-cache"],
)
def test_fused_prefill_of_fresh_prompts_equals_the_python_forward(tmp_path, extension, variant, monkeypatch):
    """Whole prompts of fresh sequences through the C++ layer loop: the hidden states and the K/V
    written equal the Python forward's. 300 tokens: attention's tasks of 32 positions and a partial
    one, keys in panels of 16 and a partial one (head_dim 16 and 80; 24 takes the SDPA fallback);
    a one-token prompt; blocks scattered."""
    pytest.importorskip("transformers")
    overrides, weights, dtype, kv_dtype = _variant(variant)
    if variant.endswith("dequantized-gemm"):
        monkeypatch.setattr(quantized, "INT4_FEW_ROWS", 0)
    make_tiny_llama(tmp_path, seed=32, **overrides)
    model = load_model(tmp_path, dtype, progress=False, weights=weights)
    quantized.set_batch_invariant(model, not variant.endswith("dequantized-gemm"))
    lengths = [300, 1, 37]
    tables = [list(range(100, 175)), [3], [40, 7, 12, 90, 91, 92, 93, 94, 95, 96]]
    ids = torch.randint(0, 300, (sum(lengths),), generator=torch.Generator().manual_seed(3))
    positions, metadata = build_batch(tables, [0, 0, 0], lengths, BLOCK_SIZE)
    results = []
    for fused in (True, False):
        kv = allocate_kv_cache(model.config, 200, BLOCK_SIZE, kv_dtype, "cpu")
        model.bind_kv_cache(kv)
        with torch.inference_mode():
            if fused:
                hidden = FusedDecoder(model).prefill(ids, positions, metadata.slot_mapping, [0, 300, 301, 338])
            else:
                hidden = model(ids, positions, metadata)
        results.append((hidden, kv))
    (got, got_kv), (expected, expected_kv) = results
    relative = 1e-5 if dtype == torch.float32 else 0.02
    if kv_dtype != dtype:
        # Prompts attend over their own K/V as computed, but the Python path reads the one-token
        # prompt's back from the cache (a decode group), rounded to float16 (2^-11 relative).
        relative = max(relative, 1e-3)
    assert (got - expected).float().abs().max().item() <= max(1e-4, relative * expected.float().abs().max().item())
    for (k, v), (k_ref, v_ref) in zip(got_kv, expected_kv, strict=True):
        for new, ref in ((k, k_ref), (v, v_ref)):
            # A float16 cache rounds each value once: where the two paths' float32 values straddle a rounding
            # boundary, the stored values differ by one unit in float16's last place (with the random weights
            # of transformers 5.24, one K value of 0.0314 did), so that much is allowed per element.
            one_unit = ref.float().abs() * torch.finfo(ref.dtype).eps
            allowed = torch.clamp(one_unit, min=max(1e-5, relative * ref.float().abs().max().item()))
            assert ((new - ref).float().abs() <= allowed).all()


@pytest.mark.parametrize("variant", ["gqa-q4", "gqa-q4-int8-activations", "gqa-head-dim-80-float-bf16"])
def test_a_mixed_step_through_the_layer_loop_equals_the_python_forward(tmp_path, extension, variant):
    """One step of a decode token, a chunk continuing a prompt and a fresh prompt, each token with
    its sequence's block table and attending up to its own position (the batch-invariant path every
    CPU step takes): hidden states and the K/V written equal the Python forward's."""
    pytest.importorskip("transformers")
    overrides, weights, dtype, kv_dtype = _variant(variant)
    activations = "int8" if variant.endswith("int8-activations") else "float"
    if activations == "int8" and not extension.int8_activations():
        pytest.skip("int8 activations need AVX2 with F16C and FMA")
    make_tiny_llama(tmp_path, seed=33, **overrides)
    model = load_model(tmp_path, dtype, progress=False, weights=weights, activations=activations)
    tables = [[3, 40, 7], [12, 5, 20, 21], [30, 31]]
    computed, new = [9, 8, 0], [1, 5, 6]
    prefilled = _prefilled(model, computed[:2], tables[:2], seed=2, kv_dtype=kv_dtype)
    ids = torch.randint(0, 300, (sum(new),), generator=torch.Generator().manual_seed(4))
    positions, metadata = build_batch(tables, computed, new, BLOCK_SIZE)
    width = max(len(t) for t in tables)
    token_tables = torch.tensor(
        [t + [0] * (width - len(t)) for t, n in zip(tables, new, strict=True) for _ in range(n)]
    )
    results = []
    for fused in (True, False):
        kv = [(k.clone(), v.clone()) for k, v in prefilled]
        model.bind_kv_cache(kv)
        with torch.inference_mode():
            if fused:
                hidden = FusedDecoder(model).forward(ids, positions, metadata.slot_mapping, token_tables, positions + 1)
            else:
                hidden = model(ids, positions, metadata)
        results.append((hidden, kv))
    (got, got_kv), (expected, expected_kv) = results
    relative = 1e-5 if dtype == torch.float32 else 0.02
    if activations == "int8":  # an input moved across an int8 rounding boundary (see the decode test above)
        relative = 0.1
    assert (got - expected).float().abs().max().item() <= max(1e-4, relative * expected.float().abs().max().item())
    for (k, v), (k_ref, v_ref) in zip(got_kv, expected_kv, strict=True):
        for written, ref in ((k, k_ref), (v, v_ref)):
            assert (written - ref).float().abs().max().item() <= max(1e-5, relative * ref.float().abs().max().item())


def test_the_engine_decodes_through_the_fused_step(tiny_model_dir, extension, monkeypatch):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = ["Hello there", "A longer prompt with more words in it, so its context differs", "x"]
    with LLM(tiny_model_dir, dtype="float32", session_db=False) as llm:
        assert llm.weights["mode"] == "auto" and llm.weights["layers"] == {"float32 linear": 9, "float32 embedding": 1}
        fused = [r.token_ids for r in llm.generate(prompts, params)]
        assert llm.runner_timings()["fused_steps"] > 0
        wait_idle_and_check(llm)
    monkeypatch.setenv("KVSERVE_FUSED_DECODE", "0")
    with LLM(tiny_model_dir, dtype="float32", session_db=False) as llm:
        python = [r.token_ids for r in llm.generate(prompts, params)]
        assert llm.runner_timings()["fused_steps"] == 0
        wait_idle_and_check(llm)
    assert fused == python


@pytest.mark.parametrize("half_scales", [True, False], ids=["float16-scales", "float32-scales"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_int4_paths_equal_the_dequantized_reference(extension, dtype, half_scales, monkeypatch):
    """int4_mm (every row count, batch-invariant), dequantize + GEMM (many rows, batch invariance off)
    and PyTorch's int4 kernel (layout unknown)
    all give x @ W.T + b of the float weight the int4 groups stand for, with the scales and mins
    kept as float16 (exact, as GGUF's Q4_1 stores them) or as float32 (not exact in float16)."""
    groups = Int4Groups.from_float(torch.randn(192, 96, generator=torch.Generator().manual_seed(5)))
    if half_scales:
        groups = Int4Groups(groups.codes, groups.scales.half().float(), groups.mins.half().float())
    bias = torch.randn(192)
    layer = Int4Linear(groups, dtype, bias)
    assert layer.scales_mins.dtype == (torch.float16 if half_scales else torch.float32)
    assert torch.equal(layer.scales_mins.float(), torch.stack((groups.scales, groups.mins), 1).transpose(0, 2))
    weight = groups.dequantize()
    assert quantized.int4_block_rows() in (32, 64)  # the packing layout check found PyTorch's layout
    for rows in (1, 5, 13, 40, 100):  # register tiles of every size, and both sides of INT4_FEW_ROWS
        x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)).to(dtype)
        expected = x.float() @ weight.T + bias.to(dtype).float()
        paths = {"int4_mm": layer(x).float()}  # batch-invariant: int4_mm for every row count
        layer.batch_invariant = False  # the GEMM over the dequantized weight past INT4_FEW_ROWS rows
        monkeypatch.setattr(quantized, "INT4_FEW_ROWS", 0)
        monkeypatch.setattr(quantized, "INT4_FEW_ROWS_AMX_BF16", 0)
        paths["dequantize + GEMM"] = layer(x).float()
        monkeypatch.setattr(quantized, "_int4_block", 0)  # an unknown layout: PyTorch's kernel
        paths["int4 kernel"] = layer(x).float()
        monkeypatch.undo()
        layer.batch_invariant = True
        tolerance = 1e-4 if dtype == torch.float32 else 0.02 * float(expected.abs().max())
        for name, got in paths.items():
            assert (got - expected).abs().max().item() <= tolerance, (rows, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_int4_mm_computes_a_row_the_same_whatever_rows_are_beside_it(extension, dtype):
    """int4_mm's row counts take different code paths (on AVX512-BF16 with bfloat16 inputs: one or
    two rows from registers, more in tiles of 6 rows over codes unpacked once per group; else tiles
    by row count), each summing a row's products in the same order: every row of a batch is the same
    bits as that row alone, and as the same row among any other number of rows."""
    groups = Int4Groups.from_float(torch.randn(192, 320, generator=torch.Generator().manual_seed(11)))
    layer = Int4Linear(groups, dtype)
    x = torch.randn(70, 320, generator=torch.Generator().manual_seed(12)).to(dtype)
    full = layer(x)
    for rows in (1, 2, 3, 5, 6, 7, 13, 64):
        assert torch.equal(layer(x[:rows]), full[:rows]), rows
    for i in (0, 1, 5, 37, 69):
        assert torch.equal(layer(x[i : i + 1]), full[i : i + 1]), i
        assert torch.equal(layer(x[i : i + 2])[:1], full[i : i + 1]), i


def _zero_a_group(x: torch.Tensor) -> None:
    """An all-zero group of inputs (d = 0) in x [rows, inputs]: the first row's first group, or with one
    group a row, the whole last row, beside rows that are not zero (none where x is that one row)."""
    rows, inputs = x.shape
    if inputs > 32:
        x[0, :32] = 0.0
    elif rows > 1:
        x[-1] = 0.0


def _int8_activation_reference(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """x' @ W.T in float64 for W = scale * codes + min per group of 32 and x' the inputs as llama.cpp's
    Q8_0 rounds them: per group of 32 inputs d = max|x| / 127, q = round(x / d) (nearest even),
    x' = d * q. Rounding moves each input by at most d / 2, so x' @ W.T is within sum over groups of
    d / 2 * sum(|w|) of x @ W.T; also returns that bound."""
    rows, k = x.shape
    xg = x.float().view(rows, k // 32, 32)
    d = xg.abs().amax(-1) / 127
    q = torch.round(xg * torch.where(d != 0, 1 / d, torch.zeros_like(d))[..., None])
    rounded = (d.double()[..., None] * q.double()).view(rows, k)
    weight = codes.double().view(-1, k // 32, 32) * scales.double()[..., None] + mins.double()[..., None]  # [N, G, 32]
    bound = (d.double()[..., None] / 2 * weight.abs().sum(-1).T).sum(1)
    return rounded @ weight.view(-1, k).T, bound


@pytest.mark.parametrize(
    ("half_scales", "inputs"), [(True, 320), (False, 320), (True, 288), (True, 32)], ids=lambda v: str(v)
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_int4_with_int8_activations_equals_its_integer_reference(extension, dtype, half_scales, inputs):
    """Int4Linear with its inputs quantized to int8 (an AVX2 CPU): against the products computed in
    float64 from the same int8 inputs, for row counts that end in partial register tiles, from one row
    (its own kernel) to a prefill; within the inputs' rounding of the float product; and each row equal,
    bit for bit, to that row computed alone (the integer sums are exact and the float steps per row the
    same, whatever the batch). 192 outputs are three blocks of 64 (split by rows too over two threads
    on AMX); 10, 9 and 1 groups of inputs end the AMX kernel's pipeline of groups each its own way."""
    if not extension.int8_activations():
        pytest.skip("int8 activations need AVX2 with F16C and FMA")
    groups = Int4Groups.from_float(torch.randn(192, inputs, generator=torch.Generator().manual_seed(7)))
    if half_scales:
        groups = Int4Groups(groups.codes, groups.scales.half().float(), groups.mins.half().float())
    layer = Int4Linear(groups, dtype, int8_activations=True)
    float_inputs = Int4Linear(groups, dtype)
    for rows in (1, 2, 3, 4, 6, 7, 13, 64, 100, 515):  # tiles of 5 rows: every remainder
        x = torch.randn(rows, inputs, generator=torch.Generator().manual_seed(rows)).to(dtype)
        _zero_a_group(x)
        reference, bound = _int8_activation_reference(x, groups.codes, groups.scales, groups.mins)
        got = layer(x)
        # float32: the per-group float steps' rounding; bfloat16: also the output's own (8-bit mantissa)
        rounding = 1e-5 * reference.abs().max() + (0.008 * reference.abs() if dtype == torch.bfloat16 else 0)
        assert ((got.double() - reference).abs() <= rounding).all(), rows
        exact = x.double() @ groups.dequantize().double().T
        assert ((got.double() - exact).abs() <= bound + rounding).all(), rows
        for i in {0, rows // 2, rows - 1}:
            assert torch.equal(layer(x[i : i + 1])[0], got[i]), (rows, i)
        assert not torch.equal(float_inputs(x), got)  # the option is what changed the path


@pytest.mark.parametrize(
    ("outputs", "inputs"),
    [(200, 320), (208, 320), (208, 288), (224, 32)],
    ids=["row-major", "quads", "quads-9-groups", "quads-1-group"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_int8_groups_with_int8_activations_equal_their_integer_reference(extension, dtype, outputs, inputs):
    """Int8GroupLinear (Q8_0 / Q5_0 layers, the lm_head) with its inputs quantized to int8: against the
    products computed in float64 from the same int8 inputs, within the inputs' rounding of the float
    product, and each row equal, bit for bit, to that row computed alone. Whole vectors of 16 outputs
    (AVX2 and up): the codes are held as quads alone (int8_quads.cpp), in as many bytes, and go back
    to the same row-major codes and scales (10, 9 and 1 groups: the AMX kernel's pipeline over groups
    ends each its own way); 200: row-major (int8_int8.cpp)."""
    if not extension.int8_activations():
        pytest.skip("int8 activations need AVX2 with F16C and FMA")
    codes, scales = int8_groups_from_float(torch.randn(outputs, inputs, generator=torch.Generator().manual_seed(8)))
    layer = Int8GroupLinear(codes, scales, dtype, out_dtype=dtype)
    layer.int8_activations = True
    float_inputs = Int8GroupLinear(codes, scales, dtype, out_dtype=dtype)
    quads = outputs % 16 == 0 and extension.int8_quads_usable()
    assert layer.uses_quads() == quads
    for rows in (1, 2, 3, 4, 5, 8, 9, 13, 64, 515):  # tiles of 4 (row-major) or 8 (quads) rows: every remainder
        x = torch.randn(rows, inputs, generator=torch.Generator().manual_seed(rows)).to(dtype)
        _zero_a_group(x)
        reference, bound = _int8_activation_reference(x, codes, scales, torch.zeros_like(scales))
        got = layer(x)
        rounding = 1e-5 * reference.abs().max() + (0.008 * reference.abs() if dtype == torch.bfloat16 else 0)
        assert ((got.double() - reference).abs() <= rounding).all(), rows
        weight = codes.double().view(outputs, inputs // 32, 32) * scales.double()[..., None]
        exact = x.double() @ weight.view(outputs, inputs).T
        assert ((got.double() - exact).abs() <= bound + rounding).all(), rows
        for i in {0, rows // 2, rows - 1}:
            assert torch.equal(layer(x[i : i + 1])[0], got[i]), (rows, i)
        assert not torch.equal(float_inputs(x), got)
    assert (layer.codes is None) == quads and (layer.quads is not None) == quads
    held = sum(t.numel() * t.element_size() for t in layer.buffers())
    assert held == codes.numel() + scales.numel() * 4  # one layout, as many bytes
    layer.arrange_row_major()
    assert torch.equal(layer.codes, codes) and torch.equal(layer.scales, scales) and layer.quads is None


def test_attention_groups_bound_padding():
    # 63 short decodes and one long one: the long one gets a group of its own.
    new, seq_lens = [1] * 64, [100] * 63 + [3000]
    groups = _partition(new, seq_lens)
    assert [63] in groups and sorted(len(g) for g in groups) == [1, 63]
    # similar lengths stay together; decodes never share a group with a prefill
    groups = _partition([1, 1, 1, 50], [100, 110, 120, 50])
    assert groups == [[2, 1, 0], [3]]
    for members in _partition([1] * 10 + [7] * 3, list(range(10, 140, 10))):
        lens = [list(range(10, 140, 10))[i] for i in members]
        assert len(members) * max(lens) <= 1.25 * sum(lens) or len(members) == 1
