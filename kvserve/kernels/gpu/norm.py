"""RMSNorm, one program per row, or in the prologue of the matmul that takes its output (`NormedRows`).
Batch invariant: a row's sum never depends on the other rows, nor on the kernel that makes it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvserve.kernels.gpu import INTERPRET, launch_options
from kvserve.kernels.gpu.common import cast, quantize_groups, store_groups, tile_index, wait_for_prior


def row_width(hidden: int) -> int:
    """The elements a program holds of a row: `hidden` padded with zeros to a power of two."""
    return triton.next_power_of_2(hidden)


def num_warps_for(hidden: int) -> int:
    """The norm kernel's warps for a row of `hidden`: 4 up to 2,048, else 8 (16 values a thread up to 4,096,
    64 at 16,384, without spills for sm_90, where 16 warps' cap of 128 registers a thread spilled at 8,192).
    Any number gives the same bits, as the row's sum is a fixed tree (`sum_of_squares`), not the layout's."""
    return max(4, min(8, row_width(hidden) // 512))


@triton.jit
def _tree_sum(values):
    """values [R, W] (W a power of two) -> [R]: neighbours added in pairs, then those sums in pairs, and so
    on: one order of additions whatever the kernel and its layout (a whole row's tl.sum follows the
    layout). Each level sums an axis of two, one addition whichever comes first; tl.split per level
    instead compiled to 6,552 instructions and a spill with Triton 3.6 (the GPU machine's), 136 this way."""
    R: tl.constexpr = values.shape[0]
    W: tl.constexpr = values.shape[1]
    for level in tl.static_range(1, 32):
        if (W >> level) > 0:
            values = tl.sum(tl.reshape(values, (R, W >> level, 2)), axis=2)
    return tl.reshape(values, (R,))


@triton.jit
def sum_of_squares(s):
    """The sum of squares of each row of s [R, W] (float32, W a power of two, at least 2; zeros past the
    row's end) in `_tree_sum`'s order, each first pair as one fma (a * a + b * b, b * b rounded first):
    the contraction a compiler may make of it is made here, always the same."""
    R: tl.constexpr = s.shape[0]
    W: tl.constexpr = s.shape[1]
    a, b = tl.split(tl.reshape(s, (R, W // 2, 2)))
    return _tree_sum(tl.fma(a, a, b * b))


@triton.jit
def _summed_rows(
    x_ptr,
    delta_ptr,
    rows,
    stride_x,
    stride_d,
    hidden,
    ADD: tl.constexpr,
    WIDTH: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Rows [R] of x (ADD: of x + delta rounded to x's dtype) as float32 [R, WIDTH], zeros past `hidden`."""
    cols = tl.arange(0, WIDTH)
    mask = (cols < hidden)[None, :]
    s = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if ADD:
        d = tl.load(delta_ptr + rows.to(tl.int64)[:, None] * stride_d + cols[None, :], mask=mask, other=0.0)
        s = cast(s + d.to(tl.float32), x_ptr.dtype.element_ty, INTERPRET).to(tl.float32)
    return s


@triton.jit
def _reciprocal_rms(s, hidden, eps):
    """1 / sqrt(mean(s ** 2) + eps) of each row of s [R, W] (`sum_of_squares`), each step rounded as IEEE
    says: `/` would be an approximate division, whose reciprocal and product ptxas may fuse with the
    `+ eps` in one kernel and not in another."""
    mean = tl.math.div_rn(sum_of_squares(s), hidden * 1.0)
    return tl.math.div_rn(1.0 + tl.zeros_like(mean), tl.sqrt_rn(mean + eps))


@triton.jit
def _normalized(s, rstd, g, dtype: tl.constexpr, out_dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """g * (s * rstd rounded to `dtype`, x's), rounded once to `out_dtype`: s [R, C] float32, rstd [R], g [C]
    float32 (the norm's weight). The product with the weight is exact in float32, as PyTorch's."""
    y = cast(s * rstd[:, None], dtype, INTERPRET).to(tl.float32)
    return cast(g[None, :] * y, out_dtype, INTERPRET)


@triton.jit
def normed_rows_rstd(
    x_ptr,
    stride_x,
    row0,
    M,
    norm,
    BLOCK_M: tl.constexpr,
    WIDTH: tl.constexpr,
    ADD: tl.constexpr,
    INTERPRET: tl.constexpr,
    tile_n=None,
    split=None,
):
    """A matmul's prologue for `NormedRows` inputs: 1 / rms of each row of its tile (rows row0 ..
    row0 + BLOCK_M, those below M), each row summed as the norm kernel sums it, so the same bits; the
    tile's first along N and K (`tile_n` and `split` where given, else this program's) also stores x + delta
    (ADD) in `total`. `norm`: `NormedRows.args`. Each program reads its rows whole (2 x 4 KB a row of 2,048
    in bfloat16, from L2), so the layers hand it at most NORM_IN_MATMUL_ROWS rows (any number gives the same
    bits)."""
    delta_ptr, stride_d, _, total_ptr, hidden, eps = norm
    lanes = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, WIDTH)
    stores = (cols < hidden) & (tl.zeros((WIDTH,), tl.int32) + tile_index(tile_n, 1) + tile_index(split, 2) == 0)
    rstd = tl.zeros((BLOCK_M,), tl.float32)
    for r in range(0, tl.minimum(BLOCK_M, M - row0)):
        row = row0 + r + tl.zeros((1,), tl.int32)
        s = _summed_rows(x_ptr, delta_ptr, row, stride_x, stride_d, hidden, ADD, WIDTH, INTERPRET)
        if ADD:
            at = total_ptr + row.to(tl.int64)[:, None] * hidden + cols[None, :]
            tl.store(at, s, mask=stores[None, :])
        rstd = tl.where(lanes == r, _reciprocal_rms(s, hidden, eps), rstd)
    return rstd


@triton.jit
def norm_weight(norm, ks, NORM: tl.constexpr):
    """The norm's weight at ks [BK] in float32, 0 past its width, for `normed_inputs` (zeros without NORM,
    where `norm` is empty). A 2-byte load a thread, which Triton's pipeliner leaves in its step: the float
    and Q8_0 kernels load the next step's before this step's dots, hiding its latency behind them."""
    if NORM:
        _, _, weight_ptr, _, hidden, _ = norm
        g = tl.load(weight_ptr + ks, mask=ks < hidden, other=0.0).to(tl.float32)
    else:
        g = tl.zeros(ks.shape, tl.float32)
    return g


@triton.jit
def normed_inputs(x, rows, ks, mask, rstd, norm, g, ADD: tl.constexpr, INTERPRET: tl.constexpr):
    """A matmul's inputs [BM, BK] at rows [BM] and ks [BK] for `NormedRows`: x as loaded (mask: where
    it was) made the norm's output there, `rstd` from `normed_rows_rstd` and g the norm's weight at ks
    (`norm_weight`): the norm kernel's arithmetic."""
    delta_ptr, stride_d, _, _, _, _ = norm
    s = x.to(tl.float32)
    if ADD:
        d = tl.load(delta_ptr + rows.to(tl.int64)[:, None] * stride_d + ks[None, :], mask=mask, other=0.0)
        s = cast(s + d.to(tl.float32), x.dtype, INTERPRET).to(tl.float32)
    return _normalized(s, rstd, g, x.dtype, x.dtype, INTERPRET)


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
    WIDTH: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """RMSNorm of a row of x, or (ADD) of x + delta rounded to x's dtype, that sum also stored; with
    QUANTIZE the output as stored also quantized per group of 32 (`quantize_groups`: the int4 x int8
    matmul's inputs, `matmul.quantize_int8`'s bits, without its own launch). The whole row at once
    (WIDTH: `row_width`), its sum `sum_of_squares`', as a matmul's prologue sums it (`normed_inputs`)."""
    wait_for_prior(PDL)
    row = tl.program_id(0) + tl.zeros((1,), tl.int32)
    cols = tl.arange(0, WIDTH)
    mask = cols < hidden
    s = _summed_rows(x_ptr, delta_ptr, row, stride_x, stride_d, hidden, ADD, WIDTH, INTERPRET)  # [1, W]
    if ADD:
        tl.store(sum_ptr + row.to(tl.int64)[:, None] * hidden + cols[None, :], s, mask=mask[None, :])
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = _normalized(
        s, _reciprocal_rms(s, hidden, eps), w, x_ptr.dtype.element_ty, out_ptr.dtype.element_ty, INTERPRET
    )
    out = tl.reshape(out, (WIDTH,))
    tl.store(out_ptr + tl.program_id(0).to(tl.int64) * stride_out + cols, out, mask=mask)
    if QUANTIZE:  # (hidden a multiple of 32: a group is all in the row or all past it)
        words, group_d, group_s = quantize_groups(tl.reshape(out.to(tl.float32), (WIDTH // 32, 32)), INTERPRET)
        groups = tl.arange(0, WIDTH // 32)[None, :]  # [1, WIDTH / 32]
        at = tl.program_id(0).to(tl.int64) * (hidden // 32) + groups
        store_groups(words, group_d, group_s, at, groups < hidden // 32, words_ptr, d_ptr, s_ptr)


Int8 = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # matmul.quantize_int8's (words, d, s)

# Rows handed to a matmul as `NormedRows` at most (layers/gpu.GpuRMSNorm): each of its programs reads
# them whole from L2 (a 1B 4-bit gate/up's 512 programs 4 MB a row, against its 18.9 MB of weights), so
# one stream's rows; more take the norm's own kernel, the same bits.
NORM_IN_MATMUL_ROWS = 2


@dataclass(frozen=True)
class NormedRows:
    """`rms_norm(x, weight, eps)`, or with delta `add_rms_norm(x, delta, weight, eps)`, not yet made: the
    float-input matmuls (matmul.matmul, int4_matmul, int8_group_matmul) take it as x and normalize
    each row in their prologue and K loop with the norm kernel's arithmetic (the same bits), one launch
    fewer; they store x + delta in `total` (add_rms_norm's first result) on the way. `made()` runs the
    norm's kernel instead, for anything else."""

    x: torch.Tensor  # [M, H], row major
    delta: torch.Tensor | None  # [M, H] of x's dtype, row major
    weight: torch.Tensor  # [H] of x's dtype
    eps: float
    total: torch.Tensor | None  # [M, H], contiguous, where there is a delta

    @property
    def shape(self) -> torch.Size:
        return self.x.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.x.dtype

    def made(self) -> torch.Tensor:
        """The norm's output [M, H], by its own kernel (x + delta stored in `total` as the matmul would)."""
        return _launch(self.x, self.delta, self.weight, self.eps, None, self.total)[1]

    def args(self) -> tuple:
        """The kernels' `norm` tuple (`normed_rows_rstd`, `normed_inputs`)."""
        delta = self.x if self.delta is None else self.delta  # (not read without a delta)
        total = self.x if self.total is None else self.total  # (not written without one)
        return (delta, delta.stride(0), self.weight, total, self.x.shape[1], self.eps)


def normed_rows(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor | None, NormedRows]:
    """(x + delta, to be written by the matmul, or None without delta; the `NormedRows` to hand it) for
    x, delta [M, H] (M at most NORM_IN_MATMUL_ROWS, weight of x's dtype)."""
    assert x.dim() == 2 and weight.shape == (x.shape[1],) and weight.dtype == x.dtype, (x.shape, weight.dtype)
    x = x if x.stride(-1) == 1 else x.contiguous()
    if delta is not None:
        assert delta.shape == x.shape and delta.dtype == x.dtype, (x.shape, delta.shape, delta.dtype)
        delta = delta if delta.stride(-1) == 1 else delta.contiguous()
    total = None if delta is None else torch.empty_like(x, memory_format=torch.contiguous_format)
    return total, NormedRows(x, delta, weight.contiguous(), eps, total)


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
    x: torch.Tensor,
    delta: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    quantized: list[Int8] | None,
    total: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    assert x.dim() == 2 and weight.shape == (x.shape[1],), (x.shape, weight.shape)
    x = x if x.stride(-1) == 1 else x.contiguous()
    if delta is not None and delta.stride(-1) != 1:
        delta = delta.contiguous()
    weight = weight.contiguous()
    rows, hidden = x.shape
    if delta is not None and total is None:
        total = torch.empty_like(x, memory_format=torch.contiguous_format)
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
            WIDTH=row_width(hidden),
            INTERPRET=INTERPRET,
            num_warps=num_warps_for(hidden),
            **launch_options(x.device),
        )
    return total, out
