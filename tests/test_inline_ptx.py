"""The kernels' inline assembly (kvserve/kernels/gpu/common.py: PRMT nibbles, packed bfloat16 FMAs, the
rounding conversion, dp4a group sums with their 128-bit loads, L2 prefetches) run on the CPU: Triton's
interpreter runs each helper's GPU branch through tests/ptx.py, which executes the PTX as the ISA
defines it, and the tests compare it with the helper's interpreter branch, which the other tests
check against the CPU's kernels and float64. Without this the GPU branches ran only on a GPU, and no
GPU session has run int4 x int8 or the packed bfloat16 weights yet. What it cannot see is hardware
that differs from the ISA as tests/ptx.py reads it: tests/test_cuda.py on a GPU stays the judge."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses

import numpy as np
import pytest

pytest.importorskip("triton")

import triton
import triton.language as tl

from kvserve.kernels import gpu
from kvserve.kernels.gpu import common, matmul
from tests.ptx import emulating

if not gpu.INTERPRET:
    pytest.skip("the emulation runs in Triton's interpreter; a GPU runs the assembly itself", allow_module_level=True)

# the helpers with their GPU branch forced, whatever INTERPRET the kernel passes them (a kernel's globals
# are looked up when the interpreter runs it, so the tests put these in the kernels' modules)
_nibble_to_float, _nibble_fma_bf16, _round_to_int = common.nibble_to_float, common.nibble_fma_bf16, common.round_to_int
_group_dot, _int8_group_dot = common.group_dot, common.int8_group_dot


@triton.jit
def _nibble_to_float_asm(byte, HIGH: tl.constexpr, PERMUTE: tl.constexpr, INTERPRET: tl.constexpr):
    return _nibble_to_float(byte, HIGH, PERMUTE, False)


@triton.jit
def _nibble_fma_bf16_asm(byte, scale, low, HIGH: tl.constexpr, INTERPRET: tl.constexpr):
    return _nibble_fma_bf16(byte, scale, low, HIGH, False)


@triton.jit
def _round_to_int_asm(x, INTERPRET: tl.constexpr):
    return _round_to_int(x, False)


@triton.jit
def _group_dot_asm(w, q, INTERPRET: tl.constexpr):
    return _group_dot(w, q, False)


@triton.jit
def _int8_group_dot_asm(w_low, w_high, q, INTERPRET: tl.constexpr):
    return _int8_group_dot(w_low, w_high, q, False)


@triton.jit
def _helpers_kernel(
    byte_ptr, scale_ptr, low_ptr, x_ptr, floats_ptr, bf16_ptr, ints_ptr, N: tl.constexpr, ASM: tl.constexpr
):
    """Each elementwise helper over N inputs, by its GPU branch (ASM) or its interpreter branch."""
    i = tl.arange(0, N)
    byte, scale, low, x = tl.load(byte_ptr + i), tl.load(scale_ptr + i), tl.load(low_ptr + i), tl.load(x_ptr + i)
    tl.store(floats_ptr + i, _nibble_to_float(byte, False, True, not ASM))
    tl.store(floats_ptr + N + i, _nibble_to_float(byte, True, True, not ASM))
    tl.store(bf16_ptr + i, _nibble_fma_bf16(byte, scale, low, False, not ASM))
    tl.store(bf16_ptr + N + i, _nibble_fma_bf16(byte, scale, low, True, not ASM))
    tl.store(ints_ptr + i, _round_to_int(x, not ASM))


def test_the_elementwise_helpers_assembly_gives_their_interpreter_branchs_bits():
    """nibble_to_float's PRMTs over every byte; nibble_fma_bf16's packed FMAs (one rounding of scale x
    nibble + low) at scales and mins of many sizes, including mins far smaller than the product, where
    the float32 sum lands on a tie of two bfloat16 values and the interpreter branch's correction
    decides; cvt.rni's ties to even. Every output the same bits both ways."""
    g = torch.Generator().manual_seed(5)
    n = 4096
    byte = torch.arange(n, dtype=torch.int64).remainder(256).to(torch.uint8)
    scale = torch.randn(n, generator=g) * torch.exp2(torch.randint(-20, 8, (n,), generator=g).float())
    scale = scale.to(torch.bfloat16)
    small = torch.exp2(torch.randint(-40, -8, (n,), generator=g).float())  # mins far below the products
    low = torch.where(torch.arange(n) % 2 == 0, torch.randn(n, generator=g), small * torch.randn(n, generator=g))
    low = low.to(torch.bfloat16)
    low[::7] = 0
    x = torch.randn(n, generator=g) * 200
    x[: n // 4] = torch.randint(-(2**21), 2**21, (n // 4,), generator=g).float() + 0.5  # ties
    x[n // 4 : n // 2] = torch.randint(-300, 300, (n // 4,), generator=g).float()
    runs = []
    for asm in (False, True):
        outs = torch.empty(2 * n), torch.empty(2 * n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.int32)
        with emulating():
            _helpers_kernel[(1,)](byte, scale, low, x, *outs, N=n, ASM=asm)
        runs.append(outs)
    (floats, bf16, ints), (floats_asm, bf16_asm, ints_asm) = runs
    assert torch.equal(floats_asm, floats) and torch.equal(floats[:n], (byte & 15).float())
    assert torch.equal(ints_asm, ints) and torch.equal(ints, torch.round(x).to(torch.int32))  # torch: ties to even
    assert torch.equal(bf16_asm.view(torch.int16), bf16.view(torch.int16))
    product = scale.double() * (byte & 15).double()
    exact = product + low.double()
    assert torch.all((bf16[:n].double() - exact).abs() <= exact.abs() * 2.0**-8)  # one rounding
    # the cases the interpreter branch's correction is for: a product halfway between two bfloat16 values
    # and a min too small to move its float32 sum
    mantissa = np.frexp(product.numpy())[0]  # |mantissa| in [0.5, 1): 8 bits of bfloat16, then the tie's bit
    halfway = np.modf(np.abs(mantissa) * 256)[0] == 0.5
    hidden = (low != 0).numpy() & (product.float() + low.float() == product.float()).numpy()
    assert np.count_nonzero(halfway & hidden) > 20


def test_the_emulations_packed_fma_rounds_once():
    """tests/ptx.py's fma.rn.bf16x2 on cases worked by hand. 9 x 14.5 = 130.5 lies halfway between the
    bfloat16 values 130 and 131 (their spacing is 1 from 128 to 256): alone it rounds to the even 130;
    plus 2**-60 it is above the tie (131), minus 2**-60 below it (130), though the float64 sum of both
    is 130.5; 7 x 18.5 = 129.5 rounds to 130, and minus 2**-60 to 129. The high halves: 0 x 0 + 0."""
    from tests.ptx import _fma_bf16x2

    def bits(value: float) -> int:
        return int(torch.tensor([value], dtype=torch.bfloat16).view(torch.int16)[0]) & 0xFFFF

    cases = [(9, 14.5, 0.0, 130), (9, 14.5, 2.0**-60, 131), (9, 14.5, -(2.0**-60), 130)]
    cases += [(7, 18.5, 0.0, 130), (7, 18.5, -(2.0**-60), 129), (-7, 18.5, 2.0**-60, -129)]
    a, b, c = (np.array([bits(case[i]) for case in cases], np.uint64) for i in range(3))
    assert [int(r) for r in _fma_bf16x2(a, b, c)] == [bits(case[3]) for case in cases]


@pytest.mark.parametrize("kind, k", [("int4-int8", 1024 + 160), ("int4-int8", 768), ("int8-int8", 1024 + 160)])
def test_the_int8_input_matmuls_with_their_dp4a_assembly_give_the_interpreters_bits(monkeypatch, kind, k):
    """`_int4_int8_kernel` (and with int8 codes) through its GPU branches: the inputs quantized by
    cvt.rni, each group's sum by 128-bit loads and eight dp4a (every 128-bit load's address checked
    16-byte aligned, as the hardware requires); 1, 3 and 8 rows, K splits with a short last one, a bias;
    and K in three whole splits, which `_int4_int8_splits_kernel` takes in one program."""
    m, n = 8, 80
    g = torch.Generator().manual_seed(7)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g)
    scales = torch.rand(n, k // 32, generator=g).half() * 0.01
    if kind == "int4-int8":
        packed = matmul.pack_int4(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8))
        mins = -8 * scales
        run = lambda rows: matmul.int4_int8_matmul(rows, packed, scales, mins, torch.float32, bias)  # noqa: E731
    else:
        codes = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        run = lambda rows: matmul.int8_int8_matmul(rows, codes, scales.float(), torch.float32, bias)  # noqa: E731
    expected = [run(x[:rows]) for rows in (1, 3, 8)]
    monkeypatch.setattr(matmul, "group_dot", _group_dot_asm)
    monkeypatch.setattr(matmul, "int8_group_dot", _int8_group_dot_asm)
    monkeypatch.setattr(common, "round_to_int", _round_to_int_asm)
    with emulating() as emulator:
        for rows, want in zip((1, 3, 8), expected, strict=True):
            assert torch.equal(run(x[:rows]), want), rows
    assert emulator.loads and all(address % 16 == 0 for address in emulator.loads)


@pytest.mark.parametrize("packed_bf16", [False, True])
def test_the_int4_matmul_with_its_assembly_gives_the_interpreters_bits(monkeypatch, packed_bf16):
    """`_int4_kernel` through its GPU branch: nibbles to floats by PRMT (the default), or the packed
    bfloat16 FMAs of `packed_bf16` (scales and mins stored as bfloat16 and as float16)."""
    m, k, n = 3, 512 + 96, 48
    g = torch.Generator().manual_seed(9)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    packed = matmul.pack_int4(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8))
    for dtype in (torch.float16, torch.bfloat16):
        scales = (torch.rand(n, k // 32, generator=g) * 0.02).to(dtype)
        mins = (-torch.rand(n, k // 32, generator=g) * 0.1).to(dtype)
        expected = matmul.int4_matmul(x, packed, scales, mins, packed_bf16=packed_bf16)
        with monkeypatch.context() as patch, emulating():
            patch.setattr(matmul, "nibble_to_float", _nibble_to_float_asm)
            patch.setattr(matmul, "nibble_fma_bf16", _nibble_fma_bf16_asm)
            assert torch.equal(matmul.int4_matmul(x, packed, scales, mins, packed_bf16=packed_bf16), expected), dtype


def test_every_matmuls_l2_prefetches_stay_inside_its_weights(monkeypatch):
    """KVSERVE_PDL=prefetch (only on a Hopper GPU): each matmul program asks L2 for its split of its
    weight rows before its wait. Forced on here with 1 and 8 lines a row: every address asked for lies
    inside the weights (codes or weights, scales, mins), each of them gets some, and the outputs keep
    their bits (a prefetch changes no value)."""
    m, k, n = 3, 1024 + 160, 80  # three K splits, the last short; a ragged column tile
    g = torch.Generator().manual_seed(11)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    scales = torch.rand(n, k // 32, generator=g).half() * 0.01
    mins = -8 * scales
    scales32 = scales.float()
    packed = matmul.pack_int4(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8))
    codes = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    weight = torch.randn(n, k, generator=g).to(torch.bfloat16)
    monkeypatch.setattr(matmul, "FLOAT_CONFIG", dataclasses.replace(matmul.FLOAT_CONFIG, k_per_split=512))
    calls = {
        "float": (lambda: matmul.matmul(x, weight), [weight]),
        "int4": (lambda: matmul.int4_matmul(x, packed, scales, mins), [packed, scales, mins]),
        "int4-int8": (lambda: matmul.int4_int8_matmul(x, packed, scales, mins), [packed, scales, mins]),
        "int8": (lambda: matmul.int8_group_matmul(x, codes, scales32), [codes, scales32]),
        "int8-int8": (lambda: matmul.int8_int8_matmul(x, codes, scales32), [codes, scales32]),
    }
    for name, (call, weights) in calls.items():
        expected = call()
        spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in weights]
        for lines in (1, 8):
            monkeypatch.setattr(matmul, "prefetch_lines", lambda device, split_bytes, lines=lines: lines)
            with emulating() as emulator:
                assert torch.equal(call(), expected), (name, lines)
            inside = [[start <= a < end for start, end in spans] for a in emulator.prefetched]
            assert all(any(hits) for hits in inside), (name, lines)
            assert all(any(hits[i] for hits in inside) for i in range(len(spans))), (name, lines)
        monkeypatch.setattr(matmul, "prefetch_lines", gpu.prefetch_lines)
