"""Triton helpers shared by the kernels: a dot product that stays correct in the interpreter, a
float conversion that rounds as the GPU does, and int4 nibbles turned into numbers."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dot(a, b, acc, INTERPRET: tl.constexpr):
    """acc + a @ b, accumulated in float32. On a GPU 16-bit operands go to the tensor cores as they
    are, and float32 operands use exact float32 products (`ieee`, never TF32). The interpreter
    multiplies bfloat16 as the integers it stores them in, so there both operands become float32
    first (exact, as bfloat16 and float16 widen losslessly), and its dot (numpy's float32 matmul)
    sums a row in an order that can follow the row's place in the tile and the tile's shape, which
    the tensor cores never do: so there each output is a sum over K of its own products, the same
    for every row."""
    if INTERPRET:
        return acc + tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    elif a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def cast(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """x (float32) converted to `dtype`, rounded to nearest even as on a GPU. The interpreter
    truncates float32 to bfloat16, so there the rounding is done on the bits."""
    if INTERPRET and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)  # add half an ulp of bfloat16, ties to even
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


@triton.jit
def nibble_to_float(byte, HIGH: tl.constexpr, PERMUTE: tl.constexpr, INTERPRET: tl.constexpr):
    """The low (HIGH: high) nibble of each uint8 as float32, exactly. PERMUTE (on a GPU): an AND (and a
    shift) per four bytes, then per byte a PRMT that builds the bits of 2**23 + nibble and a subtraction
    of 2**23, where the conversion instruction runs at a fraction of the FMAs' rate. The same values,
    so the same bits downstream: the int4 matmul's step took 0.91 -> 0.83 ms for one row on an H200
    (bench/gpu_kernels.py, `int4-convert`; OR-ing the nibble into 2**23's bits measured slower than
    the instruction)."""
    if PERMUTE and not INTERPRET:
        shift: tl.constexpr = "shr.b32 t, $4, 4;" if HIGH else "mov.b32 t, $4;"
        bits = tl.inline_asm_elementwise(
            asm="{ .reg .b32 t, m; " + shift + " and.b32 t, t, 0x0F0F0F0F; mov.b32 m, 0x4B000000;"
            " prmt.b32 $0, t, m, 0x7540; prmt.b32 $1, t, m, 0x7541;"
            " prmt.b32 $2, t, m, 0x7542; prmt.b32 $3, t, m, 0x7543; }",
            constraints="=r,=r,=r,=r,r",
            args=[byte],
            dtype=tl.int32,
            is_pure=True,
            pack=4,
        )
        return bits.to(tl.float32, bitcast=True) - 8388608.0
    else:
        return (byte >> 4 if HIGH else byte & 15).to(tl.float32)


@triton.jit
def nibble_fma_bf16(byte, scale, low, HIGH: tl.constexpr, INTERPRET: tl.constexpr):
    """fma(scale, nibble, low) rounded once to bfloat16, for the low (HIGH: high) nibble of each uint8,
    with bfloat16 scale and low. On a GPU, per two weights: a PRMT builds the bits of bfloat16 2**7 +
    nibble (exponent byte 0x43 beside the nibble), a packed FMA subtracts 2**7 exactly, a second
    multiplies by the scale and adds low with one rounding; no float32 value and no conversion
    instruction, where `nibble_to_float` then an FMA and a rounding take about four instructions per
    weight. The interpreter computes the same in float32 (the product of a nibble and a bfloat16 is
    exact there) and rounds once to nearest even."""
    if INTERPRET:
        nibble = (byte >> 4 if HIGH else byte & 15).to(tl.float32)
        return cast(tl.fma(scale.to(tl.float32), nibble, low.to(tl.float32)), tl.bfloat16, INTERPRET)
    else:
        # operands: $0 $1 the four weights as two bfloat16 pairs; $2 four bytes; $3 $4 scales; $5 $6 lows
        shift: tl.constexpr = "shr.b32 t, $2, 4;" if HIGH else "mov.b32 t, $2;"
        return tl.inline_asm_elementwise(
            asm="{ .reg .b32 t, e, one, neg; " + shift + " and.b32 t, t, 0x0F0F0F0F;"
            " mov.b32 e, 0x43434343; mov.b32 one, 0x3F803F80; mov.b32 neg, 0xC300C300;"
            " prmt.b32 $0, t, e, 0x5140; prmt.b32 $1, t, e, 0x5342;"
            " fma.rn.bf16x2 $0, $0, one, neg; fma.rn.bf16x2 $1, $1, one, neg;"
            " fma.rn.bf16x2 $0, $0, $3, $5; fma.rn.bf16x2 $1, $1, $4, $6; }",
            constraints="=r,=r,r,r,r,r,r",
            args=[byte, scale, low],
            dtype=tl.bfloat16,
            is_pure=True,
            pack=4,
        )
