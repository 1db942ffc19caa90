"""Triton helpers shared by the kernels: a dot product that stays correct in the interpreter and a
float conversion that rounds as the GPU does."""

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
