"""The Triton kernels (kvserve/kernels/gpu) against float64 PyTorch references, and their batch
invariance (R7): a row's bits do not depend on the other rows of the call, and a token's attention
is the same bits in a decode, a prefill, a chunk, beside other sequences and with more splits.

On a GPU the tests run on CUDA tensors; without one, in Triton's interpreter (set before triton is
imported), with small shapes as the interpreter runs each program in Python."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses
from functools import partial

import pytest

pytest.importorskip("triton")

import triton
import triton.language as tl

from kvserve.kernels import gpu
from kvserve.kernels.gpu import attention, elementwise, matmul, norm, sample

if not torch.cuda.is_available() and not gpu.INTERPRET:
    pytest.skip("kvserve.kernels.gpu was imported before TRITON_INTERPRET was set", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16_ULP = 2.0**-7  # spacing of bfloat16 values in [1, 2): half of it bounds one rounding, relative


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=_generator(seed)).to(dtype).to(DEVICE)


def test_available():
    assert gpu.available()


def test_the_hosts_cdiv_and_next_power_of_2_give_tritons_values():
    """The launch code's plain-Python `cdiv` and `next_power_of_2` (Triton's are calls through its
    constexpr_function wrapper, 20x slower) give Triton's values, so every grid and block is the same."""
    counts = [*range(-5, 4100), *(2**k + d for k in range(12, 40) for d in (-1, 0, 1))]
    assert [gpu.next_power_of_2(n) for n in counts] == [triton.next_power_of_2(n) for n in counts]
    pairs = [(a, b) for a in range(0, 300) for b in (1, 2, 3, 7, 16, 31, 64, 128)] + [(2**35 + 3, 512)]
    assert [gpu.cdiv(a, b) for a, b in pairs] == [triton.cdiv(a, b) for a, b in pairs]


@pytest.mark.skipif(not gpu.INTERPRET, reason="the interpreter's speed-up (tests/triton_interpreter.py)")
def test_the_sped_up_interpreter_computes_what_tritons_own_does(monkeypatch):
    """tests/conftest.py skips the interpreter's language patching inside a launch, shares its types, leaves
    out integer overflow checks whose assert is off and converts bfloat16 by shifting its bits
    (tests/triton_interpreter.py): a kernel whose helpers run in its loop (the matmul's dot, attention's
    splits) gives the bits of Triton's own."""
    from tests.triton_interpreter import speed_up, tritons_own

    if not speed_up():
        pytest.skip("this Triton's interpreter is not the one tests/triton_interpreter.py was written for")
    monkeypatch.setattr(attention, "SPLIT_KEYS", 64)
    x, w = _randn(3, 160, seed=1, dtype=torch.bfloat16), _randn(96, 160, seed=2, dtype=torch.bfloat16)
    cache = PagedCache.make([150, 9], 2, 32, torch.bfloat16, seed=3)
    q = _randn(10, 4, 32, seed=4, dtype=torch.bfloat16)
    step = Step([(0, 140, 1), (1, 0, 9)])

    logits, seeds = _randn(3, 300, seed=5), torch.tensor([7, 8, 9], device=DEVICE)

    def run():  # block and scalar values of many types and shapes (the pick: its draws' integer scalars)
        drawn = sample.pick(logits, sample.counters(DEVICE), None, seeds, torch.ones(3, device=DEVICE))
        return matmul.matmul(x, w), norm.rms_norm(x, w[0], 1e-5), _attend(cache, step, q, num_splits=3), drawn

    sped_up = run()
    with tritons_own():
        own = run()
    for a, b in zip(sped_up, own, strict=True):
        assert torch.equal(a, b)


@pytest.mark.skipif(not gpu.INTERPRET, reason="the interpreter's speed-up (tests/triton_interpreter.py)")
def test_the_sped_up_bfloat16_conversions_give_tritons_bits():
    """Every bfloat16 to float32, and a million float32 to bfloat16 (zeros, infinities, NaNs and subnormals
    among them), give the bits of Triton's `_convert_float`, alone and with a subnormal in the array (which
    the shift leaves to Triton's)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    from tests.triton_interpreter import _SWAPS

    own = next((o for owner, name, o, _ in _SWAPS if name == "_convert_float"), None)
    if own is None or interpreter._convert_float is own:
        pytest.skip("this Triton's interpreter is not the one tests/triton_interpreter.py was written for")
    fast = interpreter._convert_float
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    normal = every[((every & 0x7F80) != 0) | ((every & 0x7F) == 0)]
    specials = np.array(
        [0, 1 << 31, 0x7F800000, 0xFF800000, 0x7FC00001, 0x7F800001, 0x7F7FFFFF, 0x00800000, 1], np.uint32
    )
    floats = np.concatenate([specials, np.random.default_rng(0).integers(0, 1 << 32, 1 << 20, dtype=np.uint32)])
    floats_normal = floats[(floats & 0x7F800000) != 0]
    for bits, src, dst in [
        (every, tl.bfloat16, tl.float32),
        (normal.reshape(-1, 2), tl.bfloat16, tl.float32),
        (floats.view(np.float32), tl.float32, tl.bfloat16),
        (floats_normal.view(np.float32), tl.float32, tl.bfloat16),
        (floats_normal[:4096].view(np.float32).reshape(-1, 4)[:, ::2], tl.float32, tl.bfloat16),  # strided
        (floats_normal[:1].view(np.float32).reshape(()), tl.float32, tl.bfloat16),  # a scalar's
        (normal[:1].reshape(()), tl.bfloat16, tl.float32),
    ]:
        mine, tritons = fast(bits, src, dst, None), own(bits, src, dst, None)
        assert type(mine) is type(tritons) and mine.dtype == tritons.dtype and mine.shape == tritons.shape
        assert np.array_equal(mine, tritons)


# --- RMSNorm


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_matches_the_formula_and_each_row_alone(dtype):
    rows, hidden, eps = 9, 1100, 1e-5  # not a power of two: the row padded with zeros to 2,048
    x = _randn(rows, hidden, seed=0, dtype=dtype) * 3
    weight = _randn(hidden, seed=1, dtype=dtype)
    out = norm.rms_norm(x, weight, eps)
    assert out.dtype == dtype and out.shape == (rows, hidden)
    # the formula, with the mean of squares in float64: only the last bit of rstd may differ
    x64 = x.double()
    rstd = torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    expected = weight * (x64 * rstd).to(dtype)
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=0)
    else:  # y and weight * y each rounded to bfloat16, where rstd's last bit can flip a rounding
        assert ((out.double() - expected.double()).abs() <= BF16_ULP * expected.double().abs()).all()
        assert (out == expected).double().mean() > 0.99  # y is rounded before the weight multiplies it
    for row in range(rows):
        assert torch.equal(norm.rms_norm(x[row : row + 1], weight, eps)[0], out[row])


def _tree_rms_norm(s: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The norm kernel's arithmetic in PyTorch, for rows s: squares in `norm.sum_of_squares`' tree
    (zeros up to a power of two; neighbours a * a + b * b as one fma, b * b rounded first; then their
    sums in pairs), each float32 step rounded as IEEE says."""
    s32 = s.float()
    width = 1 << (s.shape[1] - 1).bit_length()
    padded = torch.nn.functional.pad(s32, (0, width - s.shape[1]))
    a, b = padded[:, 0::2].double(), padded[:, 1::2]
    sums = (a * a + (b * b).double()).float()  # a * a exact in float64: the fma's one rounding
    while sums.shape[1] > 1:
        sums = sums[:, 0::2] + sums[:, 1::2]
    # each step in float64 then rounded to float32: the correctly rounded float32 step (PyTorch's own
    # float32 sqrt on a CPU may be off by an ulp)
    rounded = lambda v: v.float().double()  # noqa: E731
    eps32 = rounded(torch.tensor(eps, dtype=torch.float64))
    mean = rounded(sums[:, 0].double() / s.shape[1])
    rstd = rounded(1.0 / rounded(torch.sqrt(rounded(mean + eps32)))).float()
    return (weight.float() * (s32 * rstd[:, None]).to(s.dtype).float()).to(s.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [1100, 2048])
def test_the_norm_kernel_sums_a_row_in_its_fixed_tree(hidden, dtype):
    """The norm kernel's bits are the fixed tree's (`sum_of_squares`), computed apart in PyTorch: the
    order that a matmul's prologue repeats for `NormedRows` in another layout (on a GPU, this test
    checks that the compiled kernel keeps it: no layout's reduction, no contraction of its own). float32
    rows show 1 / rms's every bit, which bfloat16 outputs round away."""
    x, delta = _randn(6, hidden, seed=90, dtype=dtype) * 3, _randn(6, hidden, seed=91, dtype=dtype)
    weight = _randn(hidden, seed=92, dtype=dtype)
    total, out = norm.add_rms_norm(x, delta, weight, 1e-5)
    assert torch.equal(total, x + delta)
    assert torch.equal(out.cpu(), _tree_rms_norm(total.cpu(), weight.cpu(), 1e-5))
    assert torch.equal(norm.rms_norm(x, weight, 1e-5).cpu(), _tree_rms_norm(x.cpu(), weight.cpu(), 1e-5))


@pytest.mark.parametrize("kind", ["float", "int4", "int4-bf16x2", "int8"])
def test_a_matmul_given_normed_rows_gives_the_bits_of_the_norm_kernel_then_the_matmul(monkeypatch, kind):
    """A float-input matmul given `NormedRows` normalizes each row in its prologue and K loop: the bits of
    add_rms_norm (or rms_norm, without a delta) and then the matmul, x + delta stored as add_rms_norm
    stores it, for 1 to 8 rows (one program of the row tile stores the sum), rows padded to a power of
    two (480 and 1,184 inputs), one K split and three (their partial sums added by the sum kernel or by
    the tile's last split), with a bias, and with the gated activation's epilogue."""
    for config in ("FLOAT_CONFIG", "INT4_CONFIG", "INT8_CONFIG"):
        monkeypatch.setattr(matmul, config, dataclasses.replace(getattr(matmul, config), k_per_split=512))
    bf16, n = torch.bfloat16, 74
    bias = _randn(n, seed=73, dtype=bf16)
    checked = 0
    for hidden in (480, 1024 + 160):  # one K split, three
        x, delta = _randn(8, hidden, seed=70, dtype=bf16) * 3, _randn(8, hidden, seed=71, dtype=bf16)
        weight = _randn(hidden, seed=72, dtype=bf16)
        if kind == "float":
            args = (_randn(n, hidden, seed=74, dtype=bf16),)
            run = lambda x, activation, counters, args=args: matmul.matmul(  # noqa: E731
                x, *args, bias, None, counters, activation
            )
        elif kind == "int8":
            args = _int8_weight(n, hidden, seed=74)[:2]
            run = lambda x, activation, counters, args=args: matmul.int8_group_matmul(  # noqa: E731
                x, *args, None, bias, counters, activation
            )
        else:
            codes, scales, mins, _ = _int4_weight(n, hidden, bf16, seed=74)
            args = (matmul.pack_int4(codes), scales, mins)
            run = lambda x, activation, counters, args=args: matmul.int4_matmul(  # noqa: E731
                x, *args, None, bias, kind == "int4-bf16x2", counters, activation
            )
        for m in (1, 3, 8):
            for d in (delta[:m], None):
                if d is None:
                    total, normed = None, norm.rms_norm(x[:m], weight, 1e-5)
                else:
                    total, normed = norm.add_rms_norm(x[:m], d, weight, 1e-5)
                for activation in (None, "silu"):
                    for counters in (None, matmul.split_counters(DEVICE)):
                        expected = run(normed, activation, counters)
                        rows_total, rows = norm.normed_rows(x[:m], d, weight, 1e-5)
                        assert torch.equal(run(rows, activation, counters), expected), (hidden, m, activation)
                        assert (rows_total is None) == (total is None)
                        assert rows_total is None or torch.equal(rows_total, total)
                        checked += 1
            # a q/k/v projection (2 + 2 x 1 heads of 16) with RoPE and the cache's write: in the epilogue,
            # and (K splits without counters) by the RoPE kernel after the sum kernel
            w_qkv = _randn(64, hidden, seed=75, dtype=bf16)
            cos, sin = _randn(m, 1, 16, seed=76, dtype=bf16), _randn(m, 1, 16, seed=77, dtype=bf16)
            slots = torch.arange(m, dtype=torch.int32, device=DEVICE)
            for counters in (None, matmul.split_counters(DEVICE)):
                got, want = [], []
                with_delta = norm.add_rms_norm(x[:m], delta[:m], weight, 1e-5)[1]
                for inputs, caches in ((norm.normed_rows(x[:m], delta[:m], weight, 1e-5)[1], got), (with_delta, want)):
                    caches += [torch.zeros(1, 16, 1, 16, dtype=bf16, device=DEVICE) for _ in range(2)]
                    rope = matmul.RopeStore(cos, sin, *caches, slots, 2)
                    caches.append(matmul.matmul(inputs, w_qkv, None, None, counters, rope=rope))
                assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), (hidden, m, counters)
                checked += 1
    assert checked == 2 * 3 * (2 * 2 * 2 + 2)


# --- Matmuls


def _check_matmul(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    """out against x @ w.T (+ bias) in float64, w already in x's dtype: float32 sums of K products
    are within K * 2^-24 of sum |x||w| (a loose 1e-5 for these K), and a 16-bit output adds one
    rounding (half an ulp, relative)."""
    x64, w64 = x.double(), w.double()
    expected = x64 @ w64.T + (0 if bias is None else bias.double())
    bound = 1e-5 * (x64.abs() @ w64.abs().T + (0 if bias is None else bias.double().abs()))
    if out.dtype != torch.float32:
        bound += BF16_ULP / 2 * expected.abs() if out.dtype == torch.bfloat16 else 2.0**-11 * expected.abs()
    error = (out.double() - expected).abs()
    assert (error <= bound).all(), f"max error {error.max()}, {(error > bound).sum()} outside the bound"


def _each_row_alone(run, x: torch.Tensor, out: torch.Tensor) -> None:
    """Every row of out equals the same row computed with M = 1, bit for bit."""
    for row in range(x.shape[0]):
        assert torch.equal(run(x[row : row + 1])[0], out[row]), row


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_matmul_against_float64_and_each_row_alone(dtype):
    m, k, n = 37, 200, 72  # tails in every dimension of the 64 x 64 x 64 tiles
    x = _randn(m, k, seed=2, dtype=dtype)
    w = _randn(n, k, seed=3, dtype=dtype)
    bias = _randn(n, seed=4, dtype=dtype)
    out = matmul.matmul(x, w, bias)
    assert out.dtype == dtype
    _check_matmul(out, x, w, bias)
    _each_row_alone(lambda rows: matmul.matmul(rows, w, bias), x, out)


def test_matmul_gives_float32_logits_from_bfloat16_weights():
    x = _randn(5, 96, seed=5, dtype=torch.bfloat16)
    w = _randn(80, 96, seed=6, dtype=torch.bfloat16)
    out = matmul.matmul(x, w, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    _check_matmul(out, x, w, None)  # float32's bound: a bfloat16 rounding on the way would exceed it


def test_matmul_with_a_k_split_sums_the_splits(monkeypatch):
    split = dataclasses.replace(matmul.FLOAT_CONFIG, block_k=64, k_per_split=64)
    monkeypatch.setattr(matmul, "FLOAT_CONFIG", split)
    x = _randn(19, 200, seed=7, dtype=torch.bfloat16)  # 4 splits, the last one short
    w = _randn(40, 200, seed=8, dtype=torch.bfloat16)
    bias = _randn(40, seed=9)
    out = matmul.matmul(x, w, bias)
    _check_matmul(out, x, w, bias)
    _each_row_alone(lambda rows: matmul.matmul(rows, w, bias), x, out)


class _SumLaunches:
    """Stands in for a kernel that adds up splits (`_sum_splits_kernel`, `_combine_kernel`), counting
    its launches and running it."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@pytest.mark.parametrize("kind", ["float", "int4", "int8", "int4-int8", "int4-int8-mma", "int8-int8"])
def test_the_last_k_split_of_a_tile_adds_the_splits_with_the_sum_kernels_bits(monkeypatch, kind):
    """With a layer's counters each tile's last K split adds every split's partial sums (in split order,
    then the bias): the bits of `_sum_splits_kernel`, which is then not launched, and the counters are
    all 0 again for the next call; a call of more tiles than counters launches the sum kernel."""
    m = {"int4-int8": 3, "int4-int8-mma": 20}.get(kind, 19)  # dp4a for 3 rows, the tensor cores for 20
    k, n = 1024 + 160, 80  # three splits (int4 and int8 of 512, float of 512 here), the last one short
    monkeypatch.setattr(matmul, "FLOAT_CONFIG", dataclasses.replace(matmul.FLOAT_CONFIG, k_per_split=512))
    x = _randn(m, k, seed=80, dtype=torch.bfloat16)
    bias = _randn(n, seed=81)
    if kind == "float":
        w = _randn(n, k, seed=82, dtype=torch.bfloat16)
        run = lambda counters: matmul.matmul(x, w, bias, torch.float32, counters)  # noqa: E731
    elif kind == "int8":
        codes, scales, _ = _int8_weight(n, k, seed=82)
        run = lambda counters: matmul.int8_group_matmul(x, codes, scales, None, bias, counters)  # noqa: E731
    elif kind == "int8-int8":
        codes, scales, _ = _int8_weight(n, k, seed=82)
        run = lambda counters: matmul.int8_int8_matmul(x, codes, scales, None, bias, counters=counters)  # noqa: E731
    else:
        codes, scales, mins, _ = _int4_weight(n, k, torch.float16, seed=82)
        packed = matmul.pack_int4(codes)
        if kind == "int4":
            run = lambda counters: matmul.int4_matmul(x, packed, scales, mins, None, bias, counters=counters)  # noqa: E731
        else:
            run = lambda counters: matmul.int4_int8_matmul(x, packed, scales, mins, None, bias, counters=counters)  # noqa: E731
    sums = _SumLaunches(matmul._sum_splits_kernel)
    monkeypatch.setattr(matmul, "_sum_splits_kernel", sums)
    expected = run(None)
    assert sums.launches == 1  # the call splits K
    counters = matmul.split_counters(DEVICE)
    for _ in range(2):  # the second call finds the counters as the first left them
        assert torch.equal(run(counters), expected)
        assert sums.launches == 1 and not counters.any()
    assert torch.equal(run(counters[:0]), expected) and sums.launches == 2  # no room for a tile's counter


def test_a_layers_configuration_follows_its_shape_never_its_rows():
    """config_for takes the layer's shape only (R7: never the rows); narrow layers get shorter quantized
    K splits, or narrower float tiles where K makes one split, and every split is whole tiles."""
    import inspect

    assert list(inspect.signature(matmul.config_for).parameters) == ["base", "n", "k"]
    for base in (matmul.FLOAT_CONFIG, matmul.INT4_CONFIG, matmul.INT8_CONFIG, matmul.INT4_INT8_CONFIG):
        assert matmul.config_for(base, matmul.NARROW_N + 1, 2048) == base
        narrow = matmul.config_for(base, matmul.NARROW_N, 2048)
        assert narrow != base and narrow.block_m == base.block_m
        assert narrow.block_n * narrow.k_per_split < base.block_n * base.k_per_split  # more programs per row
        assert narrow.k_per_split % narrow.block_k == 0
    assert matmul.config_for(matmul.FLOAT_CONFIG, 2048, 8192) == matmul.FLOAT_CONFIG  # four K splits


def _int4_weight(n: int, k: int, scale_dtype: torch.dtype, seed: int):
    g = _generator(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = (torch.rand(n, k // 32, generator=g) * 0.1 + 0.01).to(scale_dtype)
    mins = (-torch.rand(n, k // 32, generator=g) * 0.8).to(scale_dtype)
    # the documented weight: fma(scale, code, min) in float32; in float64 the product and sum are exact
    per_input = lambda t: t.double().repeat_interleave(32, dim=1)  # noqa: E731
    dequantized = (per_input(scales) * codes.double() + per_input(mins)).float()
    return codes.to(DEVICE), scales.to(DEVICE), mins.to(DEVICE), dequantized.to(DEVICE)


def test_an_int4_program_takes_the_most_row_tiles_that_leave_the_layer_its_programs():
    """`row_tiles_for` on the 1B shapes (16 rows a tile, 64 columns; K splits of 1,024, or 512 up to
    NARROW_N outputs): up to 4 tiles a program while a call keeps 256 programs (about two a
    multiprocessor), so that a small layer keeps its parallelism and a wide one dequantizes once."""
    layers = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)}
    expected = {  # rows -> row tiles a program, per layer
        1: dict(qkv=1, o=1, gate_up=1, down=1),
        16: dict(qkv=1, o=1, gate_up=1, down=1),
        20: dict(qkv=1, o=1, gate_up=2, down=2),  # qkv's 48 x 4 programs already fewer than 256
        64: dict(qkv=2, o=2, gate_up=4, down=4),
        1024: dict(qkv=4, o=4, gate_up=4, down=4),
    }
    for m, tiles in expected.items():
        for name, (n, k) in layers.items():
            config = matmul.config_for(matmul.INT4_CONFIG, n, k)
            assert matmul.row_tiles_for(m, n, k, config) == tiles[name], (m, name)


def test_pack_int4_layout():
    codes = torch.randint(0, 16, (3, 64), generator=_generator(10), dtype=torch.uint8)
    packed = matmul.pack_int4(codes.to(DEVICE)).cpu()
    assert packed.dtype == torch.uint8 and packed.shape == (3, 32)
    for group in range(2):  # byte j of a group: input j (low nibble) and input j + 16 (high nibble)
        for j in range(16):
            assert torch.equal(packed[:, group * 16 + j] & 15, codes[:, group * 32 + j])
            assert torch.equal(packed[:, group * 16 + j] >> 4, codes[:, group * 32 + 16 + j])


@pytest.mark.parametrize(
    "dtype, scale_dtype",
    [(torch.bfloat16, torch.float16), (torch.bfloat16, torch.float32), (torch.float32, torch.float16)],
)
def test_int4_matmul_against_float64(dtype, scale_dtype):
    m, k, n = 21, 1024 + 160, 80  # three K splits (512 for a narrow layer), the last not a whole tile
    codes, scales, mins, w = _int4_weight(n, k, scale_dtype, seed=11)
    x = _randn(m, k, seed=12, dtype=dtype)
    bias = _randn(n, seed=13, dtype=dtype)
    out = matmul.int4_matmul(x, matmul.pack_int4(codes), scales, mins, bias=bias)
    assert out.dtype == dtype
    _check_matmul(out, x, w.to(dtype), bias)  # the weight rounded to x's dtype before the products


def test_int4_matmul_rows_alone_and_float32_out():
    m, k, n = 37, 1024 + 64, 48
    codes, scales, mins, w = _int4_weight(n, k, torch.float16, seed=14)
    packed = matmul.pack_int4(codes)
    x = _randn(m, k, seed=15, dtype=torch.bfloat16)
    out = matmul.int4_matmul(x, packed, scales, mins, torch.float32)
    assert out.dtype == torch.float32
    _check_matmul(out, x, w.to(x.dtype), None)
    _each_row_alone(lambda rows: matmul.int4_matmul(rows, packed, scales, mins, torch.float32), x, out)


def test_int4_nibbles_by_their_bits_give_the_conversions_bits():
    """The int4 kernel's nibbles turned into floats by PRMT-built bits (on a GPU; the interpreter
    converts either way) give the conversion instruction's outputs, bit for bit, over every nibble."""
    m, k, n = 5, 512 + 64, 48
    codes, scales, mins, _ = _int4_weight(n, k, torch.float16, seed=23)
    codes[0, :16] = torch.arange(16, dtype=codes.dtype, device=codes.device)  # every nibble, low and high
    codes[0, 16:32] = torch.arange(16, dtype=codes.dtype, device=codes.device).flip(0)
    x = _randn(m, k, seed=24, dtype=torch.bfloat16)
    args = (matmul.pack_int4(codes), scales, mins)
    args += tuple(t.stride(0) for t in args)
    config = matmul.config_for(matmul.INT4_CONFIG, n, k)

    def int4(permute):
        return matmul._launch(matmul._int4_kernel, config, x, n, args, None, torch.float32, PERMUTE=permute)

    assert torch.equal(int4(True), int4(False))


def _bf16_rounded_once(v: torch.Tensor) -> torch.Tensor:
    """float64 values rounded once to bfloat16, to nearest even. torch rounds to float32 first (two
    roundings), so a float32 value on a tie between two bfloat16 values, with a remainder (exact in
    float64), is moved one float32 step toward the exact value before the second rounding."""
    f = v.float()
    rest = v - f.double()
    bits = f.view(torch.int32)
    tie = ((bits & 0xFFFF) == 0x8000) & (rest != 0)
    step = torch.where((rest > 0) == (f > 0), 1, -1).to(torch.int32)
    return torch.where(tie, (bits + step).view(torch.float32), f).to(torch.bfloat16)


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
def test_int4_packed_bf16_weights_are_the_fma_of_bf16_scale_and_min_rounded_once(scale_dtype):
    """packed_bf16 (packed bfloat16 FMAs on a GPU): each weight is fma(scale, code, min) of the scale and
    min rounded to bfloat16, rounded once; every nibble, low and high, in row 0; output 1's first group a
    tie that rounding twice (to float32, then bfloat16) gets wrong; one-hot rows read weights exactly;
    each row alone is the same bits."""
    m, k, n = 5, 1024 + 160, 80  # three K splits, the last not a whole tile
    codes, scales, mins, _ = _int4_weight(n, k, scale_dtype, seed=31)
    codes[0, :16] = torch.arange(16, dtype=codes.dtype, device=codes.device)
    codes[0, 16:32] = torch.arange(16, dtype=codes.dtype, device=codes.device).flip(0)
    # 1.0078125 * 3 = 3.0234375, halfway between bfloat16's 3.015625 and 3.03125; the min of -2**-24 puts
    # the exact weight below halfway, and vanishes in float32's sum (half a float32 step there is 2**-23)
    codes[1, :32], scales[1, 0], mins[1, 0] = 3, 1.0078125, -(2.0**-24)
    per_input = lambda t: t.to(torch.bfloat16).double().repeat_interleave(32, dim=1)  # noqa: E731
    w = _bf16_rounded_once(per_input(scales) * codes.double() + per_input(mins))
    assert (w[1, :32] == 3.015625).all()
    x = _randn(m, k, seed=32, dtype=torch.bfloat16)
    columns = [0, 17, 40, 1100]  # one-hot rows: each output is one weight, exactly
    x[:4] = 0
    x[torch.arange(4), columns] = 1
    packed = matmul.pack_int4(codes)
    out = matmul.int4_matmul(x, packed, scales, mins, torch.float32, packed_bf16=True)
    assert torch.equal(out[:4].cpu(), w[:, columns].T.float().cpu())
    _check_matmul(out, x, w, None)
    _each_row_alone(
        lambda rows: matmul.int4_matmul(rows, packed, scales, mins, torch.float32, packed_bf16=True), x, out
    )


def _quantized_inputs(x: torch.Tensor):
    """x [M, K] quantized per row and group of 32 as the CPU's quantize_group: d = max|x| / 127 and
    q = x * (1 / d) rounded to nearest even in float32 (each one IEEE operation), s = d * sum(q)."""
    groups = x.float().cpu().reshape(x.shape[0], -1, 32)
    d = groups.abs().amax(-1) / 127
    inv = torch.where(d != 0, 1 / torch.where(d != 0, d, 1), 0)
    scaled = groups * inv[..., None]  # infinite or NaN where 1 / d overflows (tiny groups)
    inside = scaled.abs() < 2.0**31
    q = torch.where(inside, torch.round(torch.where(inside, scaled, 0)), -(2.0**31)).long()  # x86: INT_MIN
    total = (q.sum(-1) + 2**31) % 2**32 - 2**31  # summed in int32
    return q.clamp(-128, 127).to(torch.int8).reshape(x.shape), d, d * total.float()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_int8_is_the_cpus_quantization(dtype):
    """quantize_int8's codes (four to an int32 word, input 4t + j in byte j of word t), d and s against
    the formula, bit for bit; a group of zeros has d = 0 and codes 0; a group's largest |x| is +-127; a
    group too small for 1 / d (x86's conversion: INT_MIN, codes -128, the CPU's bits)."""
    m, k = 7, 32 * 37  # three programs of 16 groups, the last one short
    x = _randn(m, k, seed=40, dtype=dtype) * 3
    x[2, 64:96] = 0
    x[3, 32:64] = 0
    x[3, 40] = 1e-37  # normal, but 1 / d (d = 1e-37 / 127) overflows
    words, d, s = matmul.quantize_int8(x)
    assert words.dtype == torch.int32 and words.shape == (m, k // 4) and d.shape == s.shape == (m, k // 32)
    q, d_expected, s_expected = _quantized_inputs(x)
    assert torch.equal(words.cpu().view(torch.int8), q)
    assert torch.equal(d.cpu(), d_expected) and torch.equal(s.cpu(), s_expected)
    assert d[2, 2] == 0 and not words[2, 16:24].any()
    normal = (d_expected != 0) & torch.isfinite(1 / d_expected)
    assert (q.reshape(m, -1, 32).abs().amax(-1)[normal] == 127).all()
    assert d[3, 1] != 0 and (q[3, 32:64] == -128).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_norms_and_the_gated_activation_make_quantize_int8s_bits_of_their_output(dtype):
    """rms_norm, add_rms_norm and gated_activation asked for their output's int8 form give
    quantize_int8(output), bit for bit, and the same output as without it (rows of two norm steps, the
    second partial; an activation of two column programs, the second partial)."""
    x, delta, weight = (
        _randn(5, 1088, seed=49, dtype=dtype),
        _randn(5, 1088, seed=50, dtype=dtype),
        _randn(1088, seed=51, dtype=dtype),
    )
    gate_up = _randn(7, 2 * 608, seed=52, dtype=dtype) * 3
    runs = [
        (lambda q: norm.rms_norm(x, weight, 1e-6, q), norm.rms_norm(x, weight, 1e-6)),
        (lambda q: norm.add_rms_norm(x, delta, weight, 1e-6, q)[1], norm.add_rms_norm(x, delta, weight, 1e-6)[1]),
        (lambda q: elementwise.gated_activation(gate_up, False, q), elementwise.gated_activation(gate_up, False)),
    ]
    for run, plain in runs:
        quantized = []
        out = run(quantized)
        assert torch.equal(out, plain) and len(quantized) == 1
        assert all(torch.equal(a, b) for a, b in zip(quantized[0], matmul.quantize_int8(out), strict=True))


def test_int4_int8_matmul_is_the_cpus_int4_times_int8_bit_for_bit(extension):
    """Without a K split, int4_int8_matmul is int4_int8.cpp's arithmetic (Int4Linear with int8 inputs):
    the same integer sums and float steps in the same order, so the same float32 bits, at every row
    tile (1, 2, 4 and 8 rows, and 8 with a tail); bfloat16 inputs are their float32 values."""
    from kvserve.layers.quantized import Int4Groups, Int4Linear, int4_block_rows

    if not extension.int8_activations() or not int4_block_rows():
        pytest.skip("the CPU's int4 x int8 kernel does not run here")
    m, n = 13, 128
    k = matmul.config_for(matmul.INT4_INT8_CONFIG, n, 4096).k_per_split  # one split of this layer
    codes, scales, mins, _ = _int4_weight(n, k, torch.float16, seed=41)
    layer = Int4Linear(
        Int4Groups(codes.cpu(), scales.float().cpu(), mins.float().cpu()), torch.float32, int8_activations=True
    )
    x = _randn(m, k, seed=42, dtype=torch.bfloat16) * 2
    x[5, 32:64] = 0
    x[5, 40] = 1e-37  # a group too small for 1 / d: its codes as x86 converts them
    expected = layer(x.float().cpu())
    packed = matmul.pack_int4(codes)
    for rows in (1, 2, 3, 4, 8, 13):
        out = matmul.int4_int8_matmul(x[:rows], packed, scales, mins, torch.float32)
        assert out.dtype == torch.float32 and torch.equal(out.cpu(), expected[:rows]), rows
    assert torch.equal(matmul.int4_int8_matmul(x.float(), packed, scales, mins, torch.float32).cpu(), expected)


def test_int4_int8_matmul_with_k_splits_rows_alone_and_any_row_tile(monkeypatch):
    """Three K splits (the last not a whole step) and a bias: within float32's summation of the
    product of the quantized inputs and the weight; each row alone its bits in the batch; and the same
    bits whatever the row tile (the kernel's rows are independent, so the tile may follow M)."""
    m, k, n = 11, 1024 + 160, 80
    codes, scales, mins, w = _int4_weight(n, k, torch.float32, seed=43)
    x = _randn(m, k, seed=44, dtype=torch.bfloat16)
    bias = _randn(n, seed=45)
    packed = matmul.pack_int4(codes)
    run = lambda rows: matmul.int4_int8_matmul(rows, packed, scales, mins, torch.float32, bias)  # noqa: E731
    out = run(x)
    q, d, _ = _quantized_inputs(x)
    rounded = (q.double().reshape(m, -1, 32) * d.double()[..., None]).reshape(m, k).to(DEVICE)
    _check_matmul(out, rounded, w.double(), bias)
    _each_row_alone(run, x, out)
    for block_m in (1, 2, 16):
        monkeypatch.setattr(matmul, "INT4_INT8_CONFIG", dataclasses.replace(matmul.INT4_INT8_CONFIG, block_m=block_m))
        assert torch.equal(run(x), out), block_m


def test_int4_int8_matmul_on_the_tensor_cores_gives_the_bits_of_dp4a():
    """From INT4_INT8_MMA_ROWS rows the groups' sums run as int8 dots (`_int4_int8_mma_kernel`, in each of
    its row tiles): the same integer sums and float steps, so every row the bits it has alone or in a
    few rows through dp4a, with K splits (the last not a whole step), a bias and a bfloat16 output."""
    m, k, n = 41, 1024 + 160, 80  # 41, 20 and 12 rows: each of INT4_INT8_MMA_TILES
    codes, scales, mins, _ = _int4_weight(n, k, torch.float16, seed=46)
    x = _randn(m, k, seed=47, dtype=torch.bfloat16)
    bias = _randn(n, seed=48)
    packed = matmul.pack_int4(codes)
    run = lambda rows: matmul.int4_int8_matmul(rows, packed, scales, mins, None, bias)  # noqa: E731
    out = run(x)
    assert out.dtype == torch.bfloat16
    few = matmul.INT4_INT8_MMA_ROWS - 1
    assert torch.equal(torch.cat([run(x[i : i + few]) for i in range(0, m, few)]), out)
    assert torch.equal(torch.cat([run(x[:20]), run(x[20:32]), run(x[32:])]), out)
    for row in (0, m // 2, m - 1):
        assert torch.equal(run(x[row : row + 1])[0], out[row]), row


def test_blackwells_int4_int8_tiles_give_the_bits_of_the_others(monkeypatch):
    """On compute capability 10.x and 11.x the tensor-core kernel's rows past 32 go in 32-row tiles
    (INT4_INT8_MMA_TILES_BLACKWELL), never the 64-row tile: the bits every other GPU gives them."""
    m, k, n = 100, 1024 + 160, 80
    codes, scales, mins, _ = _int4_weight(n, k, torch.float16, seed=49)
    x = _randn(m, k, seed=50, dtype=torch.bfloat16)
    packed = matmul.pack_int4(codes)
    tiles = []
    launch = matmul._launch

    def recording(kernel, config, *args, **kwargs):
        tiles.append((kernel.__name__, config.block_m))
        return launch(kernel, config, *args, **kwargs)

    monkeypatch.setattr(matmul, "_launch", recording)
    out = {}
    for capability in (None, 100):  # as this machine compiles, and as a B200
        monkeypatch.setattr(matmul, "compiled_capability", lambda device, capability=capability: capability)
        out[capability] = matmul.int4_int8_matmul(x, packed, scales, mins, counters=matmul.split_counters(DEVICE))
    assert torch.equal(out[100], out[None])
    assert [rows for name, rows in tiles if name == "_int4_int8_mma_kernel"] == [64, 32], tiles  # a call each


@triton.jit
def _looping_int4_kernel(
    x_ptr, out_ptr, partial_ptr, counters_ptr, bias_ptr, M, N, K, stride_xm, stride_om, stride_os, k_per_split,
    packed_ptr, scales_ptr, mins_ptr, stride_pn, stride_sn, stride_mn,
    HAS_BIAS: tl.constexpr, IS_SPLIT: tl.constexpr, SUM_IN_TILE: tl.constexpr, EVEN_K: tl.constexpr,
    INTERPRET: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PACKED_BF16: tl.constexpr = False, GROUP_MAJOR: tl.constexpr = False, GATED: tl.constexpr = 0,
    ROW_TILES: tl.constexpr = 1, rope=(), norm=(), NORM: tl.constexpr = 0, NORM_ADD: tl.constexpr = False,
):  # fmt: skip
    """`_int4_kernel`'s work with fewer programs along the grid's second axis, each taking tiles p + 1, p + 1 +
    programs, ... (as a persistent kernel's programs would), so that no tile is taken by a program of its own
    indices: `matmul._int4_tile` given each tile's indices."""
    tiles_n = tl.cdiv(N, BLOCK_N)
    splits = tl.cdiv(K, k_per_split)
    first = (tl.program_id(1) + 1) % tl.num_programs(1)
    for t in range(first, tl.cdiv(M, BLOCK_M * ROW_TILES) * tiles_n * splits, tl.num_programs(1)):
        matmul._int4_tile(
            x_ptr, out_ptr, partial_ptr, counters_ptr, bias_ptr, M, N, K, stride_xm, stride_om, stride_os,
            k_per_split, packed_ptr, scales_ptr, mins_ptr, stride_pn, stride_sn, stride_mn,
            HAS_BIAS, IS_SPLIT, SUM_IN_TILE, EVEN_K, INTERPRET, BLOCK_M, BLOCK_N, BLOCK_K,
            PACKED_BF16=PACKED_BF16, GROUP_MAJOR=GROUP_MAJOR, GATED=GATED, rope=rope, norm=norm, NORM=NORM,
            NORM_ADD=NORM_ADD, ROW_TILES=ROW_TILES, tile_m=t // (tiles_n * splits), tile_n=(t // splits) % tiles_n, split=t % splits, tiles_n=tiles_n,
            splits=splits,
        )  # fmt: skip


def test_the_int4_tile_given_its_indices_gives_the_bits_of_a_program_a_tile(monkeypatch):
    """`_int4_tile` is the 4-bit kernel's program with its tile's indices given: three programs looping
    over a layer's tiles and K splits (a persistent decode step's form) give `_int4_kernel`'s bits, with
    the splits summed by each tile's last split and by the sum kernel, packed bfloat16 FMAs, group-major
    codes, a gated activation, programs of several row tiles, and a norm in the prologue whose x + delta the
    tile first along N and K stores. For sm_90 the launched kernel compiles to the SASS it did before the
    tile was its own function (docs/performance.md)."""
    m, k, n = 37, 1024 + 160, 80  # three K splits, two column tiles
    codes, scales, mins, _ = _int4_weight(n, k, torch.bfloat16, seed=81)
    packed = matmul.pack_int4(codes)
    gm = matmul.to_group_major(packed, scales, mins)
    x = _randn(m, k, seed=82, dtype=torch.bfloat16)
    bias = _randn(n, seed=83, dtype=torch.bfloat16)

    class Looping:  # launched where _launch launches `_int4_kernel`, on three programs whatever its grid
        def __getitem__(self, grid):
            return _looping_int4_kernel[(1, 3)]

    cases = [
        dict(rows=x[:1], weight=(packed, scales, mins), options={}),
        dict(rows=x, weight=(packed, scales, mins), options=dict(packed_bf16=True, bias=bias)),
        dict(rows=x[:5], weight=gm, options=dict(packed_bf16=True, activation="silu")),
        dict(rows=x, weight=gm, options=dict(out_dtype=torch.float32)),
    ]
    counters = matmul.split_counters(DEVICE)
    for row_tile_programs in (matmul.ROW_TILE_PROGRAMS, 1):  # 1: a program takes 2 or 4 row tiles from 17 rows
        monkeypatch.setattr(matmul, "ROW_TILE_PROGRAMS", row_tile_programs)
        for layer_counters in (counters, None):
            for case in cases:
                rows, weight, options = case["rows"], case["weight"], case["options"]
                launched = matmul.int4_matmul(rows, *weight, counters=layer_counters, **options)
                with monkeypatch.context() as patch:
                    patch.setattr(matmul, "_int4_kernel", Looping())
                    looped = matmul.int4_matmul(rows, *weight, counters=layer_counters, **options)
                assert torch.equal(looped, launched), (len(rows), options, row_tile_programs, layer_counters is None)
    # the norm in the prologue, with the residual's delta: x + delta stored by the tile first along N and K
    delta = _randn(2, k, seed=84, dtype=torch.bfloat16)
    norm_weight = _randn(k, seed=85, dtype=torch.bfloat16)
    for layer_counters in (counters, None):
        results = []
        for kernel in (matmul._int4_kernel, Looping()):
            total, normed = norm.normed_rows(x[:2], delta, norm_weight, 1e-5)
            total.fill_(float("nan"))
            with monkeypatch.context() as patch:
                patch.setattr(matmul, "_int4_kernel", kernel)
                out = matmul.int4_matmul(normed, *gm, packed_bf16=True, counters=layer_counters, activation="silu")
            results.append((out, total))
        (launched, launched_total), (looped, looped_total) = results
        assert torch.equal(launched_total, (x[:2].float() + delta.float()).to(torch.bfloat16))
        assert torch.equal(looped_total, launched_total) and torch.equal(looped, launched), layer_counters is None
    assert matmul._row_tiles(x, n, matmul.config_for(matmul.INT4_CONFIG, n, k)) == {"ROW_TILES": 4}
    assert not counters.any()  # every tile's counter back at 0 for the next call


def test_group_major_int4_weights_give_the_row_major_bits():
    """`to_group_major` puts each group's outputs one after another (codes [K / 32, N, 16], scales and
    mins [K / 32, N]); every int4 kernel reads it with the row-major bits: float inputs (float32, and
    bfloat16 with and without packed bfloat16 FMAs), int8 inputs through dp4a and on the tensor cores,
    with K splits (the last not a whole step) summed by the sum kernel and by each tile's last split,
    a bias, N not a multiple of the tile."""
    m, k, n = 13, 1024 + 160, 80
    codes, scales, mins, _ = _int4_weight(n, k, torch.float16, seed=71)
    packed = matmul.pack_int4(codes)
    gm_packed, gm_scales, gm_mins = matmul.to_group_major(packed, scales, mins)
    # the layout itself: byte j of output o's group g, and its scale and min
    assert gm_packed.shape == (k // 32, n, 16) and gm_scales.shape == gm_mins.shape == (k // 32, n)
    for o, g in ((0, 0), (n - 1, 3), (37, k // 32 - 1)):
        assert torch.equal(gm_packed[g, o], packed[o, 16 * g : 16 * g + 16]), (o, g)
        assert gm_scales[g, o] == scales[o, g] and gm_mins[g, o] == mins[o, g], (o, g)
    x = _randn(m, k, seed=72)
    bias = _randn(n, seed=73)
    bf16 = (scales.to(torch.bfloat16), mins.to(torch.bfloat16))
    gm_bf16 = matmul.to_group_major(packed, *bf16)
    for rows in (x[:1], x[:3], x):  # dp4a for up to 8 rows, the tensor cores from 9
        for counters in (None, matmul.split_counters(DEVICE)):
            for dtype in (torch.float32, torch.bfloat16):
                row_major = matmul.int4_matmul(rows.to(dtype), packed, scales, mins, None, bias, counters=counters)
                group_major = matmul.int4_matmul(
                    rows.to(dtype), gm_packed, gm_scales, gm_mins, None, bias, counters=counters
                )
                assert torch.equal(group_major, row_major), (len(rows), dtype)
            x16 = rows.to(torch.bfloat16)
            group_major = matmul.int4_matmul(x16, *gm_bf16, packed_bf16=True, counters=counters)
            assert torch.equal(group_major, matmul.int4_matmul(x16, packed, *bf16, packed_bf16=True, counters=counters))
            group_major = matmul.int4_int8_matmul(
                rows, gm_packed, gm_scales, gm_mins, torch.float32, bias, counters=counters
            )
            row_major = matmul.int4_int8_matmul(rows, packed, scales, mins, torch.float32, bias, counters=counters)
            assert torch.equal(group_major, row_major), len(rows)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, a zero's sign too (torch.equal holds -0.0 equal to 0.0)."""
    as_int = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[a.dtype]
    return a.dtype == b.dtype and torch.equal(a.view(as_int), b.view(as_int))


_LAUNCH = matmul._launch  # as imported, whatever a test patches


@pytest.mark.parametrize("layout", ["int4", "int4-bf16x2-group-major", "int8"])
def test_a_program_of_several_row_tiles_gives_the_bits_of_a_tile_a_program(monkeypatch, layout):
    """The int4 and int8 (Q8_0) kernels' programs of 2 and 4 row tiles (`row_tiles_for`: 20 rows; 40, the
    third tile partly and the fourth wholly past M; 72, two programs of 4 tiles), each weight tile
    dequantized once for all of them, give the bits of a program a tile: with a bias and no K split, and
    through three K splits (the sum kernel, a tile's last split) with the output plain, the gated
    activation's epilogue and RoPE's with the cache write; int4 codes with float16 scales as stored, and
    by packed bfloat16 FMAs group major. float32 inputs keep a tile a program."""
    monkeypatch.setattr(matmul, "ROW_TILE_PROGRAMS", 1)  # row tiles by the rows alone at this small layer
    tiles = []
    monkeypatch.setattr(
        matmul,
        "_launch",
        lambda kernel, *a, **kw: tiles.append(kw.get("ROW_TILES", 1)) or _LAUNCH(kernel, *a, **kw),
    )
    heads, kv_heads, head_dim = 3, 1, 40
    n, k = (heads + 2 * kv_heads) * head_dim, 1024 + 160  # 200 outputs: 4 column tiles; 3 K splits of 512
    if layout == "int8":
        codes, scales, _ = _int8_weight(n, k, seed=80)
        weight = (codes, scales)
    else:
        codes, scales, mins, _ = _int4_weight(n, k, torch.float16 if layout == "int4" else torch.bfloat16, seed=80)
        weight = (matmul.pack_int4(codes), scales, mins)
    bias = _randn(n, seed=81, dtype=torch.bfloat16)

    def run(x, counters, epilogue=None, rope=None):
        ws, b = [t[:, : t.shape[1] * x.shape[1] // k] for t in weight], bias
        if epilogue == "silu":
            ws, b = [matmul.interleave_gate_up(t) for t in ws], matmul.interleave_gate_up(b)
        elif epilogue == "rope":
            pair = partial(matmul.interleave_rope, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim)
            ws, b = [pair(t) for t in ws], pair(b)
        activation = epilogue if epilogue != "rope" else None
        if layout == "int8":
            return matmul.int8_group_matmul(x, *ws, None, b, counters, activation, rope)
        if layout != "int4":
            ws = matmul.to_group_major(*ws)
        return matmul.int4_matmul(x, *ws, None, b, layout != "int4", counters, activation, rope)

    for m, row_tiles in ((20, 2), (40, 4), (72, 4)):
        x = _randn(m, k, seed=82, dtype=torch.bfloat16)
        slots = (torch.arange(m, dtype=torch.int32) * 7 % 48).to(DEVICE)
        cos, sin = (_randn(m, 1, head_dim, seed=seed, dtype=torch.bfloat16) for seed in (83, 84))
        calls = [
            (x[:, :512], None, None),
            *((x, counters, e) for counters in (None, matmul.split_counters(DEVICE)) for e in (None, "silu", "rope")),
        ]
        for short, counters, epilogue in calls:
            outs = []
            for most in (row_tiles, 1):
                monkeypatch.setattr(matmul, "MAX_ROW_TILES", most)
                caches = [
                    torch.full((6, 8, kv_heads, head_dim), 7.0, dtype=torch.bfloat16, device=DEVICE) for _ in range(2)
                ]
                rope = matmul.RopeStore(cos, sin, *caches, slots, heads) if epilogue == "rope" else None
                tiles.clear()
                outs.append((run(short, counters, epilogue, rope), *caches))
                assert set(tiles) == {most}, (m, epilogue, tiles)
            for got, expected in zip(*outs, strict=True):
                assert torch.equal(got, expected), (m, short.shape, counters is None, epilogue)
    monkeypatch.setattr(matmul, "MAX_ROW_TILES", 4)  # float32 inputs (FMA dots, not the tensor cores): one tile
    tiles.clear()
    x = _randn(40, k, seed=85)
    (matmul.int8_group_matmul if layout == "int8" else matmul.int4_matmul)(
        x[:, :512], *[t[:, : t.shape[1] * 512 // k] for t in weight]
    )
    assert tiles == [1], tiles


def _record_launches(monkeypatch, launches: list) -> None:
    """matmul._launch patched to append each kernel's name to `launches`, then launch it."""
    monkeypatch.setattr(
        matmul, "_launch", lambda kernel, *a, **kw: launches.append(kernel.__name__) or _LAUNCH(kernel, *a, **kw)
    )


def _int8_input_calls(x, packed, scales, mins, codes8, scales8, bias):
    """int4 and int8 codes times x's int8 form, as calls of (out_dtype, counters)."""

    def int4(out_dtype, counters):
        return matmul.int4_int8_matmul(x, packed, scales, mins, out_dtype, bias, counters=counters)

    def int8(out_dtype, counters):
        return matmul.int8_int8_matmul(x, codes8, scales8, out_dtype, bias, counters=counters)

    return int4, int8


@pytest.mark.parametrize("pairs", [128, 256])
def test_a_layers_k_splits_in_one_program_give_the_bits_of_their_partial_sums(monkeypatch, pairs):
    """matmul.SPLITS_IN_PROGRAM (128 by default): up to 8 rows of an int4 layer, each (split, output) pair
    on a thread of its own in one program and each output's splits added there in split order, in either
    layout: the bits of the splits' partial sums added by the sum kernel and by each tile's last split,
    with a bias, in float32 and bfloat16; 3, 6 and 32 splits (padded to a power of two) among them.
    int8 codes keep a program a split."""
    # m, k, n, rows; N <= 4096: splits of 256
    cases = [(13, 2048, 80, 3), (8, 1024, 40, 8), (1, 8192, 24, 1), (2, 768, 40, 2), (5, 1536, 72, 5)]
    launches = []
    for m, k, n, rows in cases:
        codes, scales, mins, _ = _int4_weight(n, k, torch.float16, seed=76)
        packed = matmul.pack_int4(codes)
        codes8, scales8, _ = _int8_weight(n, k, seed=77)
        x = _randn(m, k, seed=78)[:rows]
        bias = _randn(n, seed=79)
        runs = _int8_input_calls(x, packed, scales, mins, codes8, scales8, bias)
        gm = matmul.to_group_major(packed, scales, mins)
        monkeypatch.setattr(matmul, "SPLITS_IN_PROGRAM", 0)  # each split a program, their partials in memory
        expected = []
        for out_dtype in (torch.float32, torch.bfloat16):
            for run in runs:
                expected.append(run(out_dtype, None))
                assert torch.equal(run(out_dtype, matmul.split_counters(DEVICE)), expected[-1])
            expected.append(expected[-2])  # the group-major layout: the row-major bits
        monkeypatch.setattr(matmul, "SPLITS_IN_PROGRAM", pairs)
        _record_launches(monkeypatch, launches)
        got = []
        for out_dtype in (torch.float32, torch.bfloat16):
            got += [run(out_dtype, None) for run in runs]
            got.append(matmul.int4_int8_matmul(x, *gm, out_dtype, bias))
        monkeypatch.undo()
        assert all(_same_bits(a, b) for a, b in zip(got, expected, strict=True)), (m, k, n)
    per_case = ["_int4_int8_splits_kernel", "_int4_int8_kernel", "_int4_int8_splits_kernel"] * 2
    assert launches == per_case * len(cases)


@pytest.mark.parametrize("words, split", [(256, 512), (2048, 512), (1024, 256), (1024, 1024)])
def test_the_code_words_over_the_threads_give_the_splits_kernels_bits(monkeypatch, words, split):
    """matmul.WORDS_IN_THREADS (a candidate, off by default): up to 8 rows of an int4 or int8 (Q8_0) layer
    with int8 inputs, a program's rows of code words spread over its threads, each word's products summed
    alone and a group's words added in integers, then the float steps of the kernels before (the splits
    in one program, or a program a split and their partial sums): their bits, for 1 to 8 rows, 1 to 8
    splits (3 and 5 padded), a column a program or 8, a last tile cut short, bias or not, float32 or
    bfloat16 out; K splits of 4, 8 and 16 groups (INT4_INT8_CONFIG's 256, 512 and 1,024 inputs, halved for
    these narrow layers), up to WORDS_GROUPS (64) groups a row. Group-major codes, K off the splits and
    more groups keep their kernels, as do 9 rows and more."""
    config = dataclasses.replace(matmul.INT4_INT8_CONFIG, k_per_split=split)
    monkeypatch.setattr(matmul, "INT4_INT8_CONFIG", config)
    cases = [(1, 2048, 24), (3, 768, 40), (8, 1024, 16), (5, 8192, 8), (1, 256, 20), (2, 1280, 12)]
    if split != 512:  # fewer cases for the other split lengths (the interpreter's time)
        cases = cases[1:3] + cases[4:5]
    groups = split // 2 // 32  # a K split's (halved for these narrow layers); the splits padded
    fits = lambda k: k % (split // 2) == 0 and gpu.next_power_of_2(k // (split // 2)) * groups <= matmul.WORDS_GROUPS  # noqa: E731
    cases = [(m, k, n) for m, k, n in cases if fits(k)]
    launches = []
    for m, k, n in cases:
        codes, scales, mins, _ = _int4_weight(n, k, torch.float16, seed=80)
        packed = matmul.pack_int4(codes)
        codes8, scales8, _ = _int8_weight(n, k, seed=84)
        x = _randn(m, k, seed=81)
        bias = _randn(n, seed=82)
        weights = [(matmul.int4_int8_matmul, (packed, scales, mins)), (matmul.int8_int8_matmul, (codes8, scales8))]
        calls = [
            (partial(run, x, *weight), out_dtype, b)
            for run, weight in weights
            for out_dtype in (torch.float32, torch.bfloat16)
            for b in (None, bias)
        ]
        expected = [call(out_dtype, b) for call, out_dtype, b in calls]
        monkeypatch.setattr(matmul, "WORDS_IN_THREADS", words)
        _record_launches(monkeypatch, launches)
        got = [call(out_dtype, b) for call, out_dtype, b in calls]
        monkeypatch.undo()
        monkeypatch.setattr(matmul, "INT4_INT8_CONFIG", config)
        assert all(_same_bits(a, b) for a, b in zip(got, expected, strict=True)), (m, k, n)
    assert cases and launches == ["_int4_int8_words_kernel"] * len(calls) * len(cases)
    if split != 512:
        return
    # not for group-major codes, a K that is not a whole number of splits, more than WORDS_GROUPS groups
    # (33 splits of 8), nor 9 rows and more
    codes, scales, mins, _ = _int4_weight(16, 1184, torch.float16, seed=83)
    monkeypatch.setattr(matmul, "WORDS_IN_THREADS", words)
    _record_launches(monkeypatch, launches)
    launches.clear()
    x = _randn(9, 1184, seed=85)
    gm = matmul.to_group_major(matmul.pack_int4(codes[:, :1024]), scales[:, :32], mins[:, :32])
    matmul.int4_int8_matmul(x[:1, :1024], *gm)
    matmul.int4_int8_matmul(x[:1], matmul.pack_int4(codes), scales, mins)
    matmul.int4_int8_matmul(x[:, :1024], matmul.pack_int4(codes[:, :1024]), scales[:, :32], mins[:, :32])
    codes8, scales8, _ = _int8_weight(4, 33 * 256, seed=86)
    matmul.int8_int8_matmul(_randn(1, 33 * 256, seed=87), codes8, scales8)
    kept = ["_int4_int8_splits_kernel", "_int4_int8_kernel", "_int4_int8_mma_kernel", "_int4_int8_kernel"]
    assert launches == kept, launches


def _int8_weight(n: int, k: int, seed: int):
    g = _generator(seed)
    codes = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scales = torch.rand(n, k // 32, generator=g) * 0.01
    dequantized = codes.float() * scales.repeat_interleave(32, dim=1)  # one float32 rounding, as documented
    return codes.to(DEVICE), scales.to(DEVICE), dequantized.to(DEVICE)


@pytest.mark.parametrize(
    "dtype, out_dtype", [(torch.bfloat16, torch.float32), (torch.bfloat16, None), (torch.float32, None)]
)
def test_int8_group_matmul_against_float64(dtype, out_dtype):
    m, k, n = 13, 1024 + 96, 72
    codes, scales, w = _int8_weight(n, k, seed=16)
    x = _randn(m, k, seed=17, dtype=dtype)
    bias = _randn(n, seed=18)
    out = matmul.int8_group_matmul(x, codes, scales, out_dtype, bias)
    assert out.dtype == (out_dtype or dtype)
    _check_matmul(out, x, w.to(dtype), bias)


def test_int8_int8_matmul_against_float64_rows_alone_and_on_the_tensor_cores():
    """Q8_0 codes times inputs quantized per group (`int8_int8_matmul`): within float32's summation of
    the quantized inputs times the weight; with K splits (the last not a whole step) and a bias; each
    row alone its bits in the batch, through dp4a (few rows) and the tensor cores (many) alike."""
    m, k, n = 41, 1024 + 160, 80
    codes, scales, w = _int8_weight(n, k, seed=90)
    x = _randn(m, k, seed=91, dtype=torch.bfloat16)
    bias = _randn(n, seed=92)
    run = lambda rows: matmul.int8_int8_matmul(rows, codes, scales, torch.float32, bias)  # noqa: E731
    out = run(x)
    q, d, _ = _quantized_inputs(x)
    rounded = (q.double().reshape(m, -1, 32) * d.double()[..., None]).reshape(m, k).to(DEVICE)
    _check_matmul(out, rounded, w.double(), bias)
    few = matmul.INT4_INT8_MMA_ROWS - 1
    assert torch.equal(torch.cat([run(x[i : i + few]) for i in range(0, m, few)]), out)
    assert torch.equal(torch.cat([run(x[:20]), run(x[20:32]), run(x[32:])]), out)
    for row in (0, m // 2, m - 1):
        assert torch.equal(run(x[row : row + 1])[0], out[row]), row


def test_int8_group_matmul_each_row_alone():
    m, k, n = 37, 1024 + 64, 48
    codes, scales, _ = _int8_weight(n, k, seed=19)
    x = _randn(m, k, seed=20, dtype=torch.bfloat16)
    out = matmul.int8_group_matmul(x, codes, scales, torch.float32)
    _each_row_alone(lambda rows: matmul.int8_group_matmul(rows, codes, scales, torch.float32), x, out)


# --- Elementwise: the gated activation, RoPE, the residual add with its norm


@pytest.mark.parametrize("gelu", [False, True], ids=["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gated_activation_against_float64_and_each_row_alone(gelu, dtype):
    gate_up = _randn(7, 2 * 1100, seed=40, dtype=dtype) * 3  # 1100 outputs: two programs a row, one short
    out = elementwise.gated_activation(gate_up, gelu)
    assert out.dtype == dtype and out.shape == (7, 1100)
    gate, up = gate_up.double().cpu().split(1100, dim=-1)
    # x * sigmoid(z): SiLU, and tanh-GELU as 0.5 x (1 + tanh(y)) = x * sigmoid(2 y) (PyTorch's float32
    # 1 + tanh(y) cancels to 0 below x = -5, where the value is 1e-9)
    z = 2 * 0.7978845608028654 * (gate + 0.044715 * gate**3) if gelu else gate
    act = (gate * torch.sigmoid(z)).to(dtype).double()  # stored in the activations' dtype, as F.silu does
    expected = (act * up).to(DEVICE)
    if dtype == torch.float32:  # the GPU's exp is within a few ulp
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-30)
    else:  # within an ulp of the activation's rounding and the product's
        assert ((out.double() - expected).abs() <= 2 * BF16_ULP * expected.abs()).all()
        assert (out.double() == expected.to(dtype).double()).double().mean() > 0.98
    _each_row_alone(lambda rows: elementwise.gated_activation(rows, gelu), gate_up, out)


@pytest.mark.parametrize("kind", ["float", "int4", "int4-bf16x2", "int8"])
@pytest.mark.parametrize("gelu", [False, True], ids=["silu", "gelu_tanh"])
def test_a_gate_up_matmul_with_its_activation_gives_the_gated_activations_bits(monkeypatch, kind, gelu):
    """A gate and up projection's matmul with `activation` over its interleaved rows (`interleave_gate_up`)
    gives act(gate) * up: the bits of the matmul over [gate | up] and then `gated_activation`, whichever
    stores the output (a tile without K splits, a tile's last split, the sum kernel), with a bias and
    37 outputs (an odd count; pairs are never cut by a tile); `deinterleave_gate_up` undoes the layout."""
    monkeypatch.setattr(matmul, "FLOAT_CONFIG", dataclasses.replace(matmul.FLOAT_CONFIG, k_per_split=512))
    m, intermediate = 5, 37
    x = _randn(m, 1024 + 160, seed=60, dtype=torch.bfloat16)  # three K splits, the last one short
    bias = _randn(2 * intermediate, seed=61, dtype=torch.bfloat16)
    activation = "gelu_tanh" if gelu else "silu"
    if kind == "float":
        w = _randn(2 * intermediate, x.shape[1], seed=62, dtype=torch.bfloat16)
        weights = [w]
        run = lambda x, w, activation=None, counters=None: matmul.matmul(  # noqa: E731
            x, w, bias if activation is None else matmul.interleave_gate_up(bias), None, counters, activation
        )
    elif kind == "int8":
        codes, scales, _ = _int8_weight(2 * intermediate, x.shape[1], seed=62)
        weights = [codes, scales]
        run = lambda x, codes, scales, activation=None, counters=None: matmul.int8_group_matmul(  # noqa: E731
            x,
            codes,
            scales,
            None,
            bias if activation is None else matmul.interleave_gate_up(bias),
            counters,
            activation,
        )
    else:
        codes, scales, mins, _ = _int4_weight(2 * intermediate, x.shape[1], torch.bfloat16, seed=62)
        weights = [matmul.pack_int4(codes), scales, mins]
        run = lambda x, packed, scales, mins, activation=None, counters=None: matmul.int4_matmul(  # noqa: E731
            x,
            packed,
            scales,
            mins,
            None,
            bias if activation is None else matmul.interleave_gate_up(bias),
            kind == "int4-bf16x2",
            counters,
            activation,
        )
    interleaved = [matmul.interleave_gate_up(t) for t in weights]
    for t, back in zip(weights, interleaved, strict=True):
        assert torch.equal(matmul.deinterleave_gate_up(back), t)
    for short in (x[:, :512], x):  # one K split (no partial sums), three
        ws = [w[:, : w.shape[1] * short.shape[1] // x.shape[1]] for w in weights]
        expected = elementwise.gated_activation(run(short, *ws), gelu)
        ws = [matmul.interleave_gate_up(w) for w in ws]
        for counters in (None, matmul.split_counters(DEVICE)):  # the sum kernel, the tile's last split
            out = run(short, *ws, activation=activation, counters=counters)
            assert out.shape == (m, intermediate) and torch.equal(out, expected), (short.shape, counters is None)


KINDS_WITH_ROPE = ["float", "int4", "int4-bf16x2", "int8", "int4-int8", "int4-int8-mma", "int8-int8", "int8-int8-mma"]


@pytest.mark.parametrize("kind", [*KINDS_WITH_ROPE, "int4-int8-one-column", "int4-int8-words", "int8-int8-words"])
def test_a_qkv_matmul_with_rope_gives_rotate_and_stores_bits(monkeypatch, kind):
    """A q/k/v projection's matmul with `rope` over q's and k's rows paired (`interleave_rope`) gives the
    rotated q and writes k and v into the caches: the bits of the plain matmul and then
    `rotate_and_store`, whichever stores the output (a tile without K splits, a tile's last split, the
    splits in one program, the RoPE kernel after the sum kernel or where a tile is one column wide), with
    float and int8 inputs (dp4a for 5 rows, the tensor cores for 20), a bias, a KV head for three query
    heads, heads of 40 so that tiles (of 32 and 64 columns) hold q's edge with k and k's with v, and a
    negative slot (no write); `deinterleave_rope` undoes the layout."""
    monkeypatch.setattr(matmul, "FLOAT_CONFIG", dataclasses.replace(matmul.FLOAT_CONFIG, k_per_split=512))
    if kind == "int4-int8-one-column":  # four splits in one program of four pairs: a column a tile
        monkeypatch.setattr(matmul, "SPLITS_IN_PROGRAM", 4)
    launches = []
    if kind.endswith("-words"):  # the code words over the threads: tiles of 1 to 8 columns
        monkeypatch.setattr(matmul, "WORDS_IN_THREADS", 2048)
        _record_launches(monkeypatch, launches)
    m, heads, kv_heads, head_dim = 20 if kind.endswith("mma") else 5, 3, 1, 40  # q | k at column 120, k | v at 160
    n = (heads + 2 * kv_heads) * head_dim
    x = _randn(m, 1024 + 160, seed=63, dtype=torch.bfloat16)  # three K splits, the last one short
    bias = _randn(n, seed=64, dtype=torch.bfloat16)
    cos, sin = (
        _randn(m, 1, head_dim, seed=65, dtype=torch.bfloat16),
        _randn(m, 1, head_dim, seed=66, dtype=torch.bfloat16),
    )
    slots = (torch.arange(m, dtype=torch.int32) * 7 % 48).to(DEVICE)  # 48 slots, one each
    slots[2] = -1
    pair = lambda t, dim=0: matmul.interleave_rope(t, heads, kv_heads, head_dim, dim)  # noqa: E731
    if kind == "float":
        weights = [_randn(n, x.shape[1], seed=67, dtype=torch.bfloat16)]
        run = lambda x, w, bias, counters, rope=None: matmul.matmul(x, w, bias, None, counters, rope=rope)  # noqa: E731
    elif kind.startswith("int8"):
        codes, scales, _ = _int8_weight(n, x.shape[1], seed=67)
        weights = [codes, scales]
        if kind == "int8":
            run = lambda x, c, s, bias, counters, rope=None: matmul.int8_group_matmul(  # noqa: E731
                x, c, s, None, bias, counters, rope=rope
            )
        else:
            run = lambda x, c, s, bias, counters, rope=None: matmul.int8_int8_matmul(  # noqa: E731
                x, c, s, None, bias, counters=counters, rope=rope
            )
    else:
        codes, scales, mins, _ = _int4_weight(n, x.shape[1], torch.bfloat16, seed=67)
        weights = [matmul.pack_int4(codes), scales, mins]
        if kind.startswith("int4-int8"):
            run = lambda x, p, s, mn, bias, counters, rope=None: matmul.int4_int8_matmul(  # noqa: E731
                x, p, s, mn, None, bias, counters=counters, rope=rope
            )
        else:
            run = lambda x, p, s, mn, bias, counters, rope=None: matmul.int4_matmul(  # noqa: E731
                x, p, s, mn, None, bias, kind == "int4-bf16x2", counters, rope=rope
            )
    for t in weights:
        assert torch.equal(matmul.deinterleave_rope(pair(t), heads, kv_heads, head_dim), t)
    # K splits of 512 (float, int4) or 256 (int8 inputs): one (no partial sums); two or four (int4 x int8:
    # in one program); three or five, the last short
    for short in (x[:, :256], x[:, :1024], x):
        ws = [w[:, : w.shape[1] * short.shape[1] // x.shape[1]] for w in weights]
        for counters in (None, matmul.split_counters(DEVICE)):  # the sum kernel, the tile's last split
            caches = [
                torch.full((6, 8, kv_heads, head_dim), 7.0, dtype=torch.bfloat16, device=DEVICE) for _ in range(4)
            ]  # 48 slots
            plain = run(short, *ws, bias, counters).view(m, heads + 2 * kv_heads, head_dim)
            qk, v = plain.split([heads + kv_heads, kv_heads], dim=1)
            expected = elementwise.rotate_and_store(qk, v, cos, sin, caches[0], caches[1], slots)
            rope = matmul.RopeStore(cos, sin, caches[2], caches[3], slots, heads)
            got = run(short, *[pair(w) for w in ws], pair(bias), counters, rope=rope)
            assert got.shape == (m, heads * head_dim) and torch.equal(got.view(m, heads, head_dim), expected)
            assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1]), counters is None
    assert ("_int4_int8_words_kernel" in launches) == kind.endswith("-words")


@pytest.mark.parametrize("rotary_dim", [64, 32], ids=["whole-head", "partial"])
def test_rotate_matches_layers_rotary_on_a_strided_view(rotary_dim):
    from kvserve.layers import rotary

    tokens, heads, head_dim = 5, 6, 64
    qkv = _randn(tokens, (heads + 2) * head_dim, seed=41, dtype=torch.bfloat16)  # q and k of 6 heads, then v
    qk = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)[..., :rotary_dim]  # strided as in Attention
    angles = _randn(tokens, 1, rotary_dim // 2, seed=42)
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(torch.bfloat16)
    sin = torch.cat([-angles.sin(), angles.sin()], -1).to(torch.bfloat16)
    out = elementwise.rotate(qk, cos, sin)
    expected = rotary.rotate(qk.cpu().float(), cos.cpu().float(), sin.cpu().float())
    # x * cos is rounded to bfloat16 first (as addcmul's first operand), then the sum once
    first = (qk.cpu().float() * cos.cpu().float()).to(torch.bfloat16).float()
    exact = first + qk.cpu().float().roll(rotary_dim // 2, dims=-1) * sin.cpu().float()
    assert out.shape == (tokens, heads, rotary_dim) and out.is_contiguous()
    assert torch.equal(out.cpu(), exact.to(torch.bfloat16))
    torch.testing.assert_close(out.cpu().float(), expected, rtol=2 * BF16_ULP, atol=1e-2)
    assert torch.equal(elementwise.rotate(qk[2:3], cos[2:3], sin[2:3])[0], out[2])


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32])
def test_rotate_and_store_is_the_bits_of_rotate_then_store_kv(cache_dtype):
    """q rotated as `rotate` gives it, k rotated and v written into the caches as `store_kv` writes them
    (a negative slot: nothing), from the strided views of a fused projection's output, GQA."""
    tokens, heads, kv_heads, head_dim, num_blocks = 5, 6, 2, 32, 4
    qkv = _randn(tokens, (heads + 2 * kv_heads) * head_dim, seed=43, dtype=torch.bfloat16)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    angles = _randn(tokens, 1, head_dim // 2, seed=44)
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(torch.bfloat16)
    sin = torch.cat([-angles.sin(), angles.sin()], -1).to(torch.bfloat16)
    slots = torch.tensor([37, -1, 0, 63, 5], dtype=torch.int32, device=DEVICE)
    caches = [_randn(num_blocks, BLOCK_SIZE, kv_heads, head_dim, seed=s, dtype=cache_dtype) for s in (45, 46)]
    expected = [c.clone() for c in caches]
    rotated = elementwise.rotate(qk, cos, sin)
    attention.store_kv(rotated[:, heads:], v, *expected, slots)
    q = elementwise.rotate_and_store(qk, v, cos, sin, *caches, slots)
    assert q.shape == (tokens, heads, head_dim) and q.is_contiguous()
    assert torch.equal(q, rotated[:, :heads])
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_add_rms_norm_is_the_bits_of_the_add_then_the_norm(dtype):
    x = _randn(9, 1100, seed=43, dtype=dtype) * 3  # the row padded with zeros to 2,048
    delta = _randn(9, 1100, seed=44, dtype=dtype)
    weight = _randn(1100, seed=45, dtype=dtype)
    total, out = norm.add_rms_norm(x, delta, weight, 1e-5)
    assert torch.equal(total, x + delta)
    assert torch.equal(out, norm.rms_norm(x + delta, weight, 1e-5))
    row_total, row_out = norm.add_rms_norm(x[4:5], delta[4:5], weight, 1e-5)
    assert torch.equal(row_total[0], total[4]) and torch.equal(row_out[0], out[4])


# --- Paged attention

BLOCK_SIZE = 16


@dataclasses.dataclass
class PagedCache:
    """A layer's caches holding sequences of the given lengths in scattered blocks. Block 0 belongs to
    no sequence and pads the block tables; it and every slot past a sequence's length hold NaN, so a
    kernel that reads a key it should not gives NaN."""

    k: torch.Tensor  # [num_blocks, BLOCK_SIZE, Hkv, D]
    v: torch.Tensor
    tables: list[list[int]]  # block ids of each sequence

    @classmethod
    def make(cls, lengths: list[int], num_kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int) -> "PagedCache":
        g = _generator(seed)
        needed = [-(-length // BLOCK_SIZE) for length in lengths]
        num_blocks = 1 + sum(needed) + 3  # three blocks of no one
        free = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
        tables = [[free.pop() for _ in range(n)] for n in needed]
        shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
        k, v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
        for cache in (k, v):
            cache[0] = float("nan")
            for table, length in zip(tables, lengths, strict=True):
                cache[table[-1], length - (len(table) - 1) * BLOCK_SIZE :] = float("nan")
        return cls(k.to(dtype).to(DEVICE), v.to(dtype).to(DEVICE), tables)

    def block_tables(self) -> torch.Tensor:
        width = max(len(t) for t in self.tables)
        rows = [t + [0] * (width - len(t)) for t in self.tables]
        return torch.tensor(rows, dtype=torch.int32, device=DEVICE)

    def keys(self, seq: int, begin: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [end - begin, Hkv, D] of positions begin..end-1 of a sequence, gathered by hand."""
        table = torch.tensor(self.tables[seq])
        pos = torch.arange(begin, end)
        blocks, offsets = table[pos // BLOCK_SIZE].to(DEVICE), (pos % BLOCK_SIZE).to(DEVICE)
        return self.k[blocks, offsets], self.v[blocks, offsets]


@dataclasses.dataclass
class Step:
    """A call's query tokens: per sequence (seq, first position, number of tokens), flattened in order
    and cut into tiles of `tokens_per_tile`; the first tile of each sequence holds `first_tile` tokens
    where given (to move the tile boundaries)."""

    spans: list[tuple[int, int, int]]
    first_tile: int | None = None

    def tensors(self, tokens_per_tile: int):
        assert (self.first_tile or 1) <= tokens_per_tile, "a tile holds at most tokens_per_tile tokens"
        positions, tile_seq, tile_first, tile_len = [], [], [], []
        for seq, begin, count in self.spans:
            row = len(positions)
            positions += range(begin, begin + count)
            done = 0
            while done < count:
                size = min(count - done, self.first_tile if done == 0 and self.first_tile else tokens_per_tile)
                tile_seq.append(seq)
                tile_first.append(row + done)
                tile_len.append(size)
                done += size
        as_tensor = lambda values: torch.tensor(values, dtype=torch.int32, device=DEVICE)  # noqa: E731
        return as_tensor(positions), as_tensor(tile_seq), as_tensor(tile_first), as_tensor(tile_len)


def _attend(cache: PagedCache, step: Step, q: torch.Tensor, window: int = 0, num_splits: int = 1, **kwargs):
    num_heads, num_kv_heads = q.shape[1], cache.k.shape[2]
    positions, tile_seq, tile_first, tile_len = step.tensors(attention.tokens_per_tile(num_heads, num_kv_heads))
    scale = q.shape[2] ** -0.5
    return attention.paged_attention(
        q, cache.k, cache.v, cache.block_tables(), positions, tile_seq, tile_first, tile_len, scale, window,
        num_splits, **kwargs,
    )  # fmt: skip


def _reference(cache: PagedCache, step: Step, q: torch.Tensor, window: int) -> torch.Tensor:
    """Each query token's softmax over its own keys, in float64, from keys gathered by hand."""
    group = q.shape[1] // cache.k.shape[2]
    rows = []
    for seq, begin, count in step.spans:
        for pos in range(begin, begin + count):
            k, v = cache.keys(seq, max(0, pos - window + 1) if window else 0, pos + 1)
            k, v = k.double().repeat_interleave(group, dim=1), v.double().repeat_interleave(group, dim=1)
            scores = torch.einsum("hd,khd->hk", q[len(rows)].double(), k) * q.shape[2] ** -0.5
            rows.append(torch.einsum("hk,khd->hd", scores.softmax(dim=-1), v))
    return torch.stack(rows)


def test_tokens_per_tile_and_num_splits_for():
    rows = attention.ROWS
    assert attention.tokens_per_tile(4, 4) == rows
    assert attention.tokens_per_tile(8, 2) == rows // 4
    assert attention.tokens_per_tile(14, 2) == rows // 7  # a group of 7 heads: 2 tokens in 14 of 16 rows
    assert attention.tokens_per_tile(4 * rows, 2) == 1  # a group wider than ROWS: one token per program
    assert attention.num_splits_for(0) == 1
    assert attention.num_splits_for(attention.SPLIT_KEYS - 1) == 1
    assert attention.num_splits_for(attention.SPLIT_KEYS) == 2


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_store_kv_writes_each_token_at_its_slot_and_skips_negative_slots(cache_dtype, slot_dtype):
    num_blocks, num_kv_heads, head_dim = 4, 2, 24
    # each cache is a view behind a guard block, which a write through a negative slot would reach
    memory = [_randn(1 + num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, seed=s, dtype=cache_dtype) for s in (30, 31)]
    expected = [m.clone() for m in memory]
    k = _randn(5, num_kv_heads, head_dim, seed=32)  # float32, rounded to the cache's dtype on the way in
    v = _randn(5, num_kv_heads, head_dim, seed=33)
    slots = torch.tensor([37, -1, 0, 63, -5], dtype=slot_dtype, device=DEVICE)
    attention.store_kv(k, v, memory[0][1:], memory[1][1:], slots)
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            for cache, new in zip(expected, (k, v), strict=True):
                cache[1:].view(-1, num_kv_heads, head_dim)[slot] = new[token].to(cache_dtype)
    assert torch.equal(memory[0], expected[0]) and torch.equal(memory[1], expected[1])


# (sequence lengths in the cache, query spans, query heads, KV heads, head_dim)
ATTENTION_CASES = {
    # one token each of three sequences, the longest past two splits of 64
    "decode-gqa": ([5, 37, 150], [(0, 4, 1), (1, 36, 1), (2, 149, 1)], 4, 2, 32),
    # two whole prompts, one head per KV head
    "prefill-mha": ([70, 9], [(0, 0, 70), (1, 0, 9)], 2, 2, 32),
    # 30 tokens behind a cached prefix of 40, beside a decode; groups of 3 heads, head_dim not a power of 2
    "chunk-gqa3": ([70, 20], [(0, 40, 30), (1, 19, 1)], 6, 2, 48),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_paged_attention_against_float64(monkeypatch, case, dtype):
    monkeypatch.setattr(attention, "SPLIT_KEYS", 64)  # splits on short sequences
    lengths, spans, num_heads, num_kv_heads, head_dim = ATTENTION_CASES[case]
    cache = PagedCache.make(lengths, num_kv_heads, head_dim, dtype, seed=40)
    step = Step(spans)
    q = _randn(sum(n for _, _, n in spans), num_heads, head_dim, seed=41, dtype=dtype)
    needed = attention.num_splits_for(max(begin + n - 1 for _, begin, n in spans))
    # bfloat16: the probabilities and the output are rounded to it, each within half an ulp (relative)
    tolerance = 2 * BF16_ULP if dtype == torch.bfloat16 else 1e-5
    for window in (0, 20):
        expected = _reference(cache, step, q, window)
        for num_splits in sorted({1, needed}):
            out = _attend(cache, step, q, window, num_splits)
            assert out.dtype == dtype
            torch.testing.assert_close(out.double(), expected, rtol=0, atol=tolerance)


def test_paged_attention_float32_queries_over_a_float16_cache():
    lengths, spans, num_heads, num_kv_heads, head_dim = ATTENTION_CASES["decode-gqa"]
    cache = PagedCache.make(lengths, num_kv_heads, head_dim, torch.float16, seed=42)
    step = Step(spans)
    q = _randn(len(spans), num_heads, head_dim, seed=43)
    out = _attend(cache, step, q)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), _reference(cache, step, q, 0), rtol=0, atol=1e-5)


@pytest.mark.parametrize("window", [0, 40])
def test_a_tokens_attention_is_the_same_bits_in_decode_prefill_chunk_and_batch(monkeypatch, window):
    """Sequence 0 has 150 tokens: 3 splits of 64 keys. Its tokens' outputs from one prefill (beside a
    second prompt) are the reference bits for every other way of computing them."""
    monkeypatch.setattr(attention, "SPLIT_KEYS", 64)
    num_heads, num_kv_heads, head_dim, length = 4, 2, 32, 150
    cache = PagedCache.make([length, 9, 30], num_kv_heads, head_dim, torch.bfloat16, seed=50)
    q_all = _randn(length, num_heads, head_dim, seed=51, dtype=torch.bfloat16)  # sequence 0's queries
    q_other = _randn(9, num_heads, head_dim, seed=52, dtype=torch.bfloat16)
    prefill = _attend(cache, Step([(0, 0, length), (1, 0, 9)]), torch.cat([q_all, q_other]), window, num_splits=3)
    prefill = prefill[:length]
    torch.testing.assert_close(
        prefill.double(), _reference(cache, Step([(0, 0, length)]), q_all, window), rtol=0, atol=2 * BF16_ULP
    )

    # a chunk of 53 tokens behind a cached prefix of 97, its tiles cut at other boundaries: all splits
    # merged in one program (num_splits = 1), and one program per split with more splits than needed
    chunk = Step([(0, 97, length - 97)], first_tile=3)
    for num_splits in (1, 3, 6):
        assert torch.equal(_attend(cache, chunk, q_all[97:], window, num_splits), prefill[97:]), num_splits

    # decodes, each token alone, its sequence's later slots holding NaN as if not written yet
    for pos in (0, 63, 64, 100, 127, 128, 149):
        alone = PagedCache(cache.k.clone(), cache.v.clone(), cache.tables)
        for later in range(pos + 1, length):
            block, offset = cache.tables[0][later // BLOCK_SIZE], later % BLOCK_SIZE
            alone.k[block, offset] = alone.v[block, offset] = float("nan")
        for num_splits in (1, attention.num_splits_for(pos), 5):
            out = _attend(alone, Step([(0, pos, 1)]), q_all[pos : pos + 1], window, num_splits)
            assert torch.equal(out[0], prefill[pos]), (pos, num_splits)

    # a decode batch where the token is the middle one of three sequences
    batch = Step([(2, 29, 1), (0, length - 1, 1), (1, 8, 1)])
    q = torch.cat([q_other[:1], q_all[-1:], q_other[1:2]])
    assert torch.equal(_attend(cache, batch, q, window, num_splits=3)[1], prefill[-1])


def test_padding_tiles_and_rows_are_left_alone(monkeypatch):
    """A CUDA graph's batch: a fixed num_splits past the need, a tile of length 0, and a row of q in no
    tile, whose output row keeps what it held."""
    monkeypatch.setattr(attention, "SPLIT_KEYS", 64)
    cache = PagedCache.make([37, 100], 2, 32, torch.bfloat16, seed=60)
    q = _randn(3, 4, 32, seed=61, dtype=torch.bfloat16)
    positions = torch.tensor([36, 0, 99], dtype=torch.int32, device=DEVICE)  # row 1 is padding
    tiles = [torch.tensor(t, dtype=torch.int32, device=DEVICE) for t in ([0, 0, 1], [0, 1, 2], [1, 0, 1])]
    out = torch.full_like(q, 7.0)
    attention.paged_attention(q, cache.k, cache.v, cache.block_tables(), positions, *tiles, 32**-0.5, 0, 8, out=out)
    assert (out[1] == 7.0).all()
    step = Step([(0, 36, 1), (1, 99, 1)])
    expected = _attend(cache, step, q[[0, 2]], num_splits=2)
    assert torch.equal(out[[0, 2]], expected)


@pytest.mark.parametrize("window", [0, 40])
def test_the_last_split_merges_the_splits_with_the_combine_kernels_bits(monkeypatch, window):
    """With counters, each (tile, KV head)'s last split program merges the splits: the bits of
    `_combine_kernel`, which is then not launched, the counters all 0 after every call; with a tile of
    length 0 and more splits than the keys need (a CUDA graph's batch); too few counters: the combine
    kernel."""
    monkeypatch.setattr(attention, "SPLIT_KEYS", 64)
    combines = _SumLaunches(attention._combine_kernel)
    monkeypatch.setattr(attention, "_combine_kernel", combines)
    lengths, spans, num_heads, num_kv_heads, head_dim = ATTENTION_CASES["decode-gqa"]
    cache = PagedCache.make(lengths, num_kv_heads, head_dim, torch.bfloat16, seed=62)
    q = _randn(len(spans), num_heads, head_dim, seed=63, dtype=torch.bfloat16)
    counters = attention.attention_counters(DEVICE)
    for step in (Step(spans), Step([(1, 36, 1), (2, 149, 1), (0, 4, 1)])):
        qs = q if step.spans == spans else q[[1, 2, 0]]
        for num_splits in (3, 5):
            expected = _attend(cache, step, qs, window, num_splits)
            launches = combines.launches
            assert torch.equal(_attend(cache, step, qs, window, num_splits, counters=counters), expected)
            assert combines.launches == launches and not counters.any(), num_splits
            too_few = counters[: len(step.spans) * num_kv_heads - 1]
            assert torch.equal(_attend(cache, step, qs, window, num_splits, counters=too_few), expected)
            assert combines.launches == launches + 1
    positions = torch.tensor([36, 0, 149], dtype=torch.int32, device=DEVICE)  # row 1 is a padding tile's
    tiles = [torch.tensor(t, dtype=torch.int32, device=DEVICE) for t in ([1, 0, 2], [0, 1, 2], [1, 0, 1])]
    args = (q, cache.k, cache.v, cache.block_tables(), positions, *tiles, head_dim**-0.5, window, 8)
    expected = attention.paged_attention(*args, out=torch.full_like(q, 7.0))
    out = attention.paged_attention(*args, out=torch.full_like(q, 7.0), counters=counters)
    assert torch.equal(out, expected) and (out[1] == 7.0).all() and not counters.any()


@pytest.mark.parametrize("num_splits", [1, 3])
def test_attention_makes_quantize_int8s_bits_of_its_output(monkeypatch, num_splits):
    """With `quantized` the attention's output also comes in its int8 form (o_proj's inputs): the bits of
    matmul.quantize_int8 of the output viewed as [T, H * D], however the splits are merged (in the
    program, by the combine kernel, by the last split); a head_dim that is not a power of two times 32:
    nothing is appended."""
    monkeypatch.setattr(attention, "SPLIT_KEYS", 64)
    lengths, spans, num_heads, num_kv_heads, _ = ATTENTION_CASES["decode-gqa"]
    for head_dim in (32, 48):
        cache = PagedCache.make(lengths, num_kv_heads, head_dim, torch.bfloat16, seed=64)
        q = _randn(len(spans), num_heads, head_dim, seed=65, dtype=torch.bfloat16)
        for counters in (None, attention.attention_counters(DEVICE)):
            quantized = []
            out = _attend(cache, Step(spans), q, 0, num_splits, counters=counters, quantized=quantized)
            assert torch.equal(out, _attend(cache, Step(spans), q, 0, num_splits))
            if head_dim == 48:
                assert quantized == []
                continue
            (got,) = quantized
            expected = matmul.quantize_int8(out.reshape(len(spans), num_heads * head_dim))
            assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)), counters


@triton.jit
def _looping_attention_kernel(
    q_ptr, k_cache, v_cache, out_ptr, part_m, part_denom, part_acc, counters_ptr,
    block_tables, positions, tile_seq, tile_first, tile_len, scale, window,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_table, num_heads, part_stride, words_ptr, dq_ptr, sq_ptr,
    DOT_DTYPE: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_KEYS: tl.constexpr,
    IS_SPLIT: tl.constexpr, COMBINE_IN_TILE: tl.constexpr, QUANTIZE: tl.constexpr, INTERPRET: tl.constexpr,
    TILES: tl.constexpr, KV_HEADS: tl.constexpr, SPLITS: tl.constexpr,
):  # fmt: skip
    """`_attention_kernel`'s grid (TILES, KV_HEADS, SPLITS) taken by fewer programs, each looping over its
    (tile, KV head, split)s pid, pid + programs, ...: `attention._attention_tile` given their indices."""
    for t in range(tl.program_id(0), TILES * KV_HEADS * SPLITS, tl.num_programs(0)):
        attention._attention_tile(
            q_ptr, k_cache, v_cache, out_ptr, part_m, part_denom, part_acc, counters_ptr,
            block_tables, positions, tile_seq, tile_first, tile_len, scale, window,
            stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
            stride_vh, stride_table, num_heads, part_stride, words_ptr, dq_ptr, sq_ptr,
            DOT_DTYPE, GROUP, ROWS, BLOCK_SIZE, HEAD_DIM, BLOCK_D, BLOCK_N, SPLIT_KEYS,
            IS_SPLIT, COMBINE_IN_TILE, QUANTIZE, INTERPRET,
            tile_at=t // (KV_HEADS * SPLITS), kv_head_at=(t // SPLITS) % KV_HEADS, split_at=t % SPLITS,
            kv_heads=KV_HEADS, splits=SPLITS,
        )  # fmt: skip


def test_the_attention_tile_given_its_indices_gives_the_bits_of_a_program_a_tile(monkeypatch):
    """`_attention_tile` is the attention kernel's program with its (tile, KV head, split) given: two
    programs looping over a call's grid (a persistent decode step's form) give `_attention_kernel`'s bits,
    decode and prefill tiles, with the splits merged in the program, by the last split and by the
    combine kernel, and the output's int8 form."""
    monkeypatch.setattr(attention, "SPLIT_KEYS", 64)  # splits on short sequences

    class Looping:  # launched where paged_attention launches `_attention_kernel`, on two programs
        def __getitem__(self, grid):
            tiles, kv_heads, splits = grid
            return partial(_looping_attention_kernel[(2,)], TILES=tiles, KV_HEADS=kv_heads, SPLITS=splits)

    counters = attention.attention_counters(DEVICE)
    for case in ("decode-gqa", "chunk-gqa3"):
        lengths, spans, num_heads, num_kv_heads, head_dim = ATTENTION_CASES[case]
        cache = PagedCache.make(lengths, num_kv_heads, head_dim, torch.bfloat16, seed=66)
        q = _randn(sum(n for _, _, n in spans), num_heads, head_dim, seed=67, dtype=torch.bfloat16)
        for num_splits, layer_counters in ((1, None), (3, counters), (3, None)):
            for window in (0, 20):
                launched_int8, looped_int8 = [], []
                launched = _attend(
                    cache, Step(spans), q, window, num_splits, counters=layer_counters, quantized=launched_int8
                )
                with monkeypatch.context() as patch:
                    patch.setattr(attention, "_attention_kernel", Looping())
                    looped = _attend(
                        cache, Step(spans), q, window, num_splits, counters=layer_counters, quantized=looped_int8
                    )
                assert torch.equal(looped, launched), (case, num_splits, layer_counters is None, window)
                pairs = zip(
                    looped_int8[0] if looped_int8 else (), launched_int8[0] if launched_int8 else (), strict=True
                )
                assert len(looped_int8) == len(launched_int8) and all(torch.equal(a, b) for a, b in pairs)
    assert not counters.any()  # every (tile, KV head)'s counter back at 0 for the next call


# --- The sampler's pick: argmax, or a draw at a temperature


def test_pick_is_torch_argmax_with_its_ties_and_leaves_the_counters_at_zero():

    vocab = 2 * sample.BLOCK + 77  # three chunks, the last one short
    logits = _randn(6, vocab, seed=40)
    logits[0, [5, 900]] = 9.0  # equal maxima in one chunk: the first
    logits[1, [sample.BLOCK + 3, 7]] = 9.0  # in two chunks: the first chunk's
    logits[2] = float("-inf")  # nothing allowed: torch's 0
    logits[3, :-1] = float("-inf")  # only the last token
    logits[4, [10, 2 * sample.BLOCK + 5]] = float("inf")
    logits[5, 3000] = float("nan")  # NaN is the largest, as torch takes it
    counters = sample.counters(DEVICE)
    want = logits.argmax(dim=-1)
    assert torch.equal(sample.pick(logits, counters), want)
    assert not counters.any()
    rows = torch.tensor([4, 1, 1], device=DEVICE)
    assert torch.equal(sample.pick(logits, counters, rows), want[rows])  # named rows, twice the same one
    many = _randn(sample.NUM_COUNTERS + 6, 50, seed=43)  # more rows than counters: two launches
    assert torch.equal(sample.pick(many, counters), many.argmax(dim=-1))
    assert not counters.any()


@triton.jit
def _uniforms_kernel(bits_ptr, out_ptr, N: tl.constexpr):
    offsets = tl.arange(0, N)
    tl.store(out_ptr + offsets, sample.uniform_of(tl.load(bits_ptr + offsets).to(tl.uint32, bitcast=True)))


def test_a_draws_uniform_is_never_0_nor_1():
    """U = 0 made a token's score -inf (a row's one finite token lost to a forbidden one); U = 1 made it
    +inf (drawn whatever its probability). The lowest and highest bits give 2^-24 and 1 - 2^-24."""
    bits = torch.tensor([0, 511, 512, 2**31 - 1, -(2**31), -1, -512, 12345678], dtype=torch.int32, device=DEVICE)
    out = torch.empty(8, device=DEVICE)
    _uniforms_kernel[(1,)](bits, out, N=8)
    top = (bits.long() & 0xFFFFFFFF) >> 9
    assert torch.equal(out.double(), ((top.double() + 0.5) * 2.0**-23).to(DEVICE))
    assert out.min() == 2.0**-24 and out.max() == 1 - 2.0**-24


def test_pick_draws_from_the_softmax_at_the_temperature():
    """3,000 draws of one row (one seed each) against softmax(logits / T): within 4.5 standard
    deviations per token; a token at -inf is never drawn."""

    logits = torch.tensor([[1.0, 2.0, 0.5, float("-inf"), 3.0, -1.0, 2.5, 0.0]], device=DEVICE)
    temperature, draws = 0.7, 3000
    seeds = torch.arange(draws, dtype=torch.int64, device=DEVICE) * 7919 + 2**40
    inv = torch.full((draws,), 1 / temperature, device=DEVICE)
    tokens = sample.pick(
        logits, sample.counters(DEVICE), torch.zeros(draws, dtype=torch.int32, device=DEVICE), seeds, inv
    )
    counts = torch.bincount(tokens.cpu(), minlength=8).double()
    probs = torch.softmax(logits[0].double().cpu() / temperature, dim=-1)
    sigma = (probs * (1 - probs) / draws).sqrt()
    assert counts[3] == 0
    assert ((counts / draws - probs).abs() <= 4.5 * sigma + 1e-9).all(), (counts / draws, probs)


def test_a_draw_depends_on_its_row_and_seed_only():
    """R7: a row's draw is the same alone and among others, wherever it sits; the same seed gives the
    same draw, another seed (mostly) another."""

    logits = _randn(5, 3000, seed=41) * 2
    counters = sample.counters(DEVICE)
    seeds = torch.tensor([11, 12, 13, 14, 15], dtype=torch.int64, device=DEVICE)
    inv = torch.tensor([1.0, 0.5, 2.0, 1.0, 1.25], device=DEVICE)
    together = sample.pick(logits, counters, None, seeds, inv)
    for i in range(5):
        row = torch.tensor([i], device=DEVICE)
        assert torch.equal(sample.pick(logits, counters, row, seeds[i : i + 1], inv[i : i + 1]), together[i : i + 1])
    reordered = torch.tensor([3, 0, 4], device=DEVICE)
    assert torch.equal(sample.pick(logits, counters, reordered, seeds[reordered], inv[reordered]), together[reordered])
    rows = torch.zeros(64, dtype=torch.int64, device=DEVICE)
    many = sample.pick(logits, counters, rows, torch.arange(64, device=DEVICE), torch.ones(64, device=DEVICE))
    assert len(set(many.tolist())) > 10  # 64 seeds on one row: many tokens
    assert not counters.any()


def test_row_cumsum_is_each_rows_scan_the_same_alone_and_in_a_batch():
    """top-p's sums on a GPU: each row's cumulative sums (against float64), carried across scan blocks,
    and a row's bits the same alone, beside others or in another place (torch's CUDA cumsum takes
    another algorithm for one row than for several)."""
    length = 2 * sample.BLOCK_SCAN + 123  # three blocks, the last one short
    values = torch.softmax(_randn(4, length, seed=44) * 4, dim=-1).sort(dim=-1, descending=True).values
    sums = sample.row_cumsum(values)
    expected = values.double().cumsum(dim=-1)
    torch.testing.assert_close(sums.double(), expected, rtol=0, atol=1e-5)
    for i in range(4):
        assert torch.equal(sample.row_cumsum(values[i : i + 1]), sums[i : i + 1]), i
    assert torch.equal(sample.row_cumsum(values[[2, 0]]), sums[[2, 0]])
    wide = torch.cat([values, values], dim=1)[:, :length]  # rows with a stride beyond their length
    assert torch.equal(sample.row_cumsum(wide), sums)
    assert sample.row_cumsum(values[:0]).shape == (0, length)


def test_the_samplers_gpu_branch_picks_through_the_kernel():
    """engine/sampler.py with the pick's counters (its branch for logits on a GPU): greedy rows are the
    argmax, a plain row is the pick of the seed its generator gives, filtered rows (top-p, top-k) keep
    to their filters, and each row's token is the same alone as beside the others."""
    from kvserve.engine.sampler import SamplingRow, _argmax_rows, _draw, _seeds
    from kvserve.sampling_params import SamplingParams

    logits = _randn(3, 3000, seed=42) * 3
    counters = sample.counters(DEVICE)
    params = [
        SamplingParams(temperature=0.8, seed=1),
        SamplingParams(temperature=1.2, top_p=0.5, seed=2),
        SamplingParams(temperature=0.5, top_k=3, seed=3),
    ]

    def row(p: SamplingParams) -> SamplingRow:
        return SamplingRow(p, [1], [], torch.Generator().manual_seed(p.seed), ())

    together = _draw(logits, [(i, row(p)) for i, p in enumerate(params)], counters)
    for i, p in enumerate(params):
        assert torch.equal(_draw(logits[i : i + 1], [(0, row(p))], counters), together[i : i + 1]), p
    seed = _seeds([torch.Generator().manual_seed(1)]).to(DEVICE)
    inv = torch.tensor([1 / 0.8], device=DEVICE)
    assert torch.equal(together[:1], sample.pick(logits, counters, torch.tensor([0], device=DEVICE), seed, inv))
    assert together[2] in logits[2].topk(3).indices
    probs = torch.softmax(logits[1] / 1.2, dim=-1).sort(descending=True)
    nucleus = probs.indices[: int((probs.values.cumsum(0) < 0.5).sum()) + 1]
    assert together[1] in nucleus
    assert torch.equal(_argmax_rows(logits, counters), logits.argmax(dim=-1))
    assert not counters.any()


# --- At model sizes, on a GPU only (the interpreter would take hours)

on_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="model sizes need a GPU")


@on_gpu
@pytest.mark.parametrize("kind", ["float", "lm_head", "int4", "int4-bf16x2", "int8", "int4-int8", "int8-int8"])
def test_matmul_rows_at_model_sizes_are_the_same_bits_for_any_number_of_rows(kind):
    """A row's bits whatever the call's other rows, at a model's sizes on the GPU: for int4 and Q8_0
    weights through programs of 1, 2 and 4 row tiles (`row_tiles_for` at this layer: up to 20 rows 1, 37 and 64
    rows 2, 300 rows 4)."""
    m, k, n = 300, 4096, 1024
    x = _randn(m, k, seed=70, dtype=torch.bfloat16)
    if kind in ("float", "lm_head"):
        w = _randn(n, k, seed=71, dtype=torch.bfloat16)
        out_dtype = torch.float32 if kind == "lm_head" else None
        run = lambda rows: matmul.matmul(rows, w, out_dtype=out_dtype)  # noqa: E731
    elif kind == "int4-bf16x2":  # GpuInt4Linear's default for bfloat16 models
        codes, scales, mins, _ = _int4_weight(n, k, torch.bfloat16, seed=72)
        packed = matmul.pack_int4(codes)
        run = lambda rows: matmul.int4_matmul(rows, packed, scales, mins, packed_bf16=True)  # noqa: E731
    elif kind == "int4":
        codes, scales, mins, w = _int4_weight(n, k, torch.float16, seed=72)
        packed = matmul.pack_int4(codes)
        run = lambda rows: matmul.int4_matmul(rows, packed, scales, mins)  # noqa: E731
    elif kind == "int4-int8":
        codes, scales, mins, w = _int4_weight(n, k, torch.float16, seed=72)
        packed = matmul.pack_int4(codes)
        run = lambda rows: matmul.int4_int8_matmul(rows, packed, scales, mins)  # noqa: E731
    elif kind == "int8-int8":
        codes, scales, w = _int8_weight(n, k, seed=73)
        run = lambda rows: matmul.int8_int8_matmul(rows, codes, scales)  # noqa: E731
    else:
        codes, scales, w = _int8_weight(n, k, seed=73)
        run = lambda rows: matmul.int8_group_matmul(rows, codes, scales)  # noqa: E731
    out = run(x)
    if kind.endswith("-int8"):  # against the inputs as the kernel rounds them, and the weight in float64
        q, d, _ = _quantized_inputs(x[:8])
        _check_matmul(
            out[:8], (q.double().reshape(8, -1, 32) * d[..., None]).reshape(8, k).to(DEVICE), w.double(), None
        )
    elif kind != "int4-bf16x2":  # (its weights, bfloat16 FMAs, have a test of their own)
        _check_matmul(out[:8], x[:8], w.to(x.dtype), None)
    for rows in ([0], [1], [15], [16], [63], [64], [299], list(range(5, 25)), list(range(5, 42)), list(range(64, 128))):
        part = run(x[rows])
        assert torch.equal(part, out[rows]), rows


@on_gpu
@pytest.mark.parametrize("words", [512, 1024, 2048])
def test_the_code_words_over_the_threads_at_model_sizes_give_the_splits_kernels_bits(monkeypatch, words):
    """matmul.WORDS_IN_THREADS at a 1B model's int4 layers (q/k/v, gate and up, down: 8, 16 and 8 groups a
    split, 8, 4 and 32 splits; and 3 splits padded to 4), with a bias, and its Q8_0 lm_head, for 1 to 8
    rows, compiled: the bits of the kernels before, and the words kernel ran each but the down projection
    (256 groups a row, past WORDS_GROUPS: the splits kernel)."""
    x = _randn(8, 8192, seed=86, dtype=torch.bfloat16)
    layers = []
    for n, k in ((3072, 2048), (16384, 2048), (2048, 8192), (2048, 768)):  # the last: 3 splits, padded
        codes, scales, mins, _ = _int4_weight(n, k, torch.float16, seed=87)
        weight = dict(packed=matmul.pack_int4(codes), scales=scales, mins=mins)
        bias = _randn(n, seed=89, dtype=torch.bfloat16)
        layers.append((n, k, partial(matmul.int4_int8_matmul, **weight, bias=bias)))
    codes8, scales8, _ = _int8_weight(49152, 2048, seed=88)
    layers.append(
        (49152, 2048, partial(matmul.int8_int8_matmul, codes=codes8, scales=scales8, out_dtype=torch.float32))
    )
    launches = []
    for n, k, run in layers:
        for m in (1, 2, 5, 8):
            monkeypatch.setattr(matmul, "WORDS_IN_THREADS", 0)
            expected = run(x[:m, :k])
            monkeypatch.setattr(matmul, "WORDS_IN_THREADS", words)
            _record_launches(monkeypatch, launches)
            assert _same_bits(run(x[:m, :k]), expected), (n, k, m)
            monkeypatch.setattr(matmul, "_launch", _LAUNCH)
    words = ["_int4_int8_words_kernel"] * 4
    assert launches == words * 2 + ["_int4_int8_splits_kernel"] * 4 + words * 2, launches


@on_gpu
@pytest.mark.parametrize("kind", ["float", "int4", "int4-bf16x2", "int8"])
def test_a_gate_up_matmul_at_model_sizes_applies_the_activation_with_its_kernels_bits(kind):
    """A 1B model's gate and up projection (2048 -> 2 x 8192) with its activation in the matmul's kernel:
    the bits of the [gate | up] matmul and then the activation's kernel, compiled apart, SiLU and GELU, for
    1 and 16 rows (float: a K split, the tile stores; 4-bit and int8: each tile's last of two splits) and
    300 (4-bit: more tiles than counters, the sum kernel)."""
    k, intermediate = 2048, 8192
    x = _randn(300, k, seed=74, dtype=torch.bfloat16)
    counters = matmul.split_counters(DEVICE)
    if kind == "float":
        w = _randn(2 * intermediate, k, seed=75, dtype=torch.bfloat16) / 32
        weights, run = [w], lambda x, w, act=None: matmul.matmul(x, w, None, None, counters, act)
    elif kind == "int8":
        codes, scales, _ = _int8_weight(2 * intermediate, k, seed=75)
        weights = [codes, scales]
        run = lambda x, c, s, act=None: matmul.int8_group_matmul(x, c, s, None, None, counters, act)  # noqa: E731
    else:
        codes, scales, mins, _ = _int4_weight(2 * intermediate, k, torch.bfloat16, seed=75)
        weights, bf16x2 = [matmul.pack_int4(codes), scales, mins], kind == "int4-bf16x2"
        run = lambda x, p, s, mn, act=None: matmul.int4_matmul(x, p, s, mn, None, None, bf16x2, counters, act)  # noqa: E731
    interleaved = [matmul.interleave_gate_up(t) for t in weights]
    for gelu in (False, True):
        for rows in (1, 16, 300):
            expected = elementwise.gated_activation(run(x[:rows], *weights), gelu)
            got = run(x[:rows], *interleaved, act="gelu_tanh" if gelu else "silu")
            assert torch.equal(got, expected), (gelu, rows)
    assert not counters.any()


@on_gpu
@pytest.mark.parametrize("kind", ["float", "int4-bf16x2", "int8"])
def test_the_norm_in_a_matmuls_prologue_at_model_sizes_gives_its_kernels_bits(kind):
    """A 1B model's norms in the q/k/v and gate/up matmuls' prologues (`NormedRows`): on the GPU, compiled
    apart, the bits of add_rms_norm's kernel (and rms_norm's, without a delta) and then the matmul, for 1, 2
    and 8 rows, with the engine's epilogues (RoPE with the cache's write on q/k/v, SiLU on gate/up), at
    hidden 2,048 and 4,096 (two float K splits); x + delta as add_rms_norm stores it."""
    bf16, heads, kv_heads, head_dim = torch.bfloat16, 32, 8, 64
    counters = matmul.split_counters(DEVICE)
    for k in (2048, 4096):
        x, delta = _randn(8, k, seed=80, dtype=bf16) * 4, _randn(8, k, seed=81, dtype=bf16)
        weight = _randn(k, seed=82, dtype=bf16).abs() + 0.5
        for n, act in (((heads + 2 * kv_heads) * head_dim, None), (16384, "silu")):
            if kind == "float":
                args = (_randn(n, k, seed=83, dtype=bf16) / 32,)
                run = lambda rows, rope=None, a=args, act=act: matmul.matmul(  # noqa: E731
                    rows, *a, None, None, counters, act, rope
                )
            elif kind == "int8":
                args = _int8_weight(n, k, seed=83)[:2]
                run = lambda rows, rope=None, a=args, act=act: matmul.int8_group_matmul(  # noqa: E731
                    rows, *a, None, None, counters, act, rope
                )
            else:
                codes, scales, mins, _ = _int4_weight(n, k, bf16, seed=83)
                args = (matmul.pack_int4(codes), scales, mins)
                run = lambda rows, rope=None, a=args, act=act: matmul.int4_matmul(  # noqa: E731
                    rows, *a, None, None, True, counters, act, rope
                )
            for m in (1, 2, 8):
                total, normed = norm.add_rms_norm(x[:m], delta[:m], weight, 1e-5)
                rows_total, rows = norm.normed_rows(x[:m], delta[:m], weight, 1e-5)
                if act is None:  # q/k/v: q rotated, k and v written into the caches
                    cos, sin = _randn(m, 1, head_dim, seed=84, dtype=bf16), _randn(m, 1, head_dim, seed=85, dtype=bf16)
                    slots = torch.arange(m, dtype=torch.int32, device=DEVICE)
                    results = []
                    for inputs in (rows, normed):
                        caches = [torch.zeros(1, 16, kv_heads, head_dim, dtype=bf16, device=DEVICE) for _ in range(2)]
                        q = run(inputs, matmul.RopeStore(cos, sin, *caches, slots, heads))
                        results.append([q, *caches])
                    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True)), (k, n, m)
                else:
                    assert torch.equal(run(rows), run(normed)), (k, n, m)
                assert torch.equal(rows_total, total)
                without_delta = norm.normed_rows(x[:m], None, weight, 1e-5)[1]
                assert torch.equal(run(without_delta), run(norm.rms_norm(x[:m], weight, 1e-5))), (k, n, m)
    assert not counters.any()


@on_gpu
@pytest.mark.parametrize("kind", ["float", "int4", "int4-bf16x2", "int4-int8"])
def test_a_qkv_matmul_at_model_sizes_applies_rope_with_its_kernels_bits(kind):
    """A 1B model's q/k/v projection (2048 -> (32 + 2 x 8) x 64) with RoPE and the KV cache's write in its
    matmul's epilogue: the bits of the plain matmul and then `rotate_and_store`, compiled apart, for 1
    and 16 rows (float: a K split, the tile stores; 4-bit: each tile's last of four splits; int8 inputs: the
    splits in one program, then the tensor cores' tiles) and 1,400 (4-bit: more tiles than counters, the
    RoPE kernel after the sum kernel; int8 inputs: 528 tiles of 64 x 128, each tile's last split)."""
    k, heads, kv_heads, head_dim = 2048, 32, 8, 64
    n = (heads + 2 * kv_heads) * head_dim
    x = _randn(1400, k, seed=76, dtype=torch.bfloat16)
    cos, sin = (
        _randn(1400, 1, head_dim, seed=77, dtype=torch.bfloat16),
        _randn(1400, 1, head_dim, seed=78, dtype=torch.bfloat16),
    )
    slots = torch.randperm(2048, generator=_generator(79))[:1400].to(torch.int32).to(DEVICE)
    counters = matmul.split_counters(DEVICE)
    pair = lambda t: matmul.interleave_rope(t, heads, kv_heads, head_dim)  # noqa: E731
    if kind == "float":
        weights = [_randn(n, k, seed=80, dtype=torch.bfloat16) / 32]
        run = lambda x, w, rope=None: matmul.matmul(x, w, None, None, counters, rope=rope)  # noqa: E731
    elif kind == "int4-int8":
        codes, scales, mins, _ = _int4_weight(n, k, torch.float16, seed=80)
        weights = [matmul.pack_int4(codes), scales, mins]
        run = lambda x, p, s, mn, rope=None: matmul.int4_int8_matmul(x, p, s, mn, counters=counters, rope=rope)  # noqa: E731
    else:
        codes, scales, mins, _ = _int4_weight(n, k, torch.bfloat16, seed=80)
        weights, bf16x2 = [matmul.pack_int4(codes), scales, mins], kind == "int4-bf16x2"
        run = lambda x, p, s, mn, rope=None: matmul.int4_matmul(x, p, s, mn, None, None, bf16x2, counters, rope=rope)  # noqa: E731
    for rows in (1, 16, 1400):
        caches = [torch.zeros(128, 16, kv_heads, head_dim, dtype=torch.bfloat16, device=DEVICE) for _ in range(4)]
        plain = run(x[:rows], *weights).view(rows, heads + 2 * kv_heads, head_dim)
        qk, v = plain.split([heads + kv_heads, kv_heads], dim=1)
        expected = elementwise.rotate_and_store(qk, v, cos[:rows], sin[:rows], caches[0], caches[1], slots[:rows])
        rope = matmul.RopeStore(cos[:rows], sin[:rows], caches[2], caches[3], slots[:rows], heads)
        got = run(x[:rows], *[pair(w) for w in weights], rope=rope).view(rows, heads, head_dim)
        assert torch.equal(got, expected) and torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])
    assert not counters.any()


@on_gpu
def test_attention_at_model_sizes_is_the_same_bits_in_decode_prefill_and_chunks():
    num_heads, num_kv_heads, head_dim, length = 32, 8, 128, 2048  # 4 splits of SPLIT_KEYS = 512
    cache = PagedCache.make([length, 300], num_kv_heads, head_dim, torch.bfloat16, seed=80)
    q = _randn(length, num_heads, head_dim, seed=81, dtype=torch.bfloat16)
    prefill = _attend(cache, Step([(0, 0, length)]), q)  # one program walks all the splits
    sample = Step([(0, p, 1) for p in (0, 511, 512, 2047)])
    expected = _reference(cache, sample, q[[0, 511, 512, 2047]], 0)
    torch.testing.assert_close(prefill[[0, 511, 512, 2047]].double(), expected, rtol=0, atol=2 * BF16_ULP)
    chunk = Step([(0, 1000, length - 1000)], first_tile=3)
    assert torch.equal(_attend(cache, chunk, q[1000:], num_splits=4), prefill[1000:])
    for pos in (0, 511, 512, 1300, 2047):
        for num_splits in (1, attention.num_splits_for(pos), 16):
            batch = Step([(1, 299, 1), (0, pos, 1)])
            out = _attend(cache, batch, torch.cat([q[:1], q[pos : pos + 1]]), num_splits=num_splits)
            assert torch.equal(out[1], prefill[pos]), (pos, num_splits)


def _with_words(call, words: int = 1024):
    """call() with matmul.WORDS_IN_THREADS set (the code words over the threads)."""
    before, matmul.WORDS_IN_THREADS = matmul.WORDS_IN_THREADS, words
    try:
        return call()
    finally:
        matmul.WORDS_IN_THREADS = before


def test_a_recording_timeline_stamps_every_program_of_every_matmul_kernel_and_changes_no_bit():
    """While a `timeline.Timeline` records (bench/gpu_timeline.py), each matmul launch takes its own
    slice and every one of its programs writes its four stamps, its cycle counts and its multiprocessor
    (0 here, where there is no clock), through every way a program ends: a whole K, a K split's partial
    sums and the tile's last split adding them, the splits in one program, the tensor cores' tiles; the
    outputs are the bits of the same calls unrecorded, and no launch outside a recording takes one."""
    from kvserve.kernels.gpu import timeline

    codes, scales, mins, _ = _int4_weight(72, 2048, torch.bfloat16, seed=90)
    packed = matmul.pack_int4(codes)
    codes8, scales8, _ = _int8_weight(72, 2048, seed=91)
    counters = matmul.split_counters(DEVICE)
    calls = {  # the kernel each call launches (K 2048 in splits of 512, 1,024 and 2,048 inputs)
        "_float_kernel": lambda x: matmul.matmul(x, _randn(72, 4096, seed=92, dtype=x.dtype), counters=counters),
        "_int4_kernel": lambda x: matmul.int4_matmul(
            x[:, :2048], packed, scales, mins, packed_bf16=True, counters=counters
        ),
        "_int8_kernel": lambda x: matmul.int8_group_matmul(x[:, :2048], codes8, scales8),
        "_int4_int8_splits_kernel": lambda x: matmul.int4_int8_matmul(x[:2, :2048], packed, scales, mins),
        "_int4_int8_kernel": lambda x: matmul.int8_int8_matmul(x[:2, :2048], codes8, scales8, counters=counters),
        "_int4_int8_mma_kernel": lambda x: matmul.int4_int8_matmul(
            x[:, :2048], packed, scales, mins, counters=counters
        ),
        "_int4_int8_words_kernel": lambda x: _with_words(
            lambda: matmul.int4_int8_matmul(x[:3, :2048], packed, scales, mins, counters=counters)
        ),
    }
    x = _randn(9, 4096, seed=93, dtype=torch.bfloat16)
    expected = {kernel: call(x) for kernel, call in calls.items()}
    recorder = timeline.Timeline(DEVICE, capacity=512)
    with timeline.recording(recorder):
        got = {kernel: call(x) for kernel, call in calls.items()}
    assert timeline.active_timeline() is None
    assert all(_same_bits(got[kernel], expected[kernel]) for kernel in calls)
    assert [launch.kernel for launch in recorder.launches] == list(calls), recorder.launches
    ends = [launch.first + launch.programs for launch in recorder.launches]
    assert [launch.first for launch in recorder.launches] == [0, *ends[:-1]]  # one after another
    written = [*range(4), *(timeline.CLOCKS.value + slot for slot in range(4)), timeline.SM.value]
    for launch in recorder.launches:
        stamps = recorder.stamps(launch)
        assert launch.programs > 1 and stamps.shape == (launch.programs, timeline.SLOTS.value), launch
        if gpu.INTERPRET:  # no clock
            assert torch.equal(stamps[:, written], torch.zeros(launch.programs, len(written), dtype=torch.int64))
        else:  # each program's times in order, on a real multiprocessor
            times = stamps[:, :4]
            assert bool((times[:, 1:] >= times[:, :-1]).all()) and bool((times[:, 0] > 0).all()), launch
            assert bool((stamps[:, timeline.SM.value] >= 0).all()), launch
    untouched = recorder.buffer[ends[-1] :].cpu()
    assert bool((untouched == -1).all()) and bool((recorder.buffer[: ends[-1], 4:8].cpu() == -1).all())


# --- Lowering for the GPU, without one

# Run in a fresh interpreter without TRITON_INTERPRET: the JIT is told it has a Hopper GPU (sm_90),
# each launch becomes a warmup (compile only), and the public functions are called on CPU tensors.
# Prints one JSON line per launch: [call-size, kernel, tensor-core instructions, TF32 instructions, counting
# atomics, whether the count is ordered between the partials' stores and reads (`ordered`), whether
# programmatic dependent launch's wait comes before any memory access but L2 prefetches (`waits_first`),
# binary hash, whether FP contraction is on].
_COMPILE_FOR_HOPPER = r"""
import json, pathlib, re, subprocess, sys, tempfile
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction

CAPABILITY = int(sys.argv[1]) if len(sys.argv) > 1 else 90  # Hopper's sm_90 unless told

class OfflineDriver:
    def get_current_device(self): return 0
    def get_current_stream(self, device=None): return 0
    def get_current_target(self): return GPUTarget("cuda", CAPABILITY, 32)

driver.set_active(OfflineDriver())
call = None
# Where a tile's last program adds the others' partials: its own stores, a barrier, the count, a barrier,
# then every load from L2 (.cg; these launches load nothing else after the count). None: nothing counted.
def ordered(ptx):
    body = ptx[ptx.index(".entry"):]
    count = re.search(r"\batom\.global\.gpu\.acq_rel\.add", body)
    if count is None:
        return None
    before, after = body[: count.start()], body[count.start() :]
    last_store = max((m.start() for m in re.finditer(r"\bst\.global", before)), default=0)
    first_read = re.search(r"\bld\.global\.cg", after)
    return (
        "bar.sync" in before[last_store:]
        and first_read is not None
        and "bar.sync" in after[: first_read.start()]
        and not re.search(r"\bld\.global(?!\.cg)", after)
    )

# With programmatic dependent launch: the launch flag set, the wait before any access to global memory
# but prefetches into L2 (`prefetch.global.L2`, CCTL.E.PF2 in the machine code), then the next kernel let
# in, in the PTX and in the machine code ptxas made of it (ACQBULK is the wait, PREEXIT the let-in):
# "wait", or "prefetch" where L2 prefetches come before the wait. None: no grid dependency control and
# no prefetch at all (the default); False: anything else.
NVDISASM = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"

def waits_first(compiled):
    ptx, launch_pdl = compiled.asm["ptx"], compiled.metadata.launch_pdl
    body = ptx[ptx.index(".entry"):]
    wait = re.search(r"^\s*griddepcontrol\.wait", body, re.M)  # not under a predicate
    if wait is None:
        return None if "griddepcontrol" not in body and "prefetch." not in body and not launch_pdl else False
    before = body[: wait.start()]
    touched = re.search(r"\b(ld|st|atom|red)\.global|\bcp\.async|\bprefetch(?!\.global\.L2 \[)", before)
    prefetches = len(re.findall(r"\bprefetch\.global\.L2 \[", before))
    after = body[wait.start() :]
    if not launch_pdl or touched or "griddepcontrol.launch_dependents" not in after or "prefetch." in after:
        return False
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        sass = subprocess.run([NVDISASM, "-c", cubin.name], capture_output=True, text=True, check=True).stdout
    wait = re.search(r"^\s*/\*[0-9a-f]+\*/\s+ACQBULK\b", sass, re.M)
    if wait is None or re.search(r"\bPREEXIT\b", sass[wait.start() :]) is None:
        return False
    before, after = sass[: wait.start()], sass[wait.start() :]
    if re.search(r"\b(LDG|STG|ATOMG?|RED|LDGSTS)\b|\bCCTL\b(?!\.E\.PF2 )", before):
        return False
    if (prefetches > 0) != ("CCTL.E.PF2" in before) or "CCTL.E.PF2" in after:
        return False  # the prefetches, all before the wait
    return "prefetch" if prefetches else "wait"

# The bytes of stack a thread of the compiled kernel has (registers spilled to local memory), by cuobjdump
CUOBJDUMP = NVDISASM.parent / "cuobjdump"

# The most synchronous global loads (ld.global: not cp.async, which the pipeliner issues steps ahead) in one
# loop that holds an MMA, whose values that same iteration uses: each step waits there a trip to memory (a
# load whose value only the next iteration uses, a prefetch, is not counted)
def waited_loads(ptx):
    most = 0
    for head in re.finditer(r"^(\$L__BB\d+_\d+):", ptx, re.M):
        back = re.search(r"\bbra(?:\.uni)?\s+" + re.escape(head.group(1)) + ";", ptx[head.end():])
        body = ptx[head.end(): head.end() + back.start()].splitlines() if back else []
        if not any("mma" in line for line in body):
            continue
        waited = 0
        for i, line in enumerate(body):
            load = re.search(r"\bld\.global\S*\s+(.*?)\[", line)
            values = re.findall(r"%\w+", load.group(1)) if load else []
            waited += any(re.search(re.escape(v) + r"\b", later) for later in body[i + 1 :] for v in values)
        most = max(most, waited)
    return most

def spilled(compiled):
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([CUOBJDUMP, "--dump-resource-usage", cubin.name], capture_output=True, text=True, check=True).stdout
    return int(re.search(r"STACK:(\d+)", usage).group(1))

def launch(kernel, grid):
    def warmup(*args, **kwargs):
        compiled = kernel.run(*args, grid=grid, warmup=True, **kwargs)
        ptx = compiled.asm["ptx"]
        mma = [len(re.findall(r"\bmma\.sync", ptx)), len(re.findall(r"\bwgmma\.mma_async", ptx))]  # Ampere's, Hopper's
        tf32 = len(re.findall(r"tf32", ptx))
        counts = len(re.findall(r"\batom\.global\.gpu\.acq_rel\.add", ptx))
        pdl = waits_first(compiled)
        fused = compiled.metadata.enable_fp_fusion
        stack = spilled(compiled)
        waited = waited_loads(ptx)
        print(json.dumps([call, kernel.__name__, mma, tf32, counts, ordered(ptx), pdl, compiled.hash, stack, fused, waited]), flush=True)
    return warmup

JITFunction.__getitem__ = launch

from kvserve.kernels.gpu import attention, elementwise, matmul, norm, sample
bf16 = torch.bfloat16
"""

# The launches as they are by default (no grid dependency control)
_COMPILE_PLAIN = r"""
matmul.ROW_TILE_PROGRAMS = 1  # the int4 and int8 kernels' row tiles by the rows alone, at these small layers
for m in (1, 37):  # the same binaries for 1 row and for 37
    x = torch.randn(m, 2048).to(bf16)
    call = f"rms_norm-{m}"; norm.rms_norm(x, torch.ones(2048, dtype=bf16), 1e-6)
    call = f"add_rms_norm-{m}"; norm.add_rms_norm(x, x, torch.ones(2048, dtype=bf16), 1e-6)
    call = f"gated-{m}"; elementwise.gated_activation(x, False)
    call = f"gated-int8-{m}"; elementwise.gated_activation(x, False, [])
    call = f"add_rms_norm-int8-{m}"; norm.add_rms_norm(x, x, torch.ones(2048, dtype=bf16), 1e-6, [])
    qk = x.view(m, 16, 128)[:, :10]  # q and k heads of a fused projection's output
    call = f"rotate-{m}"; elementwise.rotate(qk, x[:, None, :128], x[:, None, :128])
    kv_cache = torch.zeros(8, 16, 2, 128, dtype=bf16)
    call = f"rotate_and_store-{m}"; elementwise.rotate_and_store(x.view(m, 16, 128)[:, :10], x.view(m, 16, 128)[:, 10:12], x[:, None, :128], x[:, None, :128], kv_cache, kv_cache, torch.arange(m, dtype=torch.int32))
    call = f"matmul-bf16-{m}"; matmul.matmul(x, torch.randn(256, 2048).to(bf16), torch.randn(256).to(bf16))
    call = f"matmul-fp32-{m}"; matmul.matmul(x.float(), torch.randn(256, 2048))
    call = f"lm_head-{m}"; matmul.matmul(x, torch.randn(256, 2048).to(bf16), out_dtype=torch.float32)
    codes = torch.randint(0, 16, (256, 2048), dtype=torch.uint8)
    scales = torch.rand(256, 64).half()
    call = f"int4-{m}"; matmul.int4_matmul(x, matmul.pack_int4(codes), scales, scales)
    call = f"int4-bf16x2-{m}"; matmul.int4_matmul(x, matmul.pack_int4(codes), scales, scales, packed_bf16=True)
    call = f"int8-{m}"; matmul.int8_group_matmul(x, codes.to(torch.int8), scales.float(), torch.float32)
    call = f"int4-int8-{m}"; matmul.int4_int8_matmul(x, matmul.pack_int4(codes), scales, scales)
    call = f"int8-int8-{m}"; matmul.int8_int8_matmul(x, codes.to(torch.int8), scales.float())
    counters = matmul.split_counters("cpu")  # each tile's last K split adds the splits
    call = f"int4-tiles-{m}"; matmul.int4_matmul(x, matmul.pack_int4(codes), scales, scales, counters=counters)
    call = f"int8-tiles-{m}"; matmul.int8_group_matmul(x, codes.to(torch.int8), scales.float(), counters=counters)
    call = f"int4-int8-tiles-{m}"; matmul.int4_int8_matmul(x, matmul.pack_int4(codes), scales, scales, counters=counters)
    call = f"matmul-tiles-{m}"; matmul.matmul(torch.randn(m, 4096).to(bf16), torch.randn(256, 4096).to(bf16), counters=counters)
    gm = matmul.to_group_major(matmul.pack_int4(codes), scales.to(bf16), scales.to(bf16))
    call = f"int4-gm-tiles-{m}"; matmul.int4_matmul(x, *gm, packed_bf16=True, counters=counters)
    gm = matmul.to_group_major(matmul.pack_int4(codes), scales, scales)
    call = f"int4-int8-gm-tiles-{m}"; matmul.int4_int8_matmul(x, *gm, counters=counters)
    matmul.SPLITS_IN_PROGRAM = 0  # each K split a program of its own, added by the tile's last
    call = f"int4-int8-partials-tiles-{m}"; matmul.int4_int8_matmul(x, matmul.pack_int4(codes), scales, scales, counters=counters)
    matmul.SPLITS_IN_PROGRAM = 128
    matmul.WORDS_IN_THREADS = 1024  # the code words over the threads (a candidate)
    call = f"int4-int8-words-{m}"; matmul.int4_int8_matmul(x, matmul.pack_int4(codes), scales, scales)
    call = f"int8-int8-words-{m}"; matmul.int8_int8_matmul(x, codes.to(torch.int8), scales.float())
    matmul.WORDS_IN_THREADS = 0
    # a gate and up projection with its activation in the epilogue: a tile's last split, the sum kernel
    call = f"gate_up-tiles-{m}"; matmul.matmul(torch.randn(m, 4096).to(bf16), torch.randn(256, 4096).to(bf16), counters=counters, activation="silu")
    call = f"gate_up-int4-tiles-{m}"; matmul.int4_matmul(x, matmul.pack_int4(codes), scales.to(bf16), scales.to(bf16), packed_bf16=True, counters=counters, activation="gelu_tanh")
    call = f"gate_up-int8-{m}"; matmul.int8_group_matmul(x, codes.to(torch.int8), scales.float(), activation="silu")
    # a q/k/v projection (2 + 2 x 1 heads of 64) with RoPE and the KV cache's write in the epilogue
    rope_caches = torch.zeros(8, 16, 1, 64, dtype=bf16)
    rope = matmul.RopeStore(x[:, None, :64], x[:, None, :64], rope_caches, rope_caches, torch.arange(m, dtype=torch.int32), 2)
    call = f"qkv-tiles-{m}"; matmul.matmul(torch.randn(m, 4096).to(bf16), torch.randn(256, 4096).to(bf16), counters=counters, rope=rope)
    call = f"qkv-int4-tiles-{m}"; matmul.int4_matmul(x, matmul.pack_int4(codes), scales.to(bf16), scales.to(bf16), packed_bf16=True, counters=counters, rope=rope)
    call = f"qkv-int8-{m}"; matmul.int8_group_matmul(x, codes.to(torch.int8), scales.float(), rope=rope)
    call = f"qkv-int4-int8-tiles-{m}"; matmul.int4_int8_matmul(x, matmul.pack_int4(codes), scales, scales, counters=counters, rope=rope)
    call = f"qkv-int8-int8-tiles-{m}"; matmul.int8_int8_matmul(x, codes.to(torch.int8), scales.float(), counters=counters, rope=rope)
    # the norm before a q/k/v or gate and up projection in the matmul's prologue (NormedRows)
    g = torch.ones(2048, dtype=bf16)
    call = f"normed-rope-{m}"; matmul.matmul(norm.normed_rows(x, x, g, 1e-6)[1], torch.randn(256, 2048).to(bf16), counters=counters, rope=rope)
    call = f"normed-int4-tiles-{m}"; matmul.int4_matmul(norm.normed_rows(x, x, g, 1e-6)[1], matmul.pack_int4(codes), scales.to(bf16), scales.to(bf16), packed_bf16=True, counters=counters, activation="silu")
    call = f"normed-int8-{m}"; matmul.int8_group_matmul(norm.normed_rows(x, None, g, 1e-6)[1], codes.to(torch.int8), scales.float())
    call = f"pick-{m}"; sample.pick(torch.randn(m, 5000), sample.counters("cpu"))
    call = f"row_cumsum-{m}"; sample.row_cumsum(torch.randn(m, 5000))
    call = f"pick-random-{m}"; sample.pick(torch.randn(m, 5000), sample.counters("cpu"), torch.arange(m), torch.arange(m), torch.ones(m))
matmul.WORDS_IN_THREADS = 1024  # the code words over the threads: 4 splits of 16 groups (32 of 8: past WORDS_GROUPS)
for rows in (1, 8):
    for name, (n, k) in (("32-splits", (256, 8192)), ("16-groups", (4224, 2048))):
        wide = matmul.pack_int4(torch.randint(0, 16, (n, k), dtype=torch.uint8))
        call = f"words-{name}-r{rows}-x"; matmul.int4_int8_matmul(torch.randn(rows, k).to(bf16), wide, torch.rand(n, k // 32).half(), torch.rand(n, k // 32).half())
matmul.WORDS_IN_THREADS = 0
k_cache = torch.zeros(8, 16, 2, 128, dtype=bf16)
for t in (1, 3):  # a decode of one token, a prefill tile of 3, the metadata at odd offsets of one buffer
    meta = torch.arange(100, dtype=torch.int32)
    positions, tile_seq, tile_first, tile_len, slots = meta[:t], meta[t : t + 1], meta[t + 1 : t + 2], meta[t + 2 : t + 3], meta[t + 3 : 2 * t + 3]
    kv = torch.randn(t, 2, 128).to(bf16)
    call = f"store_kv-{t}"; attention.store_kv(kv, kv, k_cache, k_cache, slots)
    args = (torch.randn(t, 8, 128).to(bf16), k_cache, k_cache, meta[5:9].view(1, 4), positions, tile_seq, tile_first, tile_len, 0.1)
    call = f"attention-{t}"; attention.paged_attention(*args)
    call = f"attention-splits-{t}"; attention.paged_attention(*args, num_splits=2)
    call = f"attention-tiles-{t}"; attention.paged_attention(*args, num_splits=2, counters=attention.attention_counters("cpu"))
"""

# Each kernel once more with programmatic dependent launch on, as on a Hopper GPU with KVSERVE_PDL=1, then
# the matmuls with their weights prefetched (KVSERVE_PDL=prefetch); compiled beside the plain launches
_COMPILE_PDL = r"""
codes = torch.randint(0, 16, (256, 2048), dtype=torch.uint8)
scales = torch.rand(256, 64).half()
kv_cache = k_cache = torch.zeros(8, 16, 2, 128, dtype=bf16)
# kvserve.kernels.gpu's own switches and launch options, on a device it is told has the launch
import kvserve.kernels.gpu as gpu
gpu.supports_pdl = lambda device: True
gpu.PDL = True
x = torch.randn(1, 2048).to(bf16)
rope = matmul.RopeStore(x[:, None, :64], x[:, None, :64], torch.zeros(8, 16, 1, 64, dtype=bf16), torch.zeros(8, 16, 1, 64, dtype=bf16), torch.arange(1, dtype=torch.int32), 2)

def matmuls(tag):  # every matmul kernel, each tile of int4 x int8, and RoPE's epilogue
    global call
    call = f"{tag}-1"; matmul.int4_matmul(x, matmul.pack_int4(codes), scales, scales, counters=matmul.split_counters("cpu"), rope=rope)
    call = f"{tag}-1"; matmul.int8_int8_matmul(x, codes.to(torch.int8), scales.float(), counters=matmul.split_counters("cpu"), rope=rope)
    call = f"{tag}-1"; matmul.matmul(torch.randn(1, 4096).to(bf16), torch.randn(256, 4096).to(bf16), counters=matmul.split_counters("cpu"))
    call = f"{tag}-1"; matmul.int4_matmul(x, matmul.pack_int4(codes), scales, scales)
    call = f"{tag}-1"; matmul.int8_group_matmul(x, codes.to(torch.int8), scales.float(), torch.float32)
    call = f"{tag}-1"; matmul.int4_int8_matmul(x, matmul.pack_int4(codes), scales, scales)
    call = f"{tag}-37"; matmul.int4_int8_matmul(torch.randn(37, 2048).to(bf16), matmul.pack_int4(codes), scales, scales)
    # _load4's asm reads the activations and is pure (free to move): no tile of rows may put it above the wait
    call = f"{tag}-8"; matmul.int4_int8_matmul(torch.randn(8, 2048).to(bf16), matmul.pack_int4(codes), scales, scales)
    call = f"{tag}-1"; matmul.int8_int8_matmul(x, codes.to(torch.int8), scales.float())
    call = f"{tag}-1"; matmul.int4_int8_matmul(x, *matmul.to_group_major(matmul.pack_int4(codes), scales, scales))
    matmul.SPLITS_IN_PROGRAM = 0  # each K split a program of its own
    call = f"{tag}-1"; matmul.int4_int8_matmul(x, matmul.pack_int4(codes), scales, scales)
    matmul.SPLITS_IN_PROGRAM = 128
    matmul.WORDS_IN_THREADS = 1024  # the code words over the threads, RoPE's epilogue too; 8 rows
    call = f"{tag}-1"; matmul.int4_int8_matmul(x, matmul.pack_int4(codes), scales, scales, rope=rope)
    call = f"{tag}-8"; matmul.int4_int8_matmul(torch.randn(8, 2048).to(bf16), matmul.pack_int4(codes), scales, scales)
    matmul.WORDS_IN_THREADS = 0

call = "pdl-1"; norm.add_rms_norm(x, x, torch.ones(2048, dtype=bf16), 1e-6, [])
call = "pdl-1"; elementwise.gated_activation(x, False, [])
call = "pdl-1"; elementwise.rotate(x.view(1, 16, 128)[:, :10], x[:, None, :128], x[:, None, :128])
call = "pdl-1"; elementwise.rotate_and_store(x.view(1, 16, 128)[:, :10], x.view(1, 16, 128)[:, 10:12], x[:, None, :128], x[:, None, :128], kv_cache, kv_cache, torch.arange(1, dtype=torch.int32))
matmuls("pdl")
call = "pdl-1"; sample.pick(torch.randn(1, 5000), sample.counters("cpu"))
call = "pdl-1"; sample.row_cumsum(torch.randn(1, 5000))
meta = torch.arange(100, dtype=torch.int32)  # as for one token above
args = (torch.randn(1, 8, 128).to(bf16), k_cache, k_cache, meta[5:9].view(1, 4), meta[:1], meta[1:2], meta[2:3], meta[3:4], 0.1)
kv = torch.randn(1, 2, 128).to(bf16)
call = "pdl-1"; attention.store_kv(kv, kv, k_cache, k_cache, meta[4:5])
call = "pdl-1"; attention.paged_attention(*args, num_splits=2)
# the matmuls once more, their weights prefetched into L2 before the wait as with KVSERVE_PDL=prefetch
gpu.PREFETCH = True
matmuls("prefetch")
# a layer wider than NARROW_N: longer K splits, more lines a row
wide = torch.randint(0, 16, (4224, 2048), dtype=torch.uint8)
wide_scales = torch.rand(4224, 64).half()
call = "prefetch-1"; matmul.int4_matmul(x, matmul.pack_int4(wide), wide_scales, wide_scales)
call = "prefetch-1"; matmul.int4_int8_matmul(x, matmul.pack_int4(wide), wide_scales, wide_scales)
"""


def test_the_persistent_probe_runs_a_steps_phases_in_one_kernel_with_the_bits_of_a_kernel_a_phase():
    """bench/gpu_persistent.py's plumbing (what a persistent decode step would save, measured on a GPU): its chain
    of one-row 4-bit products (2 layers of 5 phases, each reading the one before's output), a kernel a phase,
    against the same chain in float64; a kernel a phase of fewer programs, each looping over tiles, and one
    kernel of one program (here each barrier passes at once): the same bits, each phase's barrier counted
    once and none given up."""
    from bench import gpu_persistent

    step = gpu_persistent.Step("tiny", 2, DEVICE, torch.Generator(device=DEVICE).manual_seed(7))
    step.launched()
    launched = step.x.clone()
    assert gpu_persistent.relative(launched, step.reference()) < 1e-5
    step.x.zero_()
    step.launched(programs=3)  # `launched-looped`: a program taking tiles 3 apart
    assert torch.equal(step.x, launched)
    step.x.zero_()
    step.persistent(1)
    assert torch.equal(step.x, launched)
    assert step.count.item() == 10 and step.timed_out.item() == 0


def test_the_persistent_probes_real_chain_runs_kvserves_decoder_layers_in_one_kernel_with_their_bits():
    """The probe's chain again as a model's 4-bit decoder layers on kvserve's kernels (two layers, one token
    after 600 in each cache): the norms with the residual adds in q/k/v's and gate/up's prologues, RoPE and the
    cache's write in q/k/v's epilogue, the paged attention in the engine's key splits (16, merged by each KV
    head's last), SiLU in gate/up's epilogue, every K split added by its tile's last split, a kernel a phase and
    within bfloat16's rounding of the layers in float64; and kvserve's persistent step (kernels/gpu/persistent.py),
    one kernel whose programs loop over the phases' tiles through `_int4_tile` and `_attention_tile` with a grid
    barrier after each (one program here): the same bits and the same caches, each barrier counted once, the matmuls' and the attention's counters back
    at 0."""
    from bench import gpu_persistent

    position = 600  # two key splits of keys, merged
    step = gpu_persistent.RealStep("tiny", 2, DEVICE, torch.Generator(device=DEVICE).manual_seed(8), position)
    step.launched()
    launched, cache = step.x.clone(), (step.k_cache.clone(), step.v_cache.clone())
    # 0.009 from float64; without RoPE's sines 0.17, the norms' weights 0.19, the first split's keys halved 0.14
    assert gpu_persistent.relative(launched, step.reference()) < 0.05
    step.x.zero_()
    before, through = slice(0, position), slice(0, position + 1)
    for now, then in zip((step.k_cache, step.v_cache), cache, strict=True):  # the token's slot and those after: NaN
        now.fill_(float("nan"))
        now.flatten(1, 2)[:, before] = then.flatten(1, 2)[:, before]
    step.persistent(1)
    assert torch.equal(step.x, launched)
    for now, then in zip((step.k_cache, step.v_cache), cache, strict=True):  # each layer's k and v written
        assert torch.equal(now.flatten(1, 2)[:, through], then.flatten(1, 2)[:, through])
    assert step.count.item() == 10 and step.timed_out.item() == 0
    assert not step.counters.any() and not step.attention_counters.any()


_COMPILE_THE_PERSISTENT_STEP = r"""
import json, re, sys, tempfile, pathlib
import torch
from bench import gpu_sass
from triton.runtime import driver
from triton.runtime.jit import JITFunction

driver.set_active(gpu_sass._Hopper())
compiled = {}

def compile_only(kernel, grid):
    def warmup(*args, **kwargs):
        compiled[kernel.__name__] = kernel.run(*args, grid=grid, warmup=True, **kwargs)
    return warmup

JITFunction.__getitem__ = compile_only
from bench import gpu_persistent

from kvserve.layers.persistent_step import registers_cap

# two layers: a step of one would have its phase loop's count specialized as a constant
step = gpu_persistent.RealStep("llama1b", 2, "cpu", torch.Generator().manual_seed(0))
step.persistent(132, maxnreg=registers_cap())
kernel = compiled["_decode_layers_kernel"]
_, usage = gpu_sass.sass_of(kernel, pathlib.Path(tempfile.mkdtemp()))
print(json.dumps({
    "registers": int(re.search(r"REG:(\d+)", usage).group(1)),
    "stack": int(re.search(r"STACK:(\d+)", usage).group(1)),
    "shared": kernel.metadata.shared,
    "warps": kernel.metadata.num_warps,
}))
"""


def test_the_persistent_step_compiles_for_hopper_with_its_programs_resident():
    """kernels/gpu/persistent.py's kernel at the 1B shapes, its registers capped as the engine launches it, lowers
    to sm_90 code without spills, and PROGRAMS_PER_SM of its programs fit a multiprocessor at once (65,536
    registers, 227 KB of shared memory): its grid barriers wait for every program, so a program that could not
    start would stall the step."""
    import json
    import pathlib
    import subprocess
    import sys

    import triton

    from kvserve.layers.persistent_step import PROGRAMS_PER_SM

    if not (pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("triton has no ptxas to compile for the GPU with")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = pathlib.Path(__file__).resolve().parent.parent
    run = subprocess.run(
        [sys.executable, "-c", _COMPILE_THE_PERSISTENT_STEP], cwd=root, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-3000:]
    usage = json.loads(run.stdout.strip().splitlines()[-1])
    assert usage["stack"] == 0, usage
    assert PROGRAMS_PER_SM * usage["registers"] * 32 * usage["warps"] <= 65536, usage
    assert PROGRAMS_PER_SM * usage["shared"] <= 227 * 1024, usage


def test_the_kernels_compile_for_hopper_on_the_tensor_cores():
    """Every launch of the public functions lowers to sm_90 code (this catches a kernel that only the
    interpreter runs), 16-bit dots use the tensor cores, float32 dots never TF32, and a call compiles
    to the same binary for 1 row (token) as for many. With programmatic dependent launch on, each kernel
    waits for the one before it before it touches memory, but for the matmuls' weights prefetched into
    L2 where that is on too. Every launch pins FP contraction on, whatever Triton's default. The K loops
    of the matmuls with float inputs wait on no load of their own step."""
    import json
    import pathlib
    import subprocess
    import sys

    import triton

    if not (pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("triton has no ptxas to compile for the GPU with")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "0"  # Triton 3.10's default: a launch that does not pin it compiles unfused
    root = pathlib.Path(__file__).resolve().parent.parent
    # the plain launches and the PDL ones in two processes at once (a compile uses one core)
    passes = [
        subprocess.Popen(
            [sys.executable, "-c", _COMPILE_FOR_HOPPER + part],
            cwd=root,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for part in (_COMPILE_PLAIN, _COMPILE_PDL)
    ]
    launches = []
    try:
        for compiling in passes:
            stdout, stderr = compiling.communicate(timeout=600)
            assert compiling.returncode == 0, stderr[-3000:]
            launches += [json.loads(line) for line in stdout.splitlines()]
    finally:  # neither left running after a failure
        for compiling in passes:
            compiling.kill()
            compiling.wait()
    # The K loops of the matmuls with float inputs (the default path) wait on no load of their own step: their
    # weights, scales, mins, inputs and the norm's weight come a step ahead (the 4-bit kernel's scales and mins
    # were 2-byte loads in the step until their columns' groups were known to be aligned: an H200 would wait a
    # trip to memory at each K step). Known to wait: the attention kernel (the next chunk's block-table entries,
    # before its K and V rows can be asked for) and the int4 x int8 tensor-core kernel (`--activations int8`
    # from 9 rows).
    waits = {(launch[0].rpartition("-")[0], launch[1]): launch[-1] for launch in launches if launch[-1]}
    launches = [launch[:-1] for launch in launches]
    assert {kernel for _, kernel in waits} <= {"_attention_kernel", "_int4_int8_mma_kernel"}, waits
    # FP contraction on at every launch (`launch_options`), the arithmetic every GPU run has measured
    assert [launch[:2] for launch in launches if launch[-1] is not True] == []
    launches = [launch[:-1] for launch in launches]
    # no registers spilled to the stack (which a one-row kernel pays at every step) but where named here:
    # Q8_0 with float inputs (16 bytes), and two candidates that are off, group-major codes on the tensor
    # cores (37 rows: 408 bytes) and the code words over the threads with RoPE's epilogue (one row, in the
    # PDL pass: 2,664 bytes; docs/performance.md); with an older Triton (3.6, the GPU machine's) also the
    # int4 x int8 tensor cores' 64-row tile (136 to 536 bytes, `--activations int8` from 33 rows) and the
    # 4-bit kernel with the norm in its prologue (8 bytes, a candidate that is off).
    stacks = {(launch[0].rpartition("-")[0], launch[1]): launch[-1] for launch in launches if launch[-1]}
    launches = [launch[:-1] for launch in launches]
    known = {
        *((call, "_int8_kernel") for call in ("int8", "gate_up-int8", "qkv-int8", "normed-int8", "pdl", "prefetch")),
        ("int4-int8-gm-tiles", "_int4_int8_mma_kernel"),
        *((call, "_int4_int8_words_kernel") for call in ("pdl", "prefetch")),
    }
    if tuple(int(part) for part in triton.__version__.split(".")[:2]) < (3, 9):
        mma_calls = (
            "int4-int8",
            "int4-int8-tiles",
            "int4-int8-partials-tiles",
            "int4-int8-words",
            "qkv-int4-int8-tiles",
        )
        known |= {(call, "_int4_int8_mma_kernel") for call in (*mma_calls, "pdl", "prefetch")}
        known.add(("normed-int4-tiles", "_int4_kernel"))
    assert set(stacks) <= known, "; ".join(f"{c} {k} {s}" for (c, k), s in sorted(stacks.items()))
    # programmatic dependent launch (KVSERVE_PDL=1): every kernel waits for the one before it before it
    # touches memory, then lets the next one start; without it, no grid dependency control at all
    with_pdl = [launch for launch in launches if launch[0].startswith("pdl-")]
    prefetched = [launch for launch in launches if launch[0].startswith("prefetch-")]
    launches = [launch for launch in launches if not launch[0].startswith(("pdl-", "prefetch-"))]
    assert all(waits_first == "wait" for _, _, _, _, _, _, waits_first, _ in with_pdl), with_pdl
    assert {kernel for _, kernel, *_ in with_pdl} == {kernel for _, kernel, *_ in launches}, with_pdl
    # KVSERVE_PDL=prefetch: each matmul asks L2 for its weights before the wait, and only that; the
    # kernels around them as with PDL alone
    weight_kernels = {"_float_kernel", "_int4_kernel", "_int8_kernel", "_int4_int8_kernel", "_int4_int8_mma_kernel"}
    assert {kernel for _, kernel, *_ in prefetched} >= weight_kernels, prefetched
    for call, kernel, *_, waits_first, _ in prefetched:
        assert waits_first == ("prefetch" if kernel in weight_kernels else "wait"), (call, kernel, waits_first)
    kernels: dict[tuple[str, str], set[str]] = {}
    for call, kernel, mma, tf32, counts, ordered, waits_first, binary in launches:
        assert waits_first is None, (call, kernel)
        call, _, rows = call.rpartition("-")  # without the batch size
        assert tf32 == 0, (call, kernel)
        # a tile's splits counted by one atomic add, released and acquired across the GPU
        # (or the attention's; the splits kernel adds a layer's K splits in one program, uncounted)
        matmul_kernel = kernel not in ("_quantize_int8_kernel", "_sum_splits_kernel", "_int4_int8_splits_kernel")
        counted = (call.endswith("-tiles") and matmul_kernel) or kernel == "_pick_kernel"  # a row's chunks, too
        assert counts == (1 if counted else 0), (call, kernel, counts)
        # the other programs' partials visible to the last: stores, barrier, count, barrier, reads from L2
        assert ordered is (True if counted else None), (call, kernel, ordered)
        uses_dot = kernel in (
            "_float_kernel",
            "_int4_kernel",
            "_int8_kernel",
            "_attention_kernel",
            "_int4_int8_mma_kernel",
        )
        assert (sum(mma) > 0) == (uses_dot and call != "matmul-fp32"), (call, kernel, mma)
        if kernel in ("_int4_kernel", "_int8_kernel"):  # each row tile on mma.sync's 16 rows, as one row's
            assert mma[0] > 0 and mma[1] == 0, (call, kernel, mma)
            binary = (binary, 1 if rows == "1" or call.startswith("normed") else 4, mma[0])  # NormedRows: one
        kernels.setdefault((call, kernel), set()).add(binary)
    assert set(kernels) == {
        ("rms_norm", "_rms_norm_kernel"),
        ("add_rms_norm", "_rms_norm_kernel"),
        ("gated", "_gated_kernel"),
        ("gated-int8", "_gated_kernel"),
        ("add_rms_norm-int8", "_rms_norm_kernel"),
        ("rotate", "_rotate_kernel"),
        ("rotate_and_store", "_rotate_store_kernel"),
        ("matmul-bf16", "_float_kernel"),
        ("matmul-fp32", "_float_kernel"),
        ("lm_head", "_float_kernel"),
        ("int4", "_int4_kernel"),
        ("int4", "_sum_splits_kernel"),  # K = 2048, N = 256: four splits of 512
        ("int4-bf16x2", "_int4_kernel"),
        ("int4-bf16x2", "_sum_splits_kernel"),
        ("int8", "_int8_kernel"),
        ("int8", "_sum_splits_kernel"),
        ("int4-int8", "_quantize_int8_kernel"),
        ("int4-int8", "_int4_int8_splits_kernel"),  # 1 row: the layer's 8 K splits in one program
        ("int4-int8", "_int4_int8_mma_kernel"),
        ("int4-int8", "_sum_splits_kernel"),
        ("int8-int8", "_quantize_int8_kernel"),
        ("int8-int8", "_int4_int8_kernel"),  # CODE_BITS 8: a program a K split
        ("int8-int8", "_int4_int8_mma_kernel"),
        ("int8-int8", "_sum_splits_kernel"),
        ("int4-tiles", "_int4_kernel"),  # no sum kernel: each tile's last split adds
        ("int8-tiles", "_int8_kernel"),
        ("int4-int8-tiles", "_quantize_int8_kernel"),
        ("int4-int8-tiles", "_int4_int8_splits_kernel"),
        ("int4-int8-tiles", "_int4_int8_mma_kernel"),
        ("matmul-tiles", "_float_kernel"),  # K = 4096: two splits of 2048
        ("int4-gm-tiles", "_int4_kernel"),  # the codes group major (matmul.to_group_major)
        ("int4-int8-gm-tiles", "_quantize_int8_kernel"),
        ("int4-int8-gm-tiles", "_int4_int8_splits_kernel"),
        ("int4-int8-gm-tiles", "_int4_int8_mma_kernel"),
        ("int4-int8-partials-tiles", "_quantize_int8_kernel"),
        ("int4-int8-partials-tiles", "_int4_int8_kernel"),  # SPLITS_IN_PROGRAM 0: a program a K split
        ("int4-int8-partials-tiles", "_int4_int8_mma_kernel"),
        ("int4-int8-words", "_quantize_int8_kernel"),  # WORDS_IN_THREADS: the code words over the threads
        ("int4-int8-words", "_int4_int8_words_kernel"),
        ("int4-int8-words", "_int4_int8_mma_kernel"),  # 37 rows: the tensor cores, their splits' sum kernel
        ("int4-int8-words", "_sum_splits_kernel"),
        ("int8-int8-words", "_quantize_int8_kernel"),
        ("int8-int8-words", "_int4_int8_words_kernel"),
        ("int8-int8-words", "_int4_int8_mma_kernel"),
        ("int8-int8-words", "_sum_splits_kernel"),
        *[
            (f"words-{name}-r{rows}", kernel)
            for name, words_kernel in (
                ("32-splits", "_int4_int8_splits_kernel"),
                ("16-groups", "_int4_int8_words_kernel"),
            )
            for rows in (1, 8)
            for kernel in ("_quantize_int8_kernel", words_kernel)
        ],
        ("gate_up-tiles", "_float_kernel"),  # the activation applied by a tile's last split
        ("gate_up-int4-tiles", "_int4_kernel"),
        ("gate_up-int8", "_int8_kernel"),
        ("gate_up-int8", "_sum_splits_kernel"),  # or by the sum kernel
        ("qkv-tiles", "_float_kernel"),  # RoPE and the KV cache's write by a tile's last split
        ("qkv-int4-tiles", "_int4_kernel"),
        ("qkv-int8", "_int8_kernel"),
        ("qkv-int8", "_sum_splits_kernel"),  # or by the RoPE kernel after the sum kernel
        ("qkv-int8", "_rotate_store_kernel"),
        ("qkv-int4-int8-tiles", "_quantize_int8_kernel"),  # int8 inputs: the splits in one program, the mma tiles
        ("qkv-int4-int8-tiles", "_int4_int8_splits_kernel"),
        ("qkv-int4-int8-tiles", "_int4_int8_mma_kernel"),
        ("qkv-int8-int8-tiles", "_quantize_int8_kernel"),  # int8 codes: a program a K split
        ("qkv-int8-int8-tiles", "_int4_int8_kernel"),
        ("qkv-int8-int8-tiles", "_int4_int8_mma_kernel"),
        ("normed-rope", "_float_kernel"),  # the norm in the prologue, RoPE in the epilogue (one K split)
        ("normed-int4-tiles", "_int4_kernel"),  # and the activation by a tile's last split
        ("normed-int8", "_int8_kernel"),
        ("normed-int8", "_sum_splits_kernel"),
        ("store_kv", "_store_kv_kernel"),
        ("attention", "_attention_kernel"),
        ("attention-splits", "_attention_kernel"),
        ("attention-splits", "_combine_kernel"),
        ("attention-tiles", "_attention_kernel"),  # no combine kernel: each tile's last split merges
        ("pick", "_pick_kernel"),
        ("row_cumsum", "_cumsum_kernel"),
        ("pick-random", "_pick_kernel"),
    }
    # one binary per call whatever the batch's size: nothing compiled differently for one row (int4 x
    # int8 runs dp4a for one row and the tensor cores for 37, with the same bits: its rows' sums are
    # exact and their float steps their own, test_int4_int8_matmul_on_the_tensor_cores_gives_the_bits_of_dp4a)
    # The int4 and int8 kernels compile once for each count of row tiles a program holds (`row_tiles_for`:
    # 1 for one row, 4 for 37), each tile's dots the same instructions in the same order (the bits:
    # test_a_program_of_several_row_tiles_gives_the_bits_of_a_tile_a_program, and on a GPU
    # test_matmul_rows_at_model_sizes_are_the_same_bits_for_any_number_of_rows)
    for (call, kernel), binaries in kernels.items():
        if kernel in ("_int4_kernel", "_int8_kernel"):
            by_tiles = {}
            for binary, tiles, mma_sync in binaries:
                by_tiles.setdefault(tiles, set()).add((binary, mma_sync))
            expected = [1] if call.startswith("normed") else [1, 4]
            assert sorted(by_tiles) == expected and all(len(b) == 1 for b in by_tiles.values()), (call, by_tiles)
            if 4 in by_tiles:  # 37 rows: four tiles' dots in each program, one row's one
                ((_, one),), ((_, four),) = by_tiles[1], by_tiles[4]
                assert four == 4 * one, (call, kernel, one, four)
        else:
            assert len(binaries) == 1, (call, kernel, binaries)


# The default path's launches for a bfloat16 model and a 4-bit one (float and int8 inputs), compiled for
# the GPU given on the command line: one row, and 37 rows where a kernel or its row tiles change. Each
# launch's tensor-core instructions (Ampere's mma.sync, Hopper's wgmma, Blackwell's tcgen05), traps, TF32.
_COMPILE_DEFAULTS = r"""
def launch(kernel, grid):
    def warmup(*args, **kwargs):
        compiled = kernel.run(*args, grid=grid, warmup=True, **kwargs)
        body = compiled.asm["ptx"][compiled.asm["ptx"].index(".entry"):]
        mma = [len(re.findall(pattern, body)) for pattern in (r"\bmma\.sync", r"\bwgmma\.mma_async", r"\btcgen05\.mma")]
        print(json.dumps([call, kernel.__name__, mma, len(re.findall(r"\btrap;", body)), len(re.findall("tf32", body)), compiled.metadata.shared]), flush=True)
    return warmup

JITFunction.__getitem__ = launch
matmul.ROW_TILE_PROGRAMS = 1  # the int4 and int8 kernels' row tiles by the rows alone (37 rows: 4)
g = torch.ones(2048, dtype=bf16)
codes = torch.randint(0, 16, (256, 2048), dtype=torch.uint8)
scales = torch.rand(256, 64).to(bf16)
for m in (1, 37):
    x = torch.randn(m, 2048).to(bf16)
    counters = matmul.split_counters("cpu")
    rope = matmul.RopeStore(x[:, None, :64], x[:, None, :64], torch.zeros(8, 16, 1, 64, dtype=bf16), torch.zeros(8, 16, 1, 64, dtype=bf16), torch.arange(m, dtype=torch.int32), 2)
    call = f"add_rms_norm-{m}"; norm.add_rms_norm(x, x, g, 1e-6)
    call = f"add_rms_norm-int8-{m}"; norm.add_rms_norm(x, x, g, 1e-6, [])
    call = f"gated-int8-{m}"; elementwise.gated_activation(x, False, [])
    call = f"qkv-{m}"; matmul.matmul(torch.randn(m, 4096).to(bf16), torch.randn(256, 4096).to(bf16), counters=counters, rope=rope)
    call = f"gate_up-{m}"; matmul.matmul(torch.randn(m, 4096).to(bf16), torch.randn(256, 4096).to(bf16), counters=counters, activation="silu")
    call = f"lm_head-{m}"; matmul.matmul(x, torch.randn(256, 2048).to(bf16), out_dtype=torch.float32)
    call = f"qkv-int4-{m}"; matmul.int4_matmul(x, matmul.pack_int4(codes), scales, scales, packed_bf16=True, counters=counters, rope=rope)
    call = f"gate_up-int4-{m}"; matmul.int4_matmul(x, matmul.pack_int4(codes), scales, scales, packed_bf16=True, counters=counters, activation="silu")
    call = f"int4-fp16-{m}"; matmul.int4_matmul(x, matmul.pack_int4(codes), scales.half(), scales.half(), counters=counters)
    call = f"lm_head-int8-{m}"; matmul.int8_group_matmul(x, codes.to(torch.int8), scales.float(), torch.float32, counters=counters)
    call = f"qkv-int4-int8-{m}"; matmul.int4_int8_matmul(x, matmul.pack_int4(codes), scales.half(), scales.half(), counters=counters, rope=rope)
    call = f"lm_head-int8-int8-{m}"; matmul.int8_int8_matmul(x, codes.to(torch.int8), scales.float(), counters=counters)
    call = f"pick-{m}"; sample.pick(torch.randn(m, 5000), sample.counters("cpu"), torch.arange(m), torch.arange(m), torch.ones(m))
    call = f"row_cumsum-{m}"; sample.row_cumsum(torch.randn(m, 5000))
k_cache = torch.zeros(8, 16, 2, 128, dtype=bf16)
for t in (1, 3):  # a decode of one token, a prefill tile of 3
    meta = torch.arange(100, dtype=torch.int32)
    args = (torch.randn(t, 8, 128).to(bf16), k_cache, k_cache, meta[5:9].view(1, 4), meta[:t], meta[t : t + 1], meta[t + 1 : t + 2], meta[t + 2 : t + 3], 0.1)
    call = f"attention-{t}"; attention.paged_attention(*args, num_splits=2, counters=attention.attention_counters("cpu"))
"""


def test_the_kernels_compile_for_ampere_and_blackwell_on_the_tensor_cores():
    """The default path (a bfloat16 model, a 4-bit one with float or int8 inputs) lowers to code for
    the oldest GPUs kvserve serves on (sm_80: A100, A10, RTX 30xx) and the newest (sm_100: B200;
    sm_120: RTX 50xx), CI having none of them, and each of its dots runs on the tensor cores there.
    Below sm_80 kvserve refuses the GPU (`kernels.gpu.MIN_CAPABILITY`): for sm_75 Triton makes FMA
    loops of every dot and ptxas refuses the packed bfloat16 FMAs."""
    import json
    import pathlib
    import subprocess
    import sys

    import triton

    from kvserve.kernels.gpu import MIN_CAPABILITY

    if not (pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("triton has no ptxas to compile for the GPU with")
    assert MIN_CAPABILITY == (8, 0)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = pathlib.Path(__file__).resolve().parent.parent
    # a process a GPU (Triton's JIT keeps one target a device); two at a time, on two cores
    targets = {capability: None for capability in (80, 100, 120)}
    for batch in ((80, 100), (120,)):
        running = {
            capability: subprocess.Popen(
                [sys.executable, "-c", _COMPILE_FOR_HOPPER + _COMPILE_DEFAULTS, str(capability)],
                cwd=root,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for capability in batch
        }
        try:
            for capability, compiling in running.items():
                stdout, stderr = compiling.communicate(timeout=600)
                assert compiling.returncode == 0, (capability, stderr[-3000:])
                targets[capability] = [json.loads(line) for line in stdout.splitlines()]
        finally:
            for compiling in running.values():
                compiling.kill()
                compiling.wait()
    dots = {"_float_kernel", "_int4_kernel", "_int8_kernel", "_attention_kernel", "_int4_int8_mma_kernel"}
    for capability, launches in targets.items():
        assert {kernel for _, kernel, *_ in launches} >= dots | {"_int4_int8_splits_kernel", "_pick_kernel"}, capability
        for call, kernel, mma, traps, tf32, shared in launches:
            # a kernel LLVM found undefined compiles to a bare `trap` (sm_100's 64-row int8 tile, Triton 3.9)
            assert traps == 0 and tf32 == 0, (capability, call, kernel, traps, tf32)
            # within a block's shared memory on the smallest GPU of each target: an RTX 3090 or 4090 (sm_86 and
            # sm_89, compiled as sm_80) and an RTX 5090 (sm_120) have 99 KB (the float kernel's narrow tiles: 72 KB)
            limit = 232448 if capability == 100 else 101376
            assert 0 < shared <= limit or kernel not in dots, (capability, call, kernel, shared)
            if kernel in ("_int4_kernel", "_int8_kernel", "_int4_int8_mma_kernel", "_attention_kernel"):
                # their dequantized (or probability) operand in registers: mma.sync on every GPU
                assert mma[0] > 0 and mma[1] == mma[2] == 0, (capability, call, kernel, mma)
            elif kernel == "_float_kernel":  # both operands from memory: Blackwell's tcgen05 on a B200
                assert mma[2 if capability == 100 else 0] > 0, (capability, call, kernel, mma)
            else:
                assert sum(mma) == 0, (capability, call, kernel, mma)


# Each matmul kernel with and without a timeline recording (kvserve/kernels/gpu/timeline.py): the PTX's reads
# of the global timer, the cycle counter and the multiprocessor's number, per kernel and recording or not
_COMPILE_TIMELINE = r"""
import collections, contextlib
from kvserve.kernels.gpu import timeline
reads = collections.defaultdict(list)

def counting(kernel, grid):
    def warmup(*args, **kwargs):
        ptx = kernel.run(*args, grid=grid, warmup=True, **kwargs).asm["ptx"]
        counts = [len(re.findall(rf"mov\.u(32|64) %(r|rd)\d+, %{reg};", ptx)) for reg in ("globaltimer", "clock64", "smid")]
        reads[(kernel.__name__, "timeline" in kwargs)].append(counts)
    return warmup

JITFunction.__getitem__ = counting
codes = torch.randint(0, 16, (256, 2048), dtype=torch.uint8)
scales = torch.rand(256, 64).to(bf16)
for recording in (False, True):
    with timeline.recording(timeline.Timeline("cpu", 4096)) if recording else contextlib.nullcontext():
        for m in (1, 37):
            x = torch.randn(m, 2048).to(bf16)
            matmul.matmul(x, torch.randn(256, 2048).to(bf16), counters=matmul.split_counters("cpu"))
            matmul.int4_matmul(x, matmul.pack_int4(codes), scales, scales, packed_bf16=True, counters=matmul.split_counters("cpu"))
            matmul.int8_group_matmul(x, codes.to(torch.int8), scales.float(), counters=matmul.split_counters("cpu"))
            matmul.int4_int8_matmul(x, matmul.pack_int4(codes), scales, scales)
            matmul.int8_int8_matmul(x, codes.to(torch.int8), scales.float())
            matmul.WORDS_IN_THREADS = 1024
            matmul.int4_int8_matmul(x, matmul.pack_int4(codes), scales, scales)
            matmul.WORDS_IN_THREADS = 0
print(json.dumps({f"{name} {recorded}": counts for (name, recorded), counts in reads.items()}))
"""


def test_the_matmul_kernels_read_the_clocks_only_while_a_timeline_records():
    """bench/gpu_timeline.py's stamps compile for sm_90 in every matmul kernel: with a recording, each
    program reads the global timer and the cycle counter at its four points and its multiprocessor once;
    without one (every launch of the engine) none of them is in the code."""
    import json
    import pathlib
    import subprocess
    import sys

    import triton

    if not (pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("triton has no ptxas to compile for the GPU with")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "0"
    root = pathlib.Path(__file__).resolve().parent.parent
    script = _COMPILE_FOR_HOPPER + _COMPILE_TIMELINE
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    reads = json.loads(done.stdout.splitlines()[-1])
    kernels = {
        "_float_kernel",
        "_int4_kernel",
        "_int8_kernel",
        "_int4_int8_splits_kernel",
        "_int4_int8_kernel",
        "_int4_int8_mma_kernel",
        "_int4_int8_words_kernel",
    }
    assert set(reads) >= {f"{kernel} {recorded}" for kernel in kernels for recorded in (True, False)}, sorted(reads)
    for key, counts in reads.items():
        recorded = key.endswith("True")
        assert all(c == ([4, 4, 1] if recorded else [0, 0, 0]) for c in counts), (key, counts)
