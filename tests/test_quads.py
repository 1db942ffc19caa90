"""The quads layout (kvserve/layers/quads.py): codes held 16 output rows x 4 inputs interleaved, at 5 bits
where every code fits (GGML's Q5_0) and 8 otherwise, with float16 scales where they are exact.

References: the row-major codes and scales the layout was made from (exact round trips, exact row
lookups), and the 8-bit layout's products for the 5-bit one (the same integers, so the same bits)."""

from __future__ import annotations

import pytest
import torch

from kvserve.layers import quads
from kvserve.layers.quantized import Int8Embedding, Int8GroupLinear

pytestmark = pytest.mark.threaded  # the C++ kernels' splits over threads stay tested under xdist


def _codes(rows: int, cols: int, low: int, high: int, seed: int) -> torch.Tensor:
    return torch.randint(low, high + 1, (rows, cols), generator=torch.Generator().manual_seed(seed), dtype=torch.int8)


def _scales(rows: int, groups: int, half: bool, seed: int) -> torch.Tensor:
    scales = torch.rand(rows, groups, generator=torch.Generator().manual_seed(seed)) / 50 + 1e-4
    return scales.half().float() if half else scales  # float16 values: as GGUF stores Q8_0's and Q5_0's


@pytest.mark.parametrize("rows", [48, 40], ids=["whole-vectors", "padded"])
@pytest.mark.parametrize(("low", "high", "bits"), [(-16, 15, 5), (-16, 16, 8), (-127, 127, 8)])
@pytest.mark.parametrize("half", [True, False], ids=["float16-scales", "float32-scales"])
def test_quads_round_trip_exactly_at_the_narrowest_width(rows, low, high, bits, half):
    """Codes in -16..15 are held at 5 bits, any other at 8; float16 scales where every scale is one.
    Back to row-major gives the same codes and scales, and the layout's bytes are the width's."""
    codes, scales = _codes(rows, 96, low, high, seed=rows + bits), _scales(rows, 3, half, seed=rows)
    held, held_scales = quads.to_quads(codes, scales)
    assert quads.code_bits(held) == bits
    assert held_scales.dtype == (torch.float16 if half else torch.float32)
    padded = -(-rows // 16) * 16
    assert held.numel() == padded * 96 * bits // 8  # as many bytes as the codes' width
    assert held_scales.shape == (padded // 16, 3, 16)
    back_codes, back_scales = quads.to_row_major(held, held_scales, rows)
    assert torch.equal(back_codes, codes) and torch.equal(back_scales, scales)


@pytest.mark.parametrize(("low", "high"), [(-16, 15), (-127, 127)], ids=["5-bit", "8-bit"])
def test_rows_are_looked_up_in_quads_as_in_the_row_major_table(low, high):
    codes, scales = _codes(64, 64, low, high, seed=3), _scales(64, 2, half=True, seed=3)
    held, held_scales = quads.to_quads(codes, scales)
    ids = torch.tensor([0, 63, 17, 17, 31, 32, 5])
    got_codes, got_scales = quads.rows_of(held, held_scales, ids)
    assert torch.equal(got_codes, codes[ids]) and torch.equal(got_scales, scales[ids])


def test_a_tied_embedding_looks_up_the_heads_quads_and_holds_no_copy():
    """A tied lm_head arranged as quads takes the embedding with it (one copy of the codes, counted once);
    the embedding's rows stay the same bits, and go back with the head to row-major."""
    codes, scales = _codes(80, 64, -127, 127, seed=4), _scales(80, 2, half=True, seed=4)
    embedding = Int8Embedding(codes, scales, torch.float32)
    head = Int8GroupLinear(embedding.codes, embedding.scales, torch.float32)
    head.tie(embedding)
    ids = torch.tensor([[1, 79, 40], [16, 15, 0]])
    before = embedding(ids)
    head.arrange_quads()
    assert embedding.codes is None and embedding.quads is head.quads and embedding.quad_scales is head.quad_scales
    assert not [m for m in head.modules() if m is embedding]  # not a submodule of the head
    assert torch.equal(embedding(ids), before)
    head.arrange_row_major()
    assert embedding.quads is None and embedding.codes is head.codes
    assert torch.equal(embedding.codes, codes) and torch.equal(embedding(ids), before)


@pytest.mark.parametrize("inputs", [320, 1024])  # AVX2 keeps 8-bit codes' magnitudes up to 640 inputs
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_five_bit_quads_multiply_to_the_bits_of_eight_bit_quads(extension, dtype, inputs):
    """int8_quads.cpp at 5 bits with float16 scales against itself at 8 bits with float32 scales: the same
    integer sums and float scales, so every row count gives the same bits; and a row's result alone is
    its result in a batch (one row: vpdpbusd; from 16 rows AMX tiles where the CPU has them, whose
    integer sums and float steps are the same)."""
    if not extension.int8_quads_usable():
        pytest.skip("the quads kernel needs AVX2, FMA and F16C")
    from kvserve.kernels import ops

    outputs = 96
    codes, scales = _codes(outputs, inputs, -16, 15, seed=5), _scales(outputs, inputs // 32, half=True, seed=5)
    five, five_scales = quads.to_quads(codes, scales)
    assert quads.code_bits(five) == 5 and five_scales.dtype == torch.float16
    eight = (codes.view(outputs // 16, 16, inputs // 4, 4).permute(0, 2, 1, 3).view(torch.uint8) ^ 0x80).contiguous()
    eight_scales = scales.view(outputs // 16, 16, -1).permute(0, 2, 1).contiguous()
    for rows in (1, 2, 7, 8, 9, 64, 515):  # tiles of 8 rows: every remainder
        x = torch.randn(rows, inputs, generator=torch.Generator().manual_seed(rows)).to(dtype)
        x[0, :32] = 0.0  # an all-zero group: d = 0
        got = ops.int8_quads_matmul(x, five, five_scales, outputs)
        assert torch.equal(got, ops.int8_quads_matmul(x, eight, eight_scales, outputs)), rows
        exact = x.double() @ (codes.double().view(outputs, -1, 32) * scales.double()[..., None]).view(outputs, -1).T
        assert (got.double() - exact).abs().max() <= 0.02 * exact.abs().max(), rows  # int8 inputs' rounding
        assert torch.equal(ops.int8_quads_matmul(x[-1:], five, five_scales, outputs)[0], got[-1]), rows


@pytest.mark.parametrize("activations", ["int8", "float"])
def test_the_bundled_models_tied_head_and_embedding_hold_one_copy_through_a_step(activations):
    """SmolLM2's Q8_0 embedding is its lm_head too: after prefill and decode steps the model holds the
    bytes it held after load (a layout arranged on a first call would add a second copy: 490 MB instead
    of 257 for Gemma 3 270M before this was fixed), and the embedding shares the head's tensors."""
    from kvserve.weights.loader import load_model, weight_summary
    from kvserve.weights.registry import DEFAULT_MODEL, pull
    from tests.simple_generate import stream_token_ids

    model = load_model(
        pull(DEFAULT_MODEL, progress=False), torch.bfloat16, progress=False, weights="auto", activations=activations
    )
    held = weight_summary(model)["bytes"]
    assert len(list(stream_token_ids(model, list(range(100, 140)), 3))) == 3
    assert weight_summary(model)["bytes"] == held
    head, embedding = model.lm_head, model.embed_tokens
    assert embedding.codes is head.codes and embedding.quads is head.quads


def _q6_k_raw(rows: int, blocks: int, seed: int) -> torch.Tensor:
    """Random Q6_K rows (random codes and int8 scales, finite float16 block scales), as raw bytes."""
    import numpy as np
    from gguf import GGMLQuantizationType

    from tests.test_gguf import random_blocks

    raw = random_blocks(GGMLQuantizationType.Q6_K, rows * blocks, np.random.default_rng(seed))
    return torch.from_numpy(raw.reshape(rows, -1).copy())


def test_q6_k_is_held_in_its_own_bytes_and_dequantizes_bit_for_bit():
    """Q6_K's codes, int8 scales per 16 and float16 scales per 256, in the 6-bit quads: as many bytes as
    the file, the same parts back, and the weight GGML's dequantization gives, bit for bit."""
    from gguf import GGMLQuantizationType

    from kvserve.weights.dequant import dequantize, q6_k_parts

    raw = _q6_k_raw(48, 2, seed=6)
    codes, scales, d = q6_k_parts(raw)
    assert codes.shape == (48, 512) and int(codes.max()) <= 63
    held, k_scales = quads.to_k6_quads(codes, scales, d)
    assert held.numel() + k_scales.numel() == raw.numel()  # 6.5625 bits a weight, as the file
    back = quads.k6_parts(held, k_scales)
    assert all(torch.equal(a, b) for a, b in zip(back, (codes, scales, d), strict=True))
    expected = dequantize(raw, GGMLQuantizationType.Q6_K, 512)
    assert torch.equal(quads.k6_dequantize(held, k_scales).view(torch.int32), expected.view(torch.int32))


def _rounded_inputs(rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random inputs [rows, 512] (row 0's first group all zero: d = 0), their scales d [rows, 16] and the
    inputs as the kernels round them to int8, d * q in float64 (per 32: d = max|x| / 127, q = round(x / d))."""
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).to(dtype)
    x[0, :32] = 0.0
    xg = x.float().view(rows, 16, 32)
    d = xg.abs().amax(-1) / 127
    q = torch.round(xg * torch.where(d != 0, 1 / d, torch.zeros_like(d))[..., None])
    return x, d, (d.double()[..., None] * q.double()).view(rows, 512)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_q6_k_layer_equals_its_integer_reference_and_each_row_alone(extension, dtype):
    """Int6Linear (int8_quads.cpp, 6 bits, a float step per 16 inputs) against the product in float64 of
    the dequantized weight and the inputs as the kernel rounds them to int8 (per 32: d = max|x| / 127,
    q = round(x / d)), within float32's summation; its distance to the float inputs' product within
    their rounding; and each row alone the same bits as in any batch."""
    if not extension.int8_quads_usable():
        pytest.skip("the quads kernel needs AVX2, FMA and F16C")
    from kvserve.layers.quantized import Int6Linear
    from kvserve.weights.dequant import q6_k_parts

    layer = Int6Linear(*q6_k_parts(_q6_k_raw(96, 2, seed=9)), dtype, out_dtype=torch.float32)
    weight = quads.k6_dequantize(layer.quads, layer.k_scales).double()
    for rows in (1, 2, 7, 8, 9, 64, 515):
        x, d, rounded = _rounded_inputs(rows, dtype)
        got = layer(x).double()
        reference = rounded @ weight.T
        assert (got - reference).abs().max() <= 1e-5 * reference.abs().max(), rows
        bound = (d.double()[..., None] / 2 * weight.abs().view(96, 16, 32).sum(-1).T).sum(1)
        assert ((got - x.double() @ weight.T).abs() <= bound + 1e-5 * reference.abs().max()).all(), rows
        for i in {0, rows // 2, rows - 1}:
            assert torch.equal(layer(x[i : i + 1])[0], got[i].float()), (rows, i)


def _q5_raw(kind: str, rows: int, blocks: int, seed: int) -> torch.Tensor:
    """Random Q5_1 / Q5_K (or Q4_0 / Q4_1) rows (random codes and 6-bit scales, finite float16 ones), as
    raw bytes."""
    import numpy as np
    from gguf import GGMLQuantizationType

    from tests.test_gguf import random_blocks

    raw = random_blocks(GGMLQuantizationType[kind], rows * blocks, np.random.default_rng(seed))
    return torch.from_numpy(raw.reshape(rows, -1).copy())


@pytest.mark.parametrize("kind", ["Q5_1", "Q5_K"])
def test_q5_types_are_held_at_their_width_and_dequantize_bit_for_bit(kind):
    """Q5_1's and Q5_K's codes with their scales and mins in the 5-bit quads: Q5_1 in as many bytes as the
    file, Q5_K in 320 more per 16 rows and 256 inputs than its 2816 (1.023x); the same parts back; and
    the weight GGML's dequantization gives, bit for bit."""
    from gguf import GGMLQuantizationType

    from kvserve.weights.dequant import INT5_READERS, dequantize

    qtype = GGMLQuantizationType[kind]
    raw = _q5_raw(kind, 48, 2 if kind == "Q5_K" else 16, seed=5)
    parts = INT5_READERS[qtype](raw)
    assert parts[0].shape == (48, 512) and int(parts[0].max()) == 31
    held, scales = quads.to_q5_quads(kind, parts)
    size = held.numel() + scales.numel() * scales.element_size()
    assert size == raw.numel() if kind == "Q5_1" else size * 2816 == raw.numel() * 2880
    back = quads.q5_parts(held, scales)
    assert all(torch.equal(a, b) for a, b in zip(back, parts, strict=True))
    expected = dequantize(raw, qtype, 512)
    assert torch.equal(quads.q5_dequantize(held, scales).view(torch.int32), expected.view(torch.int32))


@pytest.mark.parametrize("kind", ["Q5_1", "Q5_K"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_q5_layer_equals_its_integer_reference_and_each_row_alone(extension, kind, dtype):
    """Int5Linear (int8_quads.cpp, 5 bits, a scale and a min per group) against the product in float64 of
    the dequantized weight and the inputs as the kernel rounds them to int8 (per 32: d = max|x| / 127,
    q = round(x / d)), within float32's summation; its distance to the float inputs' product within
    their rounding; and each row alone the same bits as in any batch."""
    if not extension.int8_quads_usable():
        pytest.skip("the quads kernel needs AVX2, FMA and F16C")
    from gguf import GGMLQuantizationType

    from kvserve.layers.quantized import Int5Linear
    from kvserve.weights.dequant import INT5_READERS

    raw = _q5_raw(kind, 96, 2 if kind == "Q5_K" else 16, seed=8)
    layer = Int5Linear(kind, INT5_READERS[GGMLQuantizationType[kind]](raw), dtype, out_dtype=torch.float32)
    weight = quads.q5_dequantize(layer.quads, layer.q5_scales).double()
    # |scale * code| + |min| per weight: the float steps' terms, which may cancel in the weight
    codes, *scales = quads.q5_parts(layer.quads, layer.q5_scales)
    if kind == "Q5_1":
        scale, mins = (t.double().repeat_interleave(32, dim=1) for t in scales)
    else:
        sc, mn, d_k, dmin = (t.double() for t in scales)
        scale = (d_k.repeat_interleave(8, dim=1) * sc).repeat_interleave(32, dim=1)
        mins = (dmin.repeat_interleave(8, dim=1) * mn).repeat_interleave(32, dim=1)
    terms = (scale * codes.double()).abs() + mins.abs()
    for rows in (1, 2, 7, 8, 9, 64, 515):
        x, d, rounded = _rounded_inputs(rows, dtype)
        got = layer(x).double()
        reference = rounded @ weight.T
        assert ((got - reference).abs() <= 1e-5 * (rounded.abs() @ terms.T)).all(), rows
        bound = (d.double()[..., None] / 2 * weight.abs().view(96, 16, 32).sum(-1).T).sum(1)
        assert ((got - x.double() @ weight.T).abs() <= bound + 1e-5 * reference.abs().max()).all(), rows
        for i in {0, rows // 2, rows - 1}:
            assert torch.equal(layer(x[i : i + 1])[0], got[i].float()), (rows, i)


def _q4_layer_weight(kind: str, rows: int, seed: int) -> tuple[object, object, torch.Tensor]:
    """(what Int4QuadsLinear takes, the Int4Groups Int4Linear takes, the raw bytes) of random `kind` rows of
    512 inputs: the Int4Groups themselves for Q4_0 and Q4_1, Q4_K's parts (dequant.q4_k_parts) for Q4_K."""
    from gguf import GGMLQuantizationType

    from kvserve.layers.quantized import Int4Groups
    from kvserve.weights.dequant import int4_groups, q4_k_parts

    raw = _q5_raw(kind, rows, 2 if kind == "Q4_K" else 16, seed=seed)
    groups = Int4Groups(*int4_groups(raw, GGMLQuantizationType[kind]))
    return (q4_k_parts(raw) if kind == "Q4_K" else groups), groups, raw


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_q4_codes_are_held_in_the_files_bytes_and_dequantize_as_the_int4_groups(kind):
    """Q4_0's and Q4_1's codes with a float16 scale and min per 32 (Q4_0's min is -8 times its scale), and
    Q4_K's with its K-quant scales, in the 4-bit quads: Q4_1 in the file's bytes, Q4_0 in 20 per 32 against
    its 18, Q4_K in 2,368 per 16 rows and 256 inputs against its 2,304; the same codes and scales back;
    the weight the int4 groups stand for, bit for bit (and for Q4_1 and Q4_K GGML's own)."""
    from gguf import GGMLQuantizationType

    from kvserve.layers.quantized import Int4Groups, Int4QuadsLinear
    from kvserve.weights.dequant import dequantize

    qtype = GGMLQuantizationType[kind]
    held_from, groups, raw = _q4_layer_weight(kind, 48, seed=6)
    codes, scales, mins = groups.codes, groups.scales, groups.mins
    assert codes.shape == (48, 512) and int(codes.max()) == 15
    if kind == "Q4_K":
        held, held_scales = quads.to_k4_quads(held_from)
        assert held_scales.shape == (3, 2, 320) and quads.code_bits(held) == 4
        assert (held.numel() + held_scales.numel()) * 2304 == raw.numel() * 2368
        assert all(torch.equal(a, b) for a, b in zip(quads.q5_parts(held, held_scales), held_from, strict=True))
        assert not Int4QuadsLinear.holds(groups)  # float32 products: not as float16 scales and mins
    else:
        assert Int4QuadsLinear.holds(groups)
        held, held_scales = quads.to_q4_quads(codes, scales, mins)
        assert quads.code_bits(held) == 4 and held.shape == (3, 16, 256) and held_scales.dtype == torch.float16
        size = held.numel() + held_scales.numel() * held_scales.element_size()
        assert size * (18 if kind == "Q4_0" else 20) == raw.numel() * 20
        back_codes, back_scales, back_mins = quads.q5_parts(held, held_scales)
        assert torch.equal(back_codes, codes.to(torch.uint8))
        assert torch.equal(back_scales.float(), scales) and torch.equal(back_mins.float(), mins)
    weight = quads.q5_dequantize(held, held_scales)
    assert torch.equal(weight.view(torch.int32), groups.dequantize().view(torch.int32))
    if kind != "Q4_0":
        assert torch.equal(weight.view(torch.int32), dequantize(raw, qtype, 512).view(torch.int32))
    assert not Int4QuadsLinear.holds(Int4Groups(codes, scales * 1.1, mins))  # float32 scales: int4_mm's


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_q4_quads_give_the_bits_of_int4_mm_with_int8_inputs_at_any_row_count(extension, kind, dtype):
    """Int4QuadsLinear (codes arranged once at load) against Int4Linear with int8 inputs (int4_int8.cpp,
    which rearranges each block's codes on every call): the same integer sums and float steps in the
    same order, so the same bits at every row count (every remainder of both kernels' row tiles; from 16
    rows AMX tiles where the CPU has them); each row alone its bits in the batch; and within float32's
    summation of the product of the inputs as the kernels round them to int8 and the weight."""
    if not extension.int8_quads_usable():
        pytest.skip("the quads kernel needs AVX2, FMA and F16C")
    from kvserve.layers.quantized import Int4Linear, Int4QuadsLinear, int4_block_rows

    if not int4_block_rows():
        pytest.skip("PyTorch's int4 packing layout is not known here: int4_mm does not run")
    for outputs in (128, 80):  # 80: an odd number of 16-output vectors, the last one without a pair
        held_from, groups, _ = _q4_layer_weight(kind, outputs, seed=7)
        layer = Int4QuadsLinear(held_from, dtype)
        packed = Int4Linear(groups, dtype, int8_activations=True) if outputs % int4_block_rows() == 0 else None
        weight = groups.dequantize().double()
        terms = (groups.scales.double().repeat_interleave(32, dim=1) * groups.codes.double()).abs()
        terms += groups.mins.double().abs().repeat_interleave(32, dim=1)  # the float steps' terms (may cancel)
        for rows in (1, 2, 5, 7, 8, 9, 16, 17, 64, 515):
            x, _, rounded = _rounded_inputs(rows, dtype)
            got = layer(x)
            assert got.dtype == dtype and (packed is None or torch.equal(got, packed(x))), (outputs, rows)
            if dtype == torch.float32:
                bound = 1e-5 * (rounded.abs() @ terms.T)
                assert ((got.double() - rounded @ weight.T).abs() <= bound).all(), (outputs, rows)
            for i in {0, rows // 2, rows - 1}:
                assert torch.equal(layer(x[i : i + 1])[0], got[i]), (outputs, rows, i)
