"""RMSNorm, one program per row (batch invariant: a row's sum never depends on the other rows)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.kernels.gpu import INTERPRET, launch_options
from kvserve.kernels.gpu.common import cast, quantize_groups, store_groups, wait_for_prior

BLOCK = 1024  # elements of a row per step; the row's squares are summed per lane, then across lanes
NUM_WARPS = 4  # per row; fixed, as the lanes' final sum follows the layout


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    delta_ptr,
    weight_ptr,
    sum_ptr,
    out_ptr,
    hidden,
    eps,
    stride_x,
    stride_d,
    stride_out,
    words_ptr,
    d_ptr,
    s_ptr,
    ADD: tl.constexpr,
    QUANTIZE: tl.constexpr,
    BLOCK: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """RMSNorm of a row of x, or (ADD) of x + delta rounded to x's dtype, that sum also stored; with
    QUANTIZE the output as stored also quantized per group of 32 (`quantize_groups`: the int4 x int8
    matmul's inputs, `matmul.quantize_int8`'s bits, without its own launch)."""
    wait_for_prior(PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    lanes = tl.arange(0, BLOCK)
    squares = tl.zeros((BLOCK,), tl.float32)  # lane i sums elements i, i + BLOCK, ... in that order
    for start in range(0, hidden, BLOCK):
        mask = start + lanes < hidden
        x = tl.load(x_row + start + lanes, mask=mask, other=0.0).to(tl.float32)
        if ADD:
            d = tl.load(delta_ptr + row * stride_d + start + lanes, mask=mask, other=0.0).to(tl.float32)
            x = cast(x + d, x_ptr.dtype.element_ty, INTERPRET)
            tl.store(sum_ptr + row * hidden + start + lanes, x, mask=mask)
            x = x.to(tl.float32)
        squares += x * x
    rstd = 1.0 / tl.sqrt_rn(tl.sum(squares, axis=0) / hidden + eps)
    for start in range(0, hidden, BLOCK):
        mask = start + lanes < hidden
        x = tl.load(x_row + start + lanes, mask=mask, other=0.0).to(tl.float32)
        if ADD:  # the sum again, the same bits as the one stored
            d = tl.load(delta_ptr + row * stride_d + start + lanes, mask=mask, other=0.0).to(tl.float32)
            x = cast(x + d, x_ptr.dtype.element_ty, INTERPRET).to(tl.float32)
        y = cast(x * rstd, x_ptr.dtype.element_ty, INTERPRET).to(tl.float32)  # rounded to x's dtype first
        w = tl.load(weight_ptr + start + lanes, mask=mask, other=0.0).to(tl.float32)
        out = cast(w * y, out_ptr.dtype.element_ty, INTERPRET)
        tl.store(out_ptr + row * stride_out + start + lanes, out, mask=mask)
        if QUANTIZE:  # (hidden a multiple of 32: a group is all in the row or all past it)
            words, d, s = quantize_groups(tl.reshape(out.to(tl.float32), (BLOCK // 32, 32)), INTERPRET)
            groups = (start // 32 + tl.arange(0, BLOCK // 32))[None, :]  # [1, BLOCK / 32]
            g_ok = groups < hidden // 32
            store_groups(words, d, s, row * (hidden // 32) + groups, g_ok, words_ptr, d_ptr, s_ptr)


Int8 = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # matmul.quantize_int8's (words, d, s)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, quantized: list[Int8] | None = None) -> torch.Tensor:
    """RMSNorm of each row of x [M, H] (bfloat16, float16 or float32) with weight [H]:
    `y = (x32 * rsqrt(mean(x32 ** 2) + eps)).to(x.dtype); return weight * y`, x32 = x.float(), as
    layers/norm.py's RMSNorm, up to the order of the row's sum. The product with the weight is exact
    in float32 and rounded once, as PyTorch's. Returns [M, H] in x's dtype (promoted with weight's,
    as PyTorch would, where they differ). With `quantized` (H a multiple of 32), the result's
    `quantize_int8` is appended to it, made by the same kernel."""
    return _launch(x, None, weight, eps, quantized)[1]


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, quantized: list[Int8] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta, weight, eps)) for x, delta [M, H] of one dtype, in one kernel
    (a residual add and the norm after it): the bits of `s = x + delta; rms_norm(s, weight, eps)`;
    `quantized` as rms_norm's."""
    assert delta.shape == x.shape and delta.dtype == x.dtype, (x.shape, delta.shape, x.dtype, delta.dtype)
    return _launch(x, delta, weight, eps, quantized)


def _launch(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, quantized: list[Int8] | None
) -> tuple[torch.Tensor | None, torch.Tensor]:
    assert x.dim() == 2 and weight.shape == (x.shape[1],), (x.shape, weight.shape)
    x = x if x.stride(-1) == 1 else x.contiguous()
    if delta is not None and delta.stride(-1) != 1:
        delta = delta.contiguous()
    weight = weight.contiguous()
    rows, hidden = x.shape
    total = None if delta is None else torch.empty_like(x, memory_format=torch.contiguous_format)
    out = torch.empty(rows, hidden, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if quantized is not None:
        assert hidden % 32 == 0, hidden
        d = torch.empty(rows, hidden // 32, dtype=torch.float32, device=x.device)
        quantized.append((torch.empty(rows, hidden // 4, dtype=torch.int32, device=x.device), d, torch.empty_like(d)))
    words, d, s = quantized[-1] if quantized is not None else (out, out, out)  # (not written without QUANTIZE)
    if rows > 0:
        _rms_norm_kernel[(rows,)](
            x,
            x if delta is None else delta,  # not read without ADD
            weight,
            out if total is None else total,  # not written without ADD
            out,
            hidden,
            eps,
            x.stride(0),
            x.stride(0) if delta is None else delta.stride(0),
            out.stride(0),
            words,
            d,
            s,
            ADD=delta is not None,
            QUANTIZE=quantized is not None,
            BLOCK=BLOCK,
            INTERPRET=INTERPRET,
            num_warps=NUM_WARPS,
            **launch_options(x.device),
        )
    return total, out
