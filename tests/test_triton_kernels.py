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

import pytest

pytest.importorskip("triton")

from kvserve.kernels import gpu
from kvserve.kernels.gpu import attention, matmul, norm  # noqa: F401

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


# --- RMSNorm


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_matches_the_formula_and_each_row_alone(dtype):
    rows, hidden, eps = 9, 1100, 1e-5  # hidden > norm.BLOCK: the sum runs over two steps
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
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
    monkeypatch.setattr(matmul, "FLOAT_CONFIG", dataclasses.replace(matmul.FLOAT_CONFIG, k_per_split=64))
    x = _randn(19, 200, seed=7, dtype=torch.bfloat16)  # 4 splits, the last one short
    w = _randn(40, 200, seed=8, dtype=torch.bfloat16)
    bias = _randn(40, seed=9)
    out = matmul.matmul(x, w, bias)
    _check_matmul(out, x, w, bias)
    _each_row_alone(lambda rows: matmul.matmul(rows, w, bias), x, out)


def _int4_weight(n: int, k: int, scale_dtype: torch.dtype, seed: int):
    g = _generator(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = (torch.rand(n, k // 32, generator=g) * 0.1 + 0.01).to(scale_dtype)
    mins = (-torch.rand(n, k // 32, generator=g) * 0.8).to(scale_dtype)
    # the documented weight: fma(scale, code, min) in float32; in float64 the product and sum are exact
    per_input = lambda t: t.double().repeat_interleave(32, dim=1)  # noqa: E731
    dequantized = (per_input(scales) * codes.double() + per_input(mins)).float()
    return codes.to(DEVICE), scales.to(DEVICE), mins.to(DEVICE), dequantized.to(DEVICE)


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
    m, k, n = 21, 1024 + 160, 80  # two K splits (INT4_CONFIG.k_per_split = 1024), the second not a whole tile
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


def test_int8_group_matmul_each_row_alone():
    m, k, n = 37, 1024 + 64, 48
    codes, scales, _ = _int8_weight(n, k, seed=19)
    x = _randn(m, k, seed=20, dtype=torch.bfloat16)
    out = matmul.int8_group_matmul(x, codes, scales, torch.float32)
    _each_row_alone(lambda rows: matmul.int8_group_matmul(rows, codes, scales, torch.float32), x, out)
