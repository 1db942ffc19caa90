"""Matmuls y = x @ W.T (+ bias) over float, int4 and int8 weights, batch invariant.

Each kernel has one tile configuration (`TileConfig`) for every number of rows M: a row's output is
the same bits whether it is computed alone or among thousands (R7). A config is tuned as a whole,
never per M. The weight axis K may be split into fixed ranges of `k_per_split` (a property of the
layer, the same for every M) whose float32 partial sums are then added in split order; that gives a
decode step (few rows, memory-bound) more programs to read the weight with.

The int4 x int8 kernels are the exception that keeps the rule's purpose: their group sums are exact
integers and each row's float steps its own, so `int4_int8_matmul` picks its kernel and row tile by M
and a row's bits do not change.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvserve.kernels.gpu import (
    INTERPRET,
    cdiv,
    compiled_capability,
    launch_options,
    next_power_of_2,
    prefetch_lines,
)
from kvserve.kernels.gpu.common import (
    cast,
    dot,
    gated_product,
    group_dot,
    int8_group_dot,
    nibble_fma_bf16,
    nibble_to_float,
    prefetch_rows,
    quantize_groups,
    rope_values,
    split4,
    store_groups,
    tile_count,
    tile_index,
    wait_for_prior,
)
from kvserve.kernels.gpu.norm import NormedRows, norm_weight, normed_inputs, normed_rows_rstd, row_width
from kvserve.kernels.gpu.timeline import DONE, ENTRY, LOOPED, WAITED, active_timeline, stamp, stamp_after

GROUP_SIZE = 32  # inputs per scale (and min) of the quantized weights


@dataclass(frozen=True)
class TileConfig:
    """One kernel's launch configuration, fixed for every M (batch invariance)."""

    block_m: int  # rows of x per program
    block_n: int  # output columns (weight rows) per program
    block_k: int  # inputs per step of the K loop
    k_per_split: int  # inputs per program along K (a multiple of block_k); 0: the whole of K
    num_warps: int
    num_stages: int  # software-pipelining depth of the K loop


# Float weights: 64 x 64 tiles on the tensor cores, K in splits of 2048 (a 2048 x 8192 down projection
# gets 4 x 32 programs for one row instead of 32). On an H200 (bench/gpu_kernels.py, results/
# gpu_kernels.json), the 1B shapes' matmuls of a step, summed from the per-layer figures, against the
# first 64 x 64 x 64 tiles without splits: 1.77 -> 0.81 ms for one row (cuBLAS 0.77), 1.83 -> 0.86 ms
# for 64, 5.8 -> 7.4 ms for 1024 rows of prefill (cuBLAS 3.0).
FLOAT_CONFIG = TileConfig(block_m=64, block_n=64, block_k=128, k_per_split=2048, num_warps=4, num_stages=3)

# Quantized weights, tuned for decode (M = 1..64, memory-bound): 16 rows is the smallest tl.dot tile,
# 64-column tiles times K splits of 1024 give a 4096 x 4096 layer 256 programs for M = 1, and a tile
# step reads 64 weight rows x 128 inputs (4 KiB of int4 codes).
INT4_CONFIG = TileConfig(block_m=16, block_n=64, block_k=128, k_per_split=1024, num_warps=4, num_stages=3)
# A program of the int4 and int8 (Q8_0) kernels with float inputs takes up to this many tiles of BLOCK_M
# rows (1, 2 or 4; `row_tiles_for`) and dequantizes each weight tile once for all of them. Each row
# tile's sums are its own dots, the same instructions in the same order as in a program of one tile, so
# the same bits for every row count (R7). On the H200 at aead1aa a 1B gate/up projection took 57 us for
# 64 rows in 4-bit, a program a tile, against bfloat16's 19.6; for sm_90 (bench/gpu_sass.py) the
# packed-bfloat16 loop takes 0.295 instructions per weight and row in a program of one tile, 0.191 of
# two and 0.146 of four.
MAX_ROW_TILES = 4
# ... while the call keeps at least this many programs (about two a multiprocessor of an H100 or H200)
ROW_TILE_PROGRAMS = 256


def row_tiles_for(m: int, n: int, k: int, config: TileConfig) -> int:
    """Row tiles a program of the int4 or int8 kernel takes for `m` rows of a layer of `n` outputs and `k` inputs:
    the most, up to MAX_ROW_TILES, that leave the call ROW_TILE_PROGRAMS programs (33 to 48 rows: 4, the
    last tile's dots on masked rows, as a tile's count is a power of two)."""
    assert MAX_ROW_TILES in (1, 2, 4), MAX_ROW_TILES
    tiles, columns = cdiv(m, config.block_m), cdiv(n, config.block_n)
    splits = cdiv(k, config.k_per_split or k)
    row_tiles = 1
    while row_tiles < min(MAX_ROW_TILES, tiles):
        if cdiv(tiles, 2 * row_tiles) * columns * splits < ROW_TILE_PROGRAMS:
            break
        row_tiles *= 2
    return row_tiles


def _row_tiles(x: torch.Tensor | NormedRows, n: int, config: TileConfig) -> dict:
    """The int4 or int8 kernel's ROW_TILES switch for a call on x [M, K] (none for one tile): `row_tiles_for`
    for 16-bit inputs, whose dots are the tensor cores' (float32 inputs take FMA dots, whose registers
    spill more with every tile), one tile for `NormedRows` (their prologue normalizes one tile's rows)."""
    if isinstance(x, NormedRows) or x.dtype not in (torch.bfloat16, torch.float16):
        return {}
    row_tiles = row_tiles_for(x.shape[0], n, x.shape[1], config)
    return {"ROW_TILES": row_tiles} if row_tiles > 1 else {}


# int8 codes are twice the bytes of int4: the same tiles, each step reading 8 KiB of codes.
INT8_CONFIG = TileConfig(block_m=16, block_n=64, block_k=128, k_per_split=1024, num_warps=4, num_stages=3)

# int4 weights times int8 inputs (dp4a, no tensor cores; four groups a step, so block_k is 128): block_m
# is at most this, and otherwise follows M (int4_int8_matmul), as each row's sums are exact and its float
# steps its own. One output column per thread: the K loop for sm_90 (offline ptxas, bench/gpu_sass.py)
# takes 1.05 instructions per weight for one row (64 columns: 3.5, two threads a column), where a
# weight read from memory at an H200's 4.8 TB/s leaves about 4 instructions per weight; short K splits
# give a one-row decode enough programs to keep the loads in flight.
INT4_INT8_CONFIG = TileConfig(block_m=8, block_n=128, block_k=128, k_per_split=512, num_warps=4, num_stages=3)
# From this many rows the groups' integer sums run on the tensor cores, in tiles that follow M (the K
# splits stay the layer's). Per weight (and per weight and row), the sm_90 loops by offline ptxas:
# dp4a 1.05 for one row, 0.87 per row for 8, 0.77 for 16; int8 dots in tiles of 16 x 128 on 4 warps
# 7.98 for 16 rows (mma.sync), 32 x 128 on 8 warps 12.67 for 32, 64 x 128 on 8 warps (wgmma) 0.345 per
# row; 64 x 64 on 4 warps spilled. Every kernel pays four float operations per group, row and output
# (a conversion, the scale's product, two FMAs): 0.125 per weight and row.
INT4_INT8_MMA_ROWS = 9
# Below INT4_INT8_MMA_ROWS rows, an int4 layer's K splits in one program (`_int4_int8_splits_kernel`, this
# many (split, output) pairs a program; 0: each split a program of its own, `_int4_int8_kernel`), added in
# order in registers instead of through partial sums in memory and the last split's second pass: the
# same bits. On the H200 (bench/gpu_kernels.py, results/gpu_kernels_candidates.json, one row) every 4-bit
# 1B layer took less time: qkv 7.24 -> 6.97 us, o 6.84 -> 6.12, gate_up 15.21 -> 14.65, down 11.92 ->
# 11.47, a 4-bit lm_head 54.4 -> 47.8; the Q8_0 lm_head (int8 codes) 62.2 -> 67.5, so int8 codes keep a
# program a split. With 256 pairs a program, or group-major codes, the decoder layers were slower (the
# 4-bit lm_head faster: 22.5 us group major). A power of two; layers of more splits keep a program a split.
SPLITS_IN_PROGRAM = 128
# A candidate for up to 8 rows of an int4 or int8 (Q8_0) layer with int8 inputs, off (0) until a GPU measures it
# (bench/gpu_kernels.py's `int4-int8-words`, bench/gpu.py's `q4-int8-words`): `_int4_int8_words_kernel`,
# the bits of the kernels before it with a program's code words spread over its threads as memory holds
# them (consecutive words on consecutive threads: 128-byte reads of one row, where a thread an output
# reads 16 bytes of each of 32 rows), about this many words (times rows) a program of 4 warps; for
# layers of 4, 8 or 16 groups a K split and at most WORDS_GROUPS groups a row. A power of two.
WORDS_IN_THREADS = 0
# The words kernel's groups a row (K / 32, its splits padded to a power of two) at most: for one row, 16
# splits of 8 groups or more compiled for sm_90 to 32 registers and 2.2-9 KB of stack a thread (Triton 3.6
# and 3.9; a 1B down projection's 32 x 8: 4.3 KB), where 64 (q/k/v and o, 8 x 8; gate/up, 4 x 16) take
# 184-254 registers and no stack; such layers keep the splits kernel.
WORDS_GROUPS = 64
# The int4 kernel's scales and mins of a K step loaded with its codes, steps ahead (`_int4_kernel`'s
# ALIGNED_GROUPS); False (bench/gpu.py's `q4-waited`, gpu_timeline.py's `int4-bf16x2-waited`): 2-byte loads
# in the step, waited on there, the kernel before 2026-12-05 (docs/performance.md): the same bits.
ALIGNED_GROUPS = True
INT4_INT8_MMA_TILES = (  # (up to this many rows, tile changes)
    (16, {"block_m": 16, "block_n": 128, "num_warps": 4}),
    (32, {"block_m": 32, "block_n": 128, "num_warps": 8}),
    (None, {"block_m": 64, "block_n": 128, "num_warps": 8}),
)
# Blackwell's datacenter GPUs (compute capability 10.x and 11.x): for sm_100 (B200) Triton 3.9 makes the
# 64-row tile's int8 dot a tcgen05 MMA with its inputs in tensor memory and compiles the kernel to a bare
# `trap` (3.6 did not; sm_103 and sm_110 still get mma.sync, but take no chance on a later Triton); the
# 32-row tile is mma.sync on every GPU, and takes any number of rows there (the same bits: exact sums)
INT4_INT8_MMA_TILES_BLACKWELL = (
    (16, {"block_m": 16, "block_n": 128, "num_warps": 4}),
    (None, {"block_m": 32, "block_n": 128, "num_warps": 8}),
)


def int4_int8_mma_tiles(device: torch.device) -> tuple:
    """The tensor-core int4 x int8 kernel's tiles on `device`: INT4_INT8_MMA_TILES_BLACKWELL on compute
    capability 10.x and 11.x, else INT4_INT8_MMA_TILES."""
    capability = compiled_capability(device)
    return INT4_INT8_MMA_TILES_BLACKWELL if capability is not None and 100 <= capability < 120 else INT4_INT8_MMA_TILES


# A layer of at most this many outputs (a 1B model's attention projections and down projection) has
# too few column tiles to keep 132 multiprocessors reading for one row: its quantized K splits are half
# as long, and where K makes one float split, its float tiles are half as wide. H200, one row: 2048 ->
# 3072 float 10.5 -> 7.6 us, int4 11.9 -> 9.6 us; 8192 -> 2048 int4 15.9 -> 15.3 us.
NARROW_N = 4096


@functools.cache  # asked at every launch of an eager step: 2.4 us a call to rebuild, 0.1 cached
def config_for(base: TileConfig, n: int, k: int) -> TileConfig:
    """The configuration of a layer of `n` outputs and `k` inputs: a property of the layer, the same
    for every number of rows (R7)."""
    if n > NARROW_N:
        return base
    if base.block_m >= 64:  # the float kernel's tensor-core tiles
        if base.k_per_split and k > base.k_per_split:  # its K splits already give it the programs
            return base
        return dataclasses.replace(base, block_n=base.block_n // 2, num_stages=base.num_stages + 1)
    return dataclasses.replace(base, k_per_split=max(base.block_k, base.k_per_split // 2))


SUM_BLOCK = 1024  # outputs per program of the kernel that adds the K splits' partial sums

# Tiles a layer's call may have for its last split to add the partial sums itself (`_finish_tile`'s
# SUM_IN_TILE), one int32 counter each (a tile: a program's rows, ROW_TILES x BLOCK_M in the quantized
# kernels, by its columns): a 16384-output int4 layer in 64-column tiles up to 256 program rows (1,024
# rows in programs of 4 row tiles). A decode step saves `_sum_splits_kernel`'s launches: on the 1B shapes
# 16 a step in bfloat16 (the down projections), 64 in 4-bit (every projection); a longer prefill, for
# which a launch is nothing, takes it.
SPLIT_COUNTERS = 4096


def split_counters(device: torch.device | str) -> torch.Tensor:
    """A layer's tile counters for its K splits' sums (`_launch`'s `counters`), all 0 between calls.
    Each layer owns its own: calls on one stream are ordered, and one layer is not run on two at once."""
    return torch.zeros(SPLIT_COUNTERS, dtype=torch.int32, device=device)


@triton.jit
def _store_output(
    acc,
    out_ptr,
    bias_ptr,
    offsets,
    rows,
    cols,
    mask,
    M,
    N,
    stride_om,
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,
    INTERPRET: tl.constexpr,
    rope=(),
    ROPE: tl.constexpr = 0,
    CACHE_BLOCK: tl.constexpr = 0,
):
    """out = acc (+ bias, added in float32), rounded once to the output's dtype. GATED (1 SiLU, 2
    tanh-GELU; the weight's rows interleaved, gate j at 2j and up j at 2j + 1): those outputs rounded so
    are a pair (gate, up), and out [M, N / 2] gets act(gate) * up (`common.gated_product`, the gated
    activation kernel's bits) at j instead. ROPE (the head dim of a q/k/v projection whose q and k rows
    pair each dimension with the one half a head away): `_store_rope`."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if ROPE:
        y = cast(acc, out_ptr.dtype.element_ty, INTERPRET).to(tl.float32)
        _store_rope(y, rows, cols, M, N, out_ptr, rope, ROPE, CACHE_BLOCK, INTERPRET)
    elif GATED:
        BLOCK_M: tl.constexpr = acc.shape[0]
        HALF: tl.constexpr = acc.shape[1] // 2
        pairs = tl.reshape(cast(acc, out_ptr.dtype.element_ty, INTERPRET).to(tl.float32), (BLOCK_M, HALF, 2))
        gate, up = tl.split(pairs)
        out_cols, _ = tl.split(tl.reshape(cols, (HALF, 2)))  # each pair's gate column, 2j
        out_cols = out_cols // 2
        out = gated_product(gate, up, GATED == 2, out_ptr.dtype.element_ty, INTERPRET)
        offsets = rows.to(tl.int64)[:, None] * (stride_om // 2) + out_cols[None, :]
        tl.store(out_ptr + offsets, out, mask=(rows < M)[:, None] & (out_cols < N // 2)[None, :])
    else:
        tl.store(out_ptr + offsets, cast(acc, out_ptr.dtype.element_ty, INTERPRET), mask=mask)


@triton.jit
def _store_rope(
    y, rows, cols, M, N, q_ptr, rope, HEAD_DIM: tl.constexpr, CACHE_BLOCK: tl.constexpr, INTERPRET: tl.constexpr
):
    """A q/k/v projection's outputs y [BLOCK_M, BLOCK_N] (float32, each as stored in q's dtype) with q's
    and k's dimensions in pairs (d, d + HEAD_DIM / 2) (`interleave_rope`), v's as they are: q and k rotated
    (`common.rope_values` at each row's position: `elementwise.rotate_and_store`'s bits), q stored into
    q_ptr [M, H * HEAD_DIM], k and v into the caches at each row's slot (none for a negative slot, as
    `attention.store_kv`). `rope`: `_rope_args`."""
    (cos_ptr, sin_ptr, k_cache, v_cache, slots, stride_ct, stride_st, stride_kcb, stride_kcs, stride_kch,
     stride_vcb, stride_vcs, stride_vch, num_heads, num_kv_heads) = rope  # fmt: skip
    BLOCK_M: tl.constexpr = y.shape[0]
    HALF: tl.constexpr = y.shape[1] // 2
    x1, x2 = tl.split(tl.reshape(y, (BLOCK_M, HALF, 2)))
    first, _ = tl.split(tl.reshape(cols, (HALF, 2)))  # each pair's first column
    head = first // HEAD_DIM  # of q's heads, then k's, then v's
    local = first % HEAD_DIM
    rotated = head < num_heads + num_kv_heads  # q and k: the pair (i, i + HEAD_DIM / 2); v: (d, d + 1)
    d1 = tl.where(rotated, local // 2, local)[None, :]
    d2 = tl.where(rotated, local // 2 + HEAD_DIM // 2, local + 1)[None, :]
    token = rows.to(tl.int64)[:, None]
    row_ok = (rows < M)[:, None]
    rot_mask = row_ok & (rotated & (first < N))[None, :]
    # (from L2, ".cg", as everything a tile's last K split reads after its count)
    cos1 = tl.load(cos_ptr + token * stride_ct + d1, mask=rot_mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    sin1 = tl.load(sin_ptr + token * stride_st + d1, mask=rot_mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    cos2 = tl.load(cos_ptr + token * stride_ct + d2, mask=rot_mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    sin2 = tl.load(sin_ptr + token * stride_st + d2, mask=rot_mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    r1 = rope_values(x1, x2, cos1, sin1, q_ptr.dtype.element_ty, INTERPRET)  # x2: x1's value half a head away
    r2 = rope_values(x2, x1, cos2, sin2, q_ptr.dtype.element_ty, INTERPRET)
    is_q = row_ok & (head < num_heads)[None, :]
    q_row = q_ptr + token * (num_heads * HEAD_DIM) + (head * HEAD_DIM)[None, :]
    tl.store(q_row + d1, r1, mask=is_q)
    tl.store(q_row + d2, r2, mask=is_q)
    slot = tl.load(slots + token, mask=row_ok, other=-1, cache_modifier=".cg").to(tl.int64)  # [BLOCK_M, 1]
    block, offset = slot // CACHE_BLOCK, slot % CACHE_BLOCK
    cached = row_ok & (slot >= 0)
    is_k = cached & ((head >= num_heads) & rotated)[None, :]
    is_v = cached & ((~rotated) & (first < N))[None, :]
    kv_head = tl.maximum(tl.where(rotated, head - num_heads, head - num_heads - num_kv_heads), 0)[None, :]
    k_row = k_cache + block * stride_kcb + offset * stride_kcs + kv_head * stride_kch
    tl.store(k_row + d1, cast(r1.to(tl.float32), k_cache.dtype.element_ty, INTERPRET), mask=is_k)
    tl.store(k_row + d2, cast(r2.to(tl.float32), k_cache.dtype.element_ty, INTERPRET), mask=is_k)
    v_row = v_cache + block * stride_vcb + offset * stride_vcs + kv_head * stride_vch
    tl.store(v_row + d1, cast(x1, v_cache.dtype.element_ty, INTERPRET), mask=is_v)
    tl.store(v_row + d2, cast(x2, v_cache.dtype.element_ty, INTERPRET), mask=is_v)


@triton.jit
def _finish_tile(
    acc,
    out_ptr,
    partial_ptr,
    counters_ptr,
    bias_ptr,
    rows,
    cols,
    M,
    N,
    stride_om,
    stride_os,
    HAS_BIAS: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    SUM_IN_TILE: tl.constexpr,
    INTERPRET: tl.constexpr,
    GATED: tl.constexpr = 0,
    rope=(),
    ROPE: tl.constexpr = 0,
    CACHE_BLOCK: tl.constexpr = 0,
    tile_m=None,
    tile_n=None,
    split=None,
    tiles_n=None,
    splits=None,
):
    """Store a tile's float32 sums: as the output (+ bias; GATED and ROPE, `_store_output`'s), or as this K
    split's partial sums (workspace [splits, M, N]). With SUM_IN_TILE the tile's last split to finish,
    counted on the tile's counter (a tile's rows by its columns), adds every split's partial sums in
    split order and stores the output: `_sum_splits_kernel`'s additions in its order, so its bits, without
    its launch; it leaves the counter at 0 for the next call. The tile (tile_m, tile_n), K split `split`
    of `splits`, `tiles_n` tiles across N: where None, this program's (`common.tile_index`)."""
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    offsets = rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    if IS_SPLIT:
        partial = partial_ptr + offsets
        tl.store(partial + tile_index(split, 2).to(tl.int64) * stride_os, acc, mask=mask)
        if SUM_IN_TILE:
            tl.debug_barrier()  # every thread's partial sums stored before the count (released with it)
            counter = counters_ptr + tile_index(tile_m, 0) * tile_count(tiles_n, 1) + tile_index(tile_n, 1)
            if tl.atomic_add(counter, 1, sem="acq_rel") == tile_count(splits, 2) - 1:
                # from L2 (".cg"): the other splits' sums were stored by other multiprocessors
                acc = tl.load(partial, mask=mask, other=0.0, cache_modifier=".cg")
                for _ in range(1, tile_count(splits, 2)):
                    partial += stride_os
                    acc += tl.load(partial, mask=mask, other=0.0, cache_modifier=".cg")
                tl.store(counter, 0)
                _store_output(
                    acc, out_ptr, bias_ptr, offsets, rows, cols, mask, M, N, stride_om,
                    HAS_BIAS, GATED, INTERPRET, rope, ROPE, CACHE_BLOCK,
                )  # fmt: skip
    else:
        _store_output(
            acc, out_ptr, bias_ptr, offsets, rows, cols, mask, M, N, stride_om,
            HAS_BIAS, GATED, INTERPRET, rope, ROPE, CACHE_BLOCK,
        )  # fmt: skip


@triton.jit
def _below(ks, k_end, EVEN_K: tl.constexpr):
    """ks < k_end, known true at compile time where K is a multiple of BLOCK_K, so loads along K
    vectorize."""
    if EVEN_K:
        return tl.full(ks.shape, True, tl.int1)
    else:
        return ks < k_end


@triton.jit(do_not_specialize=["numel"])
def _sum_splits_kernel(
    partial_ptr,
    bias_ptr,
    out_ptr,
    numel,
    N,
    num_splits,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr = False,
    GATED: tl.constexpr = 0,
):
    """out = ((partial[0] + partial[1]) + ...) + bias, elementwise over the [M, N] outputs; GATED, each
    pair of them (N even) then gives act(gate) * up into out [M, N / 2], as `_store_output`."""
    wait_for_prior(PDL)
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    partial = partial_ptr + offsets
    total = tl.load(partial, mask=mask, other=0.0)
    for _ in range(1, num_splits):
        partial += numel  # the next split's [M, N]
        total += tl.load(partial, mask=mask, other=0.0)
    if HAS_BIAS:
        total += tl.load(bias_ptr + offsets % N, mask=mask, other=0.0).to(tl.float32)
    if GATED:  # [M, N] row-major with N even: a pair is two neighbours, gate first
        pairs = tl.reshape(cast(total, out_ptr.dtype.element_ty, INTERPRET).to(tl.float32), (BLOCK // 2, 2))
        gate, up = tl.split(pairs)
        at, _ = tl.split(tl.reshape(offsets, (BLOCK // 2, 2)))
        out = gated_product(gate, up, GATED == 2, out_ptr.dtype.element_ty, INTERPRET)
        tl.store(out_ptr + at // 2, out, mask=at < numel)
    else:
        tl.store(out_ptr + offsets, cast(total, out_ptr.dtype.element_ty, INTERPRET), mask=mask)


@triton.jit(do_not_specialize=["M"])  # one binary for every number of rows
def _float_kernel(
    x_ptr,
    out_ptr,
    partial_ptr,
    counters_ptr,
    bias_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    stride_os,
    k_per_split,
    w_ptr,
    stride_wn,
    HAS_BIAS: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    SUM_IN_TILE: tl.constexpr,
    EVEN_K: tl.constexpr,
    INTERPRET: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
    PREFETCH_LINES: tl.constexpr = 0,  # of each weight row's split, into L2 before the wait (prefetch_lines)
    GATED: tl.constexpr = 0,  # 1 SiLU, 2 tanh-GELU: act(gate) * up of interleaved rows (_store_output)
    rope=(),  # with ROPE (a q/k/v projection's head dim): `_rope_args`, for `_store_rope`
    ROPE: tl.constexpr = 0,
    CACHE_BLOCK: tl.constexpr = 0,
    norm=(),  # with NORM (`row_width` of K): x is `NormedRows`' x, normalized here (`NormedRows.args`)
    NORM: tl.constexpr = 0,
    NORM_ADD: tl.constexpr = False,  # NormedRows with a delta
    timeline=None,  # a `timeline.Timeline`'s slice while it records (kernels/gpu/timeline.py)
):
    stamp(timeline, ENTRY, INTERPRET)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_begin = tl.program_id(2) * k_per_split
    k_end = tl.minimum(K, k_begin + k_per_split)
    prefetch_rows(w_ptr, cols, N, stride_wn, k_begin, k_end - k_begin, PREFETCH_LINES)
    wait_for_prior(PDL)
    stamp(timeline, WAITED, INTERPRET)
    if NORM:  # each row's 1 / rms, as the norm kernel sums it
        rstd = normed_rows_rstd(
            x_ptr, stride_xm, tl.program_id(0) * BLOCK_M, M, norm, BLOCK_M, NORM, NORM_ADD, INTERPRET
        )
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + cols.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    gamma_next = norm_weight(norm, k_begin + tl.arange(0, BLOCK_K), NORM)  # (zeros without NORM)
    for k0 in range(k_begin, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x_mask = (rows < M)[:, None] & _below(ks, k_end, EVEN_K)[None, :]
        x = tl.load(x_rows + ks[None, :], mask=x_mask, other=0.0)
        if NORM:  # the norm's weight for this step, loaded in the step before, and the next step's
            gamma = gamma_next
            gamma_next = norm_weight(norm, ks + BLOCK_K, NORM)
            x = normed_inputs(x, rows, ks, x_mask, rstd, norm, gamma, NORM_ADD, INTERPRET)
        w = tl.load(
            w_cols + ks[:, None], mask=_below(ks, k_end, EVEN_K)[:, None] & (cols < N)[None, :], other=0.0
        )  # [BK, BN]
        if w.dtype != x.dtype:  # a weight of another float dtype: rounded to x's
            w = cast(w.to(tl.float32), x.dtype, INTERPRET)
        acc = dot(x, w, acc, INTERPRET)
    stamp_after(timeline, LOOPED, acc, INTERPRET)
    _finish_tile(
        acc,
        out_ptr,
        partial_ptr,
        counters_ptr,
        bias_ptr,
        rows,
        cols,
        M,
        N,
        stride_om,
        stride_os,
        HAS_BIAS,
        IS_SPLIT,
        SUM_IN_TILE,
        INTERPRET,
        GATED,
        rope,
        ROPE,
        CACHE_BLOCK,
    )
    stamp(timeline, DONE, INTERPRET)


@triton.jit
def _repeat_rows(values, TIMES: tl.constexpr):
    """values [R, C] -> [R * TIMES, C], each row repeated TIMES times (a group's scale for each of
    its inputs, without loading it once per input)."""
    num_rows: tl.constexpr = values.shape[0]
    num_cols: tl.constexpr = values.shape[1]
    repeated = tl.broadcast_to(values[:, None, :], (num_rows, TIMES, num_cols))
    return tl.reshape(repeated, (num_rows * TIMES, num_cols))


@triton.jit
def _rows_dot(x_ptr, rows, stride_xm, ks, k_ok, M, w, acc, rstd, norm, gamma, NORM_ADD, NORM: tl.constexpr, INTERPRET):
    """acc + x[rows, ks] @ w: a row tile's inputs loaded (for `NormedRows`, NORM: made the norm's output
    with `rstd` and its weight gamma at ks) and its dot with a weight tile w [BK, BN]."""
    mask = (rows < M)[:, None] & k_ok[None, :]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xm + ks[None, :], mask=mask, other=0.0)
    if NORM:
        x = normed_inputs(x, rows, ks, mask, rstd, norm, gamma, NORM_ADD, INTERPRET)
    return dot(x, w, acc, INTERPRET)


@triton.jit
def _tiles_dots(
    x_ptr,
    rows,
    stride_xm,
    ks,
    k_ok,
    M,
    w,
    acc0,
    acc1,
    acc2,
    acc3,
    rstd,
    norm,
    gamma,
    NORM_ADD,
    NORM: tl.constexpr,
    ROW_TILES: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """The first ROW_TILES row tiles' sums (acc0 .. acc3 [BM, BN], the first tile at rows [BM]) plus their
    inputs times the same weight tile w [BK, BN], dequantized once: each tile's dot that of a program of
    one tile, its products and sums in its order. `rstd`, `norm` and gamma (the norm's weight at ks) for
    `NormedRows` (NORM), which take one tile."""
    BM: tl.constexpr = acc0.shape[0]
    acc0 = _rows_dot(x_ptr, rows, stride_xm, ks, k_ok, M, w, acc0, rstd, norm, gamma, NORM_ADD, NORM, INTERPRET)
    if ROW_TILES > 1:
        acc1 = _rows_dot(x_ptr, rows + BM, stride_xm, ks, k_ok, M, w, acc1, rstd, norm, gamma, NORM_ADD, 0, INTERPRET)
    if ROW_TILES > 2:
        acc2 = _rows_dot(
            x_ptr, rows + 2 * BM, stride_xm, ks, k_ok, M, w, acc2, rstd, norm, gamma, NORM_ADD, 0, INTERPRET
        )
        acc3 = _rows_dot(
            x_ptr, rows + 3 * BM, stride_xm, ks, k_ok, M, w, acc3, rstd, norm, gamma, NORM_ADD, 0, INTERPRET
        )
    return acc0, acc1, acc2, acc3


@triton.jit
def _stacked_rows(acc0, acc1, acc2, acc3, ROW_TILES: tl.constexpr, tile_m=None):
    """The first ROW_TILES of a program's row tiles' sums [BM, BN], one under the other: [ROW_TILES * BM, BN],
    and their rows (of row tile `tile_m`; None, this program's)."""
    BM: tl.constexpr = acc0.shape[0]
    BN: tl.constexpr = acc0.shape[1]
    if ROW_TILES == 2:  # join adds a last axis (tile), brought to the front
        stacked = tl.reshape(tl.permute(tl.join(acc0, acc1), (2, 0, 1)), (2 * BM, BN))
    else:  # [BM, BN, i, j] holds tile 2j + i
        pairs = tl.join(tl.join(acc0, acc1), tl.join(acc2, acc3))
        stacked = tl.reshape(tl.permute(pairs, (3, 2, 0, 1)), (4 * BM, BN))
    return stacked, tile_index(tile_m, 0) * (BM * ROW_TILES) + tl.arange(0, BM * ROW_TILES)


@triton.jit
def _int4_tile(
    x_ptr,
    out_ptr,
    partial_ptr,
    counters_ptr,
    bias_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    stride_os,
    k_per_split,
    packed_ptr,
    scales_ptr,
    mins_ptr,
    stride_pn,
    stride_sn,
    stride_mn,
    HAS_BIAS: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    SUM_IN_TILE: tl.constexpr,
    EVEN_K: tl.constexpr,
    INTERPRET: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PERMUTE: tl.constexpr = True,  # nibbles to floats by PRMT (common.nibble_to_float); False: bench
    PACKED_BF16: tl.constexpr = False,  # bfloat16 x: weights by packed bfloat16 FMAs (nibble_fma_bf16)
    PDL: tl.constexpr = False,
    PREFETCH_LINES: tl.constexpr = 0,
    GROUP_MAJOR: tl.constexpr = False,  # codes [K / 32, N, 16], scales and mins [K / 32, N] (to_group_major)
    GATED: tl.constexpr = 0,  # 1 SiLU, 2 tanh-GELU: act(gate) * up of interleaved rows (_store_output)
    rope=(),  # with ROPE (a q/k/v projection's head dim): `_rope_args`, for `_store_rope`
    ROPE: tl.constexpr = 0,
    CACHE_BLOCK: tl.constexpr = 0,
    norm=(),  # with NORM (`row_width` of K): x is `NormedRows`' x, normalized here (`NormedRows.args`)
    NORM: tl.constexpr = 0,
    NORM_ADD: tl.constexpr = False,  # NormedRows with a delta
    timeline=None,  # a `timeline.Timeline`'s slice while it records (kernels/gpu/timeline.py)
    ROW_TILES: tl.constexpr = 1,  # row tiles of BLOCK_M a program, each weight tile dequantized once for them
    ALIGNED_GROUPS: tl.constexpr = True,  # a step's scales and mins steps ahead; False: in the step (ALIGNED_GROUPS)
    tile_m=None,  # the tile (tile_m, tile_n) and K split `split` of `splits`, `tiles_n` tiles across N;
    tile_n=None,  # None: this program's (a program a tile and split, `_int4_kernel`)
    split=None,
    tiles_n=None,
    splits=None,
):
    """A tile of x @ the 4-bit weights (codes two to a byte, a scale and a min a group of 32): `_int4_kernel`'s
    program, for any program that takes a tile (a kernel that loops over tiles gives their indices)."""
    stamp(timeline, ENTRY, INTERPRET)
    tl.static_assert((ROW_TILES == 1) | (ROW_TILES == 2) | (ROW_TILES == 4))
    tl.static_assert((NORM == 0) | (ROW_TILES == 1))
    rows = tile_index(tile_m, 0) * (BLOCK_M * ROW_TILES) + tl.arange(0, BLOCK_M)  # the first row tile's
    cols = tile_index(tile_n, 1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_begin = tile_index(split, 2) * k_per_split
    k_end = tl.minimum(K, k_begin + k_per_split)
    if PREFETCH_LINES > 0:  # the split's codes, and its first and last groups' scales and mins
        prefetch_rows(packed_ptr, cols, N, stride_pn, k_begin // 2, (k_end - k_begin) // 2, PREFETCH_LINES)
        prefetch_rows(scales_ptr, cols, N, stride_sn, k_begin // 32, tl.cdiv(k_end - k_begin, 32), 2)
        prefetch_rows(mins_ptr, cols, N, stride_mn, k_begin // 32, tl.cdiv(k_end - k_begin, 32), 2)
    wait_for_prior(PDL)
    stamp(timeline, WAITED, INTERPRET)
    rstd = 0.0  # without NORM, unused
    if NORM:  # each row's 1 / rms, as the norm kernel sums it
        rstd = normed_rows_rstd(
            x_ptr,
            stride_xm,
            tile_index(tile_m, 0) * BLOCK_M,
            M,
            norm,
            BLOCK_M,
            NORM,
            NORM_ADD,
            INTERPRET,
            tile_n,
            split,
        )
    cols64 = cols.to(tl.int64)[None, :]
    # byte i of a tile holds the codes of inputs k_lo[i] (low nibble) and k_lo[i] + 16 (high nibble)
    i = tl.arange(0, BLOCK_K // 2)
    g = tl.arange(0, BLOCK_K // 32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)  # a row tile's sums each (those past ROW_TILES unused)
    acc1 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc3 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k_lo = k0 + (i // 16) * 32 + i % 16  # [BK/2]
        k_ok = _below(k_lo, k_end, EVEN_K)
        w_mask = k_ok[:, None] & (cols < N)[None, :]
        groups = k0 // 32 + g
        if ALIGNED_GROUPS:  # k0 is a multiple of BLOCK_K: a column's groups of a step are aligned words, which
            # the pipeliner loads steps ahead with the codes (unknown, they were 2-byte loads waited on in the step)
            groups = tl.max_contiguous(tl.multiple_of(groups, BLOCK_K // 32), BLOCK_K // 32)
        g_mask = _below(groups, k_end // 32, EVEN_K)[:, None] & (cols < N)[None, :]
        if GROUP_MAJOR:  # a group's bytes of consecutive outputs are consecutive
            byte_at = ((k0 // 32 + i // 16).to(tl.int64) * N)[:, None] * 16 + cols64 * 16 + (i % 16)[:, None]
            byte = tl.load(packed_ptr + byte_at, mask=w_mask, other=0)  # [BK/2, BN]
            scale = tl.load(scales_ptr + (groups.to(tl.int64) * N)[:, None] + cols64, mask=g_mask, other=0.0)
            low = tl.load(mins_ptr + (groups.to(tl.int64) * N)[:, None] + cols64, mask=g_mask, other=0.0)
        else:
            byte = tl.load(packed_ptr + cols64 * stride_pn + (k0 // 2 + i)[:, None], mask=w_mask, other=0)  # [BK/2, BN]
            scale = tl.load(scales_ptr + cols64 * stride_sn + groups[:, None], mask=g_mask, other=0.0)
            low = tl.load(mins_ptr + cols64 * stride_mn + groups[:, None], mask=g_mask, other=0.0)
        if PACKED_BF16 and x_ptr.dtype.element_ty == tl.bfloat16:
            if scales_ptr.dtype.element_ty != tl.bfloat16:  # stored as bfloat16, they need no conversion
                scale = cast(scale.to(tl.float32), tl.bfloat16, INTERPRET)
            if mins_ptr.dtype.element_ty != tl.bfloat16:
                low = cast(low.to(tl.float32), tl.bfloat16, INTERPRET)
            scale = _repeat_rows(scale, 16)
            low = _repeat_rows(low, 16)
        else:
            scale = _repeat_rows(scale.to(tl.float32), 16)
            low = _repeat_rows(low.to(tl.float32), 16)
        for high in tl.static_range(2):  # the low nibbles' inputs k_lo, then the high ones' k_lo + 16
            if PACKED_BF16 and x_ptr.dtype.element_ty == tl.bfloat16:
                w = nibble_fma_bf16(byte, scale, low, high == 1, INTERPRET)
            else:
                w = nibble_to_float(byte, high == 1, PERMUTE, INTERPRET)
                w = cast(tl.fma(scale, w, low), x_ptr.dtype.element_ty, INTERPRET)
            ks = k_lo + 16 * high  # (the norm's weight there in runs of 16, which the pipeliner loads a step ahead)
            acc, acc1, acc2, acc3 = _tiles_dots(
                x_ptr, rows, stride_xm, ks, k_ok, M, w, acc, acc1, acc2, acc3, rstd, norm,
                norm_weight(norm, ks, NORM), NORM_ADD, NORM, ROW_TILES, INTERPRET,
            )  # fmt: skip
    if ROW_TILES > 1:
        acc, rows = _stacked_rows(acc, acc1, acc2, acc3, ROW_TILES, tile_m)
    stamp_after(timeline, LOOPED, acc, INTERPRET)  # (every tile's sums)
    _finish_tile(
        acc,
        out_ptr,
        partial_ptr,
        counters_ptr,
        bias_ptr,
        rows,
        cols,
        M,
        N,
        stride_om,
        stride_os,
        HAS_BIAS,
        IS_SPLIT,
        SUM_IN_TILE,
        INTERPRET,
        GATED,
        rope,
        ROPE,
        CACHE_BLOCK,
        tile_m,
        tile_n,
        split,
        tiles_n,
        splits,
    )
    stamp(timeline, DONE, INTERPRET)


@triton.jit(do_not_specialize=["M"])  # one binary for every number of rows
def _int4_kernel(
    x_ptr, out_ptr, partial_ptr, counters_ptr, bias_ptr, M, N, K, stride_xm, stride_om, stride_os, k_per_split,
    packed_ptr, scales_ptr, mins_ptr, stride_pn, stride_sn, stride_mn,
    HAS_BIAS: tl.constexpr, IS_SPLIT: tl.constexpr, SUM_IN_TILE: tl.constexpr, EVEN_K: tl.constexpr,
    INTERPRET: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PERMUTE: tl.constexpr = True, PACKED_BF16: tl.constexpr = False, PDL: tl.constexpr = False,
    PREFETCH_LINES: tl.constexpr = 0, GROUP_MAJOR: tl.constexpr = False, GATED: tl.constexpr = 0,
    rope=(), ROPE: tl.constexpr = 0, CACHE_BLOCK: tl.constexpr = 0,
    norm=(), NORM: tl.constexpr = 0, NORM_ADD: tl.constexpr = False,
    timeline=None, ROW_TILES: tl.constexpr = 1, ALIGNED_GROUPS: tl.constexpr = True,
):  # fmt: skip
    """`_int4_tile` (whose parameters these are), a program a tile and K split: the grid's axes 0, 1, 2."""
    _int4_tile(
        x_ptr, out_ptr, partial_ptr, counters_ptr, bias_ptr, M, N, K, stride_xm, stride_om, stride_os, k_per_split,
        packed_ptr, scales_ptr, mins_ptr, stride_pn, stride_sn, stride_mn,
        HAS_BIAS, IS_SPLIT, SUM_IN_TILE, EVEN_K, INTERPRET, BLOCK_M, BLOCK_N, BLOCK_K,
        PERMUTE, PACKED_BF16, PDL, PREFETCH_LINES, GROUP_MAJOR, GATED, rope, ROPE, CACHE_BLOCK,
        norm, NORM, NORM_ADD, timeline, ROW_TILES, ALIGNED_GROUPS,
    )  # fmt: skip


@triton.jit(do_not_specialize=["M"])
def _quantize_int8_kernel(
    x_ptr,
    words_ptr,
    d_ptr,
    s_ptr,
    M,
    K,
    stride_xm,
    GROUPS: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Per row and group of 32 inputs, `common.quantize_groups`: q as eight int32 words per group, d and
    s as float32."""
    wait_for_prior(PDL)
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    inputs = groups[:, None] * 32 + tl.arange(0, 32)[None, :]  # [G, 32]
    g_ok = groups < K // 32
    x = tl.load(x_ptr + row * stride_xm + inputs, mask=g_ok[:, None], other=0.0).to(tl.float32)
    words, d, s = quantize_groups(x, INTERPRET)
    store_groups(words, d, s, (row * (K // 32) + groups)[None, :], g_ok[None, :], words_ptr, d_ptr, s_ptr)


QUANTIZE_GROUPS = 16  # groups of 32 inputs per program of _quantize_int8_kernel


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] quantized per row and group of 32 (`_quantize_int8_kernel`): int8 codes as int32 words
    [M, K / 4], d and s [M, K / 32] float32."""
    x = _row_major(x)
    m, k = x.shape
    assert k % GROUP_SIZE == 0, x.shape
    words = torch.empty(m, k // 4, dtype=torch.int32, device=x.device)
    d = torch.empty(m, k // GROUP_SIZE, dtype=torch.float32, device=x.device)
    s = torch.empty_like(d)
    if m:
        grid = (m, cdiv(k // GROUP_SIZE, QUANTIZE_GROUPS))
        _quantize_int8_kernel[grid](
            x, words, d, s, m, k, x.stride(0), GROUPS=QUANTIZE_GROUPS, INTERPRET=INTERPRET, **launch_options(x.device)
        )
    return words, d, s


@triton.jit
def _int8_tile(M, N, K, k_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """An int4 x int8 program's rows and columns, those as int64 with the edges' repeated (rows and
    columns past them repeat the last one and are not stored, so no load needs a mask), its K split
    [k_begin, k_end) and the split's first group, a multiple of 4 the compiler knows (so the loads
    that follow from it are aligned vectors)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_begin = tl.program_id(2) * k_per_split
    k_end = tl.minimum(K, k_begin + k_per_split)
    rows64 = tl.minimum(rows, M - 1).to(tl.int64)
    cols64 = tl.minimum(cols, N - 1).to(tl.int64)
    g_begin = tl.program_id(2) * (k_per_split // 128) * 4
    return rows, cols, rows64, cols64, k_begin, k_end, g_begin


@triton.jit
def _int8_tile_strides(N, stride_wn, stride_sn, stride_mn, WORDS: tl.constexpr, GROUP_MAJOR: tl.constexpr):
    """Where an int4 (or int8) x int8 program finds output n's group g: its code words at n * w_col +
    g * w_group, its scale at n * s_col + g * sm_group, its min at n * m_col + g * sm_group. Row major
    (as GGUF stores them): each output's groups one after another; group major (`to_group_major`): each
    group's outputs one after another, so that a warp's threads, one output each, read one block."""
    if GROUP_MAJOR:
        n64 = N.to(tl.int64)
        return WORDS, n64 * WORDS, 1, 1, n64
    else:
        return stride_wn, WORDS, stride_sn, stride_mn, 1


@triton.jit
def _int8_step_pointers(
    x_ptr, d_ptr, s_ptr, words_ptr, scales_ptr, mins_ptr, cols64, rows64, g_begin,
    N, K, stride_xm, stride_wn, stride_sn, stride_mn, WORDS: tl.constexpr, GROUP_MAJOR: tl.constexpr,
):  # fmt: skip
    """An int4 (or int8) x int8 program's pointers at group g_begin (a scalar, or [R, 1] for rows of
    their own): the codes' words [R, 4] (4-bit: word t of a group holds inputs 4t..4t+3 in its low
    nibbles, +16 in its high ones; 8-bit: word t inputs 4t..4t+3), the scales and mins ([R, 4], the
    step's four groups', row major; [R, 1], its first group's, group major), the int8 inputs' words and
    their d and s ([1 or R, BM]); then the words' and the scales' steps from one group to the next."""
    w_col, w_group, s_col, m_col, sm_group = _int8_tile_strides(N, stride_wn, stride_sn, stride_mn, WORDS, GROUP_MAJOR)
    four = tl.arange(0, 4)[None, :]
    w_step = words_ptr + cols64[:, None] * w_col + g_begin * w_group + four
    groups = g_begin if GROUP_MAJOR else g_begin + four
    scales_step = scales_ptr + cols64[:, None] * s_col + groups * sm_group
    mins_step = mins_ptr + cols64[:, None] * m_col + groups * sm_group
    x_step = x_ptr + (rows64 * stride_xm)[None, :] + g_begin * 8  # eight words of int8 codes a group
    d_step = d_ptr + (rows64 * (K // 32))[None, :] + g_begin
    s_step = s_ptr + (rows64 * (K // 32))[None, :] + g_begin
    return w_step, scales_step, mins_step, x_step, d_step, s_step, w_group, sm_group


@triton.jit
def _prefetch_int8_tile(
    words_ptr,
    scales_ptr,
    mins_ptr,
    cols,
    N,
    stride_wn,
    stride_sn,
    stride_mn,
    k_begin,
    k_end,
    g_begin,
    CODE_BITS: tl.constexpr,
    LINES: tl.constexpr,
):
    """An int4 (or int8) x int8 program's weights into L2 before the wait (`prefetch_rows`): its split's
    codes, and its first and last groups' scales and mins."""
    if LINES > 0:
        groups = tl.cdiv(k_end - k_begin, 32)
        prefetch_rows(words_ptr, cols, N, stride_wn, g_begin * CODE_BITS, groups * CODE_BITS, LINES)
        prefetch_rows(scales_ptr, cols, N, stride_sn, g_begin, groups, 2)
        if CODE_BITS == 4:
            prefetch_rows(mins_ptr, cols, N, stride_mn, g_begin, groups, 2)


@triton.jit
def _int8_inputs_step(
    acc,
    k0,
    k_end,
    w_step,
    scales_step,
    mins_step,
    x_step,
    d_step,
    s_step,
    w_group,
    sm_group,
    EVEN_K: tl.constexpr,
    INTERPRET: tl.constexpr,
    CODE_BITS: tl.constexpr,
    GROUP_MAJOR: tl.constexpr,
):
    """One step (four groups from input k0) of `_int4_int8_kernel`: acc [BN, BM] with each group's sums
    and float steps added, group after group. Row major, scales_step and mins_step are [BN, 4], the four
    groups' (one 64-bit load an output); group major, [BN, 1], the first group's (a group's outputs'
    scales one after another: a load a group)."""
    four = tl.arange(0, 4)[None, :]
    if not GROUP_MAJOR:
        if EVEN_K:
            scales = split4(tl.load(scales_step))  # [BN] each
            if CODE_BITS == 4:
                lows = split4(tl.load(mins_step))
        else:  # a split that ends within the step: past its end the scale and min are 0, so those
            # groups add nothing, and their loads stay in the split
            g_ok = k0 // 32 + four < k_end // 32
            scales = split4(tl.load(scales_step, mask=g_ok, other=0.0))
            if CODE_BITS == 4:
                lows = split4(tl.load(mins_step, mask=g_ok, other=0.0))
    for gi in tl.static_range(4):
        g = gi if EVEN_K else tl.minimum(gi, (k_end - k0) // 32 - 1)
        if GROUP_MAJOR and EVEN_K:  # [BN, 1]
            scale = tl.load(scales_step + gi * sm_group)
            if CODE_BITS == 4:
                low = tl.load(mins_step + gi * sm_group)
        elif GROUP_MAJOR:  # past the split's end 0, as above (g stays in the split: its loads too)
            g_ok_here = k0 // 32 + gi < k_end // 32
            scale = tl.where(g_ok_here, tl.load(scales_step + g * sm_group), 0.0)
            if CODE_BITS == 4:
                low = tl.where(g_ok_here, tl.load(mins_step + g * sm_group), 0.0)
        else:
            scale = scales[gi][:, None]
            if CODE_BITS == 4:
                low = lows[gi][:, None]
        if CODE_BITS == 4:
            isum = group_dot(tl.load(w_step + g * w_group), x_step + g * 8, INTERPRET)  # [BN, BM]
        else:
            w_at = w_step + g * w_group
            isum = int8_group_dot(tl.load(w_at), tl.load(w_at + 4), x_step + g * 8, INTERPRET)
        d = tl.load(d_step + g)  # [1, BM] (or [BN, BM]: each output's own rows)
        acc = tl.fma(scale.to(tl.float32) * d, isum.to(tl.float32), acc)
        if CODE_BITS == 4:
            s = tl.load(s_step + g)
            acc = tl.fma(s, low.to(tl.float32), acc)
    return acc


@triton.jit(do_not_specialize=["M"])
def _int4_int8_kernel(
    x_ptr,
    out_ptr,
    partial_ptr,
    counters_ptr,
    bias_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    stride_os,
    k_per_split,
    d_ptr,
    s_ptr,
    words_ptr,
    scales_ptr,
    mins_ptr,
    stride_wn,
    stride_sn,
    stride_mn,
    HAS_BIAS: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    SUM_IN_TILE: tl.constexpr,
    EVEN_K: tl.constexpr,
    INTERPRET: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CODE_BITS: tl.constexpr = 4,
    PDL: tl.constexpr = False,
    PREFETCH_LINES: tl.constexpr = 0,
    GROUP_MAJOR: tl.constexpr = False,  # words [K / 32, N, WORDS], scales and mins [K / 32, N] (to_group_major)
    rope=(),  # with ROPE (a q/k/v projection's head dim): `_rope_args`, for `_store_rope`
    ROPE: tl.constexpr = 0,
    CACHE_BLOCK: tl.constexpr = 0,
    timeline=None,  # a `timeline.Timeline`'s slice while it records (kernels/gpu/timeline.py)
):
    """int4 weights times int8 inputs (x: `quantize_int8`'s words, d and s; BLOCK_K 128: four groups
    a step), as int4_int8.cpp on the CPU: per group of 32 and output the exact integer sum over
    code * q (dp4a: four products per instruction, no tensor cores), then total = fma(scale * d, sum,
    total); total = fma(s, min, total), group after group. Nothing here depends on the other rows of
    the tile, so BLOCK_M may follow M without changing a bit. CODE_BITS 8: int8 codes (GGML's Q8_0,
    eight words a group) and no min: total = fma(scale * d, sum, total)."""
    stamp(timeline, ENTRY, INTERPRET)
    tl.static_assert(BLOCK_K == 128, "the loop takes four groups of 32 a step")
    rows, cols, rows64, cols64, k_begin, k_end, g_begin = _int8_tile(M, N, K, k_per_split, BLOCK_M, BLOCK_N)
    _prefetch_int8_tile(
        words_ptr,
        scales_ptr,
        mins_ptr,
        cols,
        N,
        stride_wn,
        stride_sn,
        stride_mn,
        k_begin,
        k_end,
        g_begin,
        CODE_BITS,
        PREFETCH_LINES,
    )
    wait_for_prior(PDL)
    stamp(timeline, WAITED, INTERPRET)
    WORDS: tl.constexpr = CODE_BITS  # int32 words of codes per group of 32
    # pointers at the split's first group, advanced a step (four groups) at a time
    w_step, scales_step, mins_step, x_step, d_step, s_step, w_group, sm_group = _int8_step_pointers(
        x_ptr, d_ptr, s_ptr, words_ptr, scales_ptr, mins_ptr, cols64, rows64, g_begin,
        N, K, stride_xm, stride_wn, stride_sn, stride_mn, WORDS, GROUP_MAJOR,
    )  # fmt: skip
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)  # outputs first, as group_dot gives them
    for k0 in range(k_begin, k_end, 128):
        acc = _int8_inputs_step(
            acc,
            k0,
            k_end,
            w_step,
            scales_step,
            mins_step,
            x_step,
            d_step,
            s_step,
            w_group,
            sm_group,
            EVEN_K,
            INTERPRET,
            CODE_BITS,
            GROUP_MAJOR,
        )
        w_step += 4 * w_group
        scales_step += 4 * sm_group
        mins_step += 4 * sm_group
        x_step += 32
        d_step += 4
        s_step += 4
    stamp_after(timeline, LOOPED, acc, INTERPRET)
    acc = tl.trans(acc)
    _finish_tile(
        acc,
        out_ptr,
        partial_ptr,
        counters_ptr,
        bias_ptr,
        rows,
        cols,
        M,
        N,
        stride_om,
        stride_os,
        HAS_BIAS,
        IS_SPLIT,
        SUM_IN_TILE,
        INTERPRET,
        0,
        rope,
        ROPE,
        CACHE_BLOCK,
    )
    stamp(timeline, DONE, INTERPRET)


@triton.jit(do_not_specialize=["M"])
def _int4_int8_splits_kernel(
    x_ptr,
    out_ptr,
    partial_ptr,
    counters_ptr,
    bias_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    stride_os,
    k_per_split,
    d_ptr,
    s_ptr,
    words_ptr,
    scales_ptr,
    mins_ptr,
    stride_wn,
    stride_sn,
    stride_mn,
    HAS_BIAS: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    SUM_IN_TILE: tl.constexpr,
    EVEN_K: tl.constexpr,
    INTERPRET: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLITS: tl.constexpr,
    PADDED: tl.constexpr,  # SPLITS rounded up to a power of two: the pairs past SPLITS repeat the last split
    STEPS: tl.constexpr,
    CODE_BITS: tl.constexpr = 4,
    PDL: tl.constexpr = False,
    GROUP_MAJOR: tl.constexpr = False,
    rope=(),  # with ROPE (a q/k/v projection's head dim): `_rope_args`, for `_store_rope`
    ROPE: tl.constexpr = 0,
    CACHE_BLOCK: tl.constexpr = 0,
    timeline=None,  # a `timeline.Timeline`'s slice while it records (kernels/gpu/timeline.py)
):
    """`_int4_int8_kernel` with all of a layer's K splits (SPLITS of STEPS steps of four groups: K =
    SPLITS * STEPS * 128) in one program: each (split, output) pair on a thread of its own, as one
    column of `_int4_int8_kernel`'s split, then each output's splits added in split order in registers
    (where `_finish_tile` adds their partial sums from memory). The same arithmetic in the same order,
    so its bits, without the partial sums' stores, the count and the last program's second pass."""
    stamp(timeline, ENTRY, INTERPRET)
    tl.static_assert(BLOCK_K == 128, "the loop takes four groups of 32 a step")
    PAIRS: tl.constexpr = PADDED * BLOCK_N
    pair = tl.arange(0, PAIRS)  # split-major: a warp's threads hold consecutive outputs of one split
    split = tl.minimum(pair // BLOCK_N, SPLITS - 1)  # the padding's pairs: computed, never added
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows64 = tl.minimum(rows, M - 1).to(tl.int64)
    pair_cols64 = tl.minimum(tl.program_id(1) * BLOCK_N + pair % BLOCK_N, N - 1).to(tl.int64)
    g_begin = (split * (STEPS * 4))[:, None]  # [PAIRS, 1]: the split's first group
    wait_for_prior(PDL)
    stamp(timeline, WAITED, INTERPRET)
    WORDS: tl.constexpr = CODE_BITS
    # as `_int4_int8_kernel`'s, a pair a row: x_step [PAIRS, BM], each split's inputs
    w_step, scales_step, mins_step, x_step, d_step, s_step, w_group, sm_group = _int8_step_pointers(
        x_ptr, d_ptr, s_ptr, words_ptr, scales_ptr, mins_ptr, pair_cols64, rows64, g_begin,
        N, K, stride_xm, stride_wn, stride_sn, stride_mn, WORDS, GROUP_MAJOR,
    )  # fmt: skip
    acc = tl.zeros((PAIRS, BLOCK_M), tl.float32)
    for step in tl.static_range(STEPS):
        acc = _int8_inputs_step(
            acc,
            0,
            K,
            w_step + step * (4 * w_group),
            scales_step + step * (4 * sm_group),
            mins_step + step * (4 * sm_group),
            x_step + step * 32,
            d_step + step * 4,
            s_step + step * 4,
            w_group,
            sm_group,
            True,
            INTERPRET,
            CODE_BITS,
            GROUP_MAJOR,
        )
    stamp_after(timeline, LOOPED, acc, INTERPRET)
    # each output's splits in split order: ((split 0 + split 1) + split 2) + ..., as _finish_tile adds them
    # each part taken out whole as its bits (one part and zeros, xor-ed: exactly that part, a zero's sign
    # and a NaN's payload too, in the interpreter as on a GPU), then added as floats
    bits = tl.reshape(acc, (PADDED, BLOCK_N, BLOCK_M)).to(tl.int32, bitcast=True)
    which = tl.arange(0, PADDED)[:, None, None]
    total = tl.xor_sum(tl.where(which == 0, bits, 0), axis=0).to(tl.float32, bitcast=True)
    for i in tl.static_range(1, SPLITS):
        total += tl.xor_sum(tl.where(which == i, bits, 0), axis=0).to(tl.float32, bitcast=True)
    _finish_tile(
        tl.trans(total),
        out_ptr,
        partial_ptr,
        counters_ptr,
        bias_ptr,
        rows,
        cols,
        M,
        N,
        stride_om,
        stride_os,
        HAS_BIAS,
        False,
        False,
        INTERPRET,
        0,
        rope,
        ROPE,
        CACHE_BLOCK,
    )
    stamp(timeline, DONE, INTERPRET)


@triton.jit
def _word_dots(w, x_low, x_high, INTERPRET: tl.constexpr):
    """Per int32 word of int4 codes (`group_dot`'s word t: inputs 4t..4t+3 in its low nibbles, 16+4t..
    16+4t+3 in its high ones) and the int8 input words it meets (x_low: inputs 4t..4t+3, x_high: 16+4t..),
    elementwise: the exact sum of its eight products, `group_dot`'s arithmetic one word at a time (a
    group's sum is its four words' sums, exact in any order). On a GPU two ANDs and two dp4a."""
    if INTERPRET:
        total = w * 0
        for j in tl.static_range(4):
            low = (w >> (8 * j)) & 15
            high = (w >> (8 * j + 4)) & 15
            total += low * ((x_low << (24 - 8 * j)) >> 24) + high * ((x_high << (24 - 8 * j)) >> 24)
        return total
    else:
        return tl.inline_asm_elementwise(
            asm="{ .reg .b32 l, h, sl, sh; and.b32 l, $1, 0x0F0F0F0F; dp4a.u32.s32 sl, l, $2, 0;"
            " and.b32 h, $1, 0xF0F0F0F0; dp4a.u32.s32 sh, h, $3, 0; shr.s32 sh, sh, 4; add.s32 $0, sl, sh; }",
            constraints="=r,r,r,r",
            args=[w, x_low, x_high],
            dtype=tl.int32,
            is_pure=True,
            pack=1,
        )


@triton.jit
def _byte_dots(w, x, INTERPRET: tl.constexpr):
    """Per int32 word of int8 codes (inputs 4t..4t+3) and the int8 input word it meets, elementwise: the
    exact sum of its four products, `int8_group_dot`'s arithmetic one word at a time. On a GPU one dp4a."""
    if INTERPRET:
        total = w * 0
        for j in tl.static_range(4):
            total += ((w << (24 - 8 * j)) >> 24) * ((x << (24 - 8 * j)) >> 24)
        return total
    else:
        return tl.inline_asm_elementwise(
            asm="dp4a.s32.s32 $0, $1, $2, 0;", constraints="=r,r,r", args=[w, x], dtype=tl.int32, is_pure=True, pack=1
        )


@triton.jit
def _columns(x, C: tl.constexpr):
    """x [R, C] -> its C columns [R] in order, C a power of two up to 32: moved so that each thread holds
    its rows' every column (a few exchanges through shared memory, where taking a column from across a
    warp's lanes would be a reduction each)."""
    if C == 1:
        return (tl.reshape(x, (x.shape[0],)),)
    elif C == 2:
        return tl.split(x)
    elif C == 4:
        return split4(x)
    else:  # the even columns' columns, and the odd ones', interleaved
        even, odd = tl.split(tl.reshape(x, (x.shape[0], C // 2, 2)))
        e = _columns(even, C // 2)
        o = _columns(odd, C // 2)
        tl.static_assert(C == 8 or C == 16 or C == 32, "up to 32 columns")
        if C == 8:
            return e[0], o[0], e[1], o[1], e[2], o[2], e[3], o[3]
        elif C == 16:
            return e[0], o[0], e[1], o[1], e[2], o[2], e[3], o[3], e[4], o[4], e[5], o[5], e[6], o[6], e[7], o[7]
        else:
            return (
            e[0], o[0], e[1], o[1], e[2], o[2], e[3], o[3], e[4], o[4], e[5], o[5], e[6], o[6], e[7], o[7],
            e[8], o[8], e[9], o[9], e[10], o[10], e[11], o[11], e[12], o[12], e[13], o[13], e[14], o[14], e[15], o[15],
            )  # fmt: skip


@triton.jit(do_not_specialize=["M"])
def _int4_int8_words_kernel(
    x_ptr,
    out_ptr,
    partial_ptr,
    counters_ptr,
    bias_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    stride_os,
    k_per_split,
    d_ptr,
    s_ptr,
    words_ptr,
    scales_ptr,
    mins_ptr,
    stride_wn,
    stride_sn,
    stride_mn,
    HAS_BIAS: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    SUM_IN_TILE: tl.constexpr,
    EVEN_K: tl.constexpr,
    INTERPRET: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLITS: tl.constexpr,
    PADDED: tl.constexpr,  # SPLITS rounded up to a power of two: the splits past SPLITS repeat the last
    GROUPS: tl.constexpr,  # groups of 32 a K split (the layer's k_per_split / 32)
    CODE_BITS: tl.constexpr = 4,
    PDL: tl.constexpr = False,
    rope=(),  # with ROPE (a q/k/v projection's head dim): `_rope_args`, for `_store_rope`
    ROPE: tl.constexpr = 0,
    CACHE_BLOCK: tl.constexpr = 0,
    timeline=None,  # a `timeline.Timeline`'s slice while it records (kernels/gpu/timeline.py)
):
    """`_int4_int8_splits_kernel`'s arithmetic (int4 codes, row major, K = SPLITS * GROUPS * 32; and with
    CODE_BITS 8, int8 codes, `_int4_int8_kernel`'s) with the
    code words spread over the threads as memory holds them: a program's BLOCK_N outputs' whole rows
    [BLOCK_N, splits, groups, 4 (or 8) words] in one load, consecutive words on consecutive threads (a warp
    reads 128 bytes and more of one row, where one output a thread reads 32 rows' 16 bytes), every
    word's products summed alone (`_word_dots`) and a group's four words added in integers: the exact
    sums of `group_dot`. Then, as that kernel, for each split (all at once) the groups' float steps one
    after another, fma(scale * d, sum, total) and fma(s, min, total), and the splits added in split
    order: its bits, for any number of rows up to BLOCK_M (each row's own arithmetic)."""
    stamp(timeline, ENTRY, INTERPRET)
    R: tl.constexpr = BLOCK_N * BLOCK_M  # (output, row) pairs, output major
    pair = tl.arange(0, R)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    col64 = tl.minimum(tl.program_id(1) * BLOCK_N + pair // BLOCK_M, N - 1).to(tl.int64)[:, None, None]  # [R, 1, 1]
    row64 = tl.minimum(pair % BLOCK_M, M - 1).to(tl.int64)[:, None, None]
    split = tl.minimum(tl.arange(0, PADDED), SPLITS - 1)[None, :, None]  # [1, P, 1]
    group = split * GROUPS + tl.arange(0, GROUPS)[None, None, :]  # [1, P, G]: each split's groups
    wait_for_prior(PDL)
    stamp(timeline, WAITED, INTERPRET)
    WORDS: tl.constexpr = CODE_BITS  # code words a group
    t = tl.arange(0, WORDS)[None, None, None, :]
    w = tl.load(words_ptr + (col64 * stride_wn + group * WORDS)[:, :, :, None] + t)  # [R, P, G, WORDS]
    x_words = x_ptr + (row64 * stride_xm + group * 8)[:, :, :, None] + t  # a group's 8 input words
    if CODE_BITS == 4:  # word t meets input words t and t + 4
        isum = tl.sum(_word_dots(w, tl.load(x_words), tl.load(x_words + 4), INTERPRET), axis=3)  # [R, P, G]
    else:  # int8 codes: word t meets input word t
        isum = tl.sum(_byte_dots(w, tl.load(x_words), INTERPRET), axis=3)
    scales = tl.load(scales_ptr + col64 * stride_sn + group).to(tl.float32)  # [R, P, G]
    d = tl.load(d_ptr + row64 * (K // 32) + group)  # [R, P, G]
    # each split's groups in order, every split at once, from columns each thread holds
    pairs: tl.constexpr = R * PADDED
    steps = _columns(tl.reshape(scales * d, (pairs, GROUPS)), GROUPS)  # scale * d rounded, as the splits kernel
    sums = _columns(tl.reshape(isum.to(tl.float32), (pairs, GROUPS)), GROUPS)
    acc = tl.zeros((R * PADDED,), tl.float32)
    if CODE_BITS == 4:
        lows = tl.load(mins_ptr + col64 * stride_mn + group).to(tl.float32)
        s = _columns(tl.reshape(tl.load(s_ptr + row64 * (K // 32) + group), (pairs, GROUPS)), GROUPS)
        lows = _columns(tl.reshape(lows, (pairs, GROUPS)), GROUPS)
        for g in tl.static_range(GROUPS):
            acc = tl.fma(steps[g], sums[g], acc)
            acc = tl.fma(s[g], lows[g], acc)
    else:
        for g in tl.static_range(GROUPS):
            acc = tl.fma(steps[g], sums[g], acc)
    acc = tl.reshape(acc, (R, PADDED))
    stamp_after(timeline, LOOPED, acc, INTERPRET)
    splits = _columns(acc, PADDED)
    total = splits[0]  # [R]
    for i in tl.static_range(1, SPLITS):  # ((split 0 + split 1) + split 2) + ..., as _finish_tile adds them
        total += splits[i]
    _finish_tile(
        tl.trans(tl.reshape(total, (BLOCK_N, BLOCK_M))),
        out_ptr,
        partial_ptr,
        counters_ptr,
        bias_ptr,
        rows,
        cols,
        M,
        N,
        stride_om,
        stride_os,
        HAS_BIAS,
        False,
        False,
        INTERPRET,
        0,
        rope,
        ROPE,
        CACHE_BLOCK,
    )
    stamp(timeline, DONE, INTERPRET)


@triton.jit(do_not_specialize=["M"])
def _int4_int8_mma_kernel(
    x_ptr,
    out_ptr,
    partial_ptr,
    counters_ptr,
    bias_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    stride_os,
    k_per_split,
    d_ptr,
    s_ptr,
    words_ptr,
    scales_ptr,
    mins_ptr,
    stride_wn,
    stride_sn,
    stride_mn,
    HAS_BIAS: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    SUM_IN_TILE: tl.constexpr,
    EVEN_K: tl.constexpr,
    INTERPRET: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CODE_BITS: tl.constexpr = 4,
    PDL: tl.constexpr = False,
    PREFETCH_LINES: tl.constexpr = 0,
    GROUP_MAJOR: tl.constexpr = False,  # as `_int4_int8_kernel`'s
    rope=(),  # with ROPE (a q/k/v projection's head dim): `_rope_args`, for `_store_rope`
    ROPE: tl.constexpr = 0,
    CACHE_BLOCK: tl.constexpr = 0,
    timeline=None,  # a `timeline.Timeline`'s slice while it records (kernels/gpu/timeline.py)
):
    """`_int4_int8_kernel`'s arithmetic for many rows, each group's integer sums on the tensor cores
    (an int8 dot of K = 32, exact in int32 whatever its order) and the same float steps per row and
    output in the same order, so the same bits: a row's result does not depend on which of the two
    kernels its batch took. 4-bit: the group's inputs and codes enter the dot interleaved (input j
    beside input j + 16, as a byte holds their codes), the same order on both sides. CODE_BITS 8 as
    `_int4_int8_kernel`'s."""
    stamp(timeline, ENTRY, INTERPRET)
    tl.static_assert(BLOCK_K == 128, "the loop takes four groups of 32 a step")
    rows, cols, rows64, cols64, k_begin, k_end, g_begin = _int8_tile(M, N, K, k_per_split, BLOCK_M, BLOCK_N)
    _prefetch_int8_tile(
        words_ptr,
        scales_ptr,
        mins_ptr,
        cols,
        N,
        stride_wn,
        stride_sn,
        stride_mn,
        k_begin,
        k_end,
        g_begin,
        CODE_BITS,
        PREFETCH_LINES,
    )
    wait_for_prior(PDL)
    stamp(timeline, WAITED, INTERPRET)
    w_col, w_group, s_col, m_col, sm_group = _int8_tile_strides(
        N, stride_wn, stride_sn, stride_mn, CODE_BITS, GROUP_MAJOR
    )
    half = tl.arange(0, 16)
    x_bytes = x_ptr.to(tl.pointer_type(tl.int8))  # the int8 codes, M x K
    x_step = x_bytes + rows64[:, None] * (stride_xm * 4) + g_begin * 32 + half[None, :]  # [BM, 16]
    if CODE_BITS == 4:
        w_bytes = words_ptr.to(tl.pointer_type(tl.uint8))  # byte j of a group: inputs j and j + 16
        w_step = w_bytes + cols64[None, :] * (w_col * 4) + g_begin * (w_group * 4) + half[:, None]  # [16, BN]
    else:
        w_bytes = words_ptr.to(tl.pointer_type(tl.int8))  # byte j of a group: input j
        w_step = (
            w_bytes + cols64[None, :] * (w_col * 4) + g_begin * (w_group * 4) + tl.arange(0, 32)[:, None]
        )  # [32, BN]
    d_step = d_ptr + rows64 * (K // 32) + g_begin
    s_step = s_ptr + rows64 * (K // 32) + g_begin
    scales_step = scales_ptr + cols64 * s_col + g_begin * sm_group
    mins_step = mins_ptr + cols64 * m_col + g_begin * sm_group
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(k_begin, k_end, 128):
        for gi in tl.static_range(4):
            if EVEN_K:
                g = gi
                g_ok = True
            else:  # past the split's end: the last group's loads, with scale and min 0 (adds nothing)
                g = tl.minimum(gi, (k_end - k0) // 32 - 1)
                g_ok = k0 + gi * 32 < k_end
            low = tl.load(x_step + g * 32)  # [BM, 16]: inputs 0..15 of the group
            high = tl.load(x_step + (g * 32 + 16))
            if CODE_BITS == 4:
                inputs = tl.reshape(tl.join(low, high), (BLOCK_M, 32))  # input j, then j + 16, ...
                packed = tl.load(w_step + g * (w_group * 4))  # [16, BN]
                codes = tl.join((packed & 15).to(tl.int8), (packed >> 4).to(tl.int8))  # [16, BN, 2]
                codes = tl.reshape(tl.permute(codes, (0, 2, 1)), (32, BLOCK_N))  # the same order along K
            else:
                inputs = tl.reshape(tl.permute(tl.join(low, high), (0, 2, 1)), (BLOCK_M, 32))  # inputs 0..31
                codes = tl.load(w_step + g * (w_group * 4))  # [32, BN]
            isum = tl.dot(inputs, codes, out_dtype=tl.int32)  # [BM, BN]
            d = tl.load(d_step + g)
            if EVEN_K:
                scale = tl.load(scales_step + g * sm_group).to(tl.float32)
            else:
                scale = tl.where(g_ok, tl.load(scales_step + g * sm_group).to(tl.float32), 0.0)
            acc = tl.fma(scale[None, :] * d[:, None], isum.to(tl.float32), acc)
            if CODE_BITS == 4:
                s = tl.load(s_step + g)
                if EVEN_K:
                    low_value = tl.load(mins_step + g * sm_group).to(tl.float32)
                else:
                    low_value = tl.where(g_ok, tl.load(mins_step + g * sm_group).to(tl.float32), 0.0)
                acc = tl.fma(s[:, None], low_value[None, :], acc)
        x_step += 128
        w_step += 4 * (w_group * 4)
        d_step += 4
        s_step += 4
        scales_step += 4 * sm_group
        mins_step += 4 * sm_group
    stamp_after(timeline, LOOPED, acc, INTERPRET)
    _finish_tile(
        acc,
        out_ptr,
        partial_ptr,
        counters_ptr,
        bias_ptr,
        rows,
        cols,
        M,
        N,
        stride_om,
        stride_os,
        HAS_BIAS,
        IS_SPLIT,
        SUM_IN_TILE,
        INTERPRET,
        0,
        rope,
        ROPE,
        CACHE_BLOCK,
    )
    stamp(timeline, DONE, INTERPRET)


@triton.jit(do_not_specialize=["M"])  # one binary for every number of rows
def _int8_kernel(
    x_ptr,
    out_ptr,
    partial_ptr,
    counters_ptr,
    bias_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    stride_os,
    k_per_split,
    codes_ptr,
    scales_ptr,
    stride_cn,
    stride_sn,
    HAS_BIAS: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    SUM_IN_TILE: tl.constexpr,
    EVEN_K: tl.constexpr,
    INTERPRET: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
    PREFETCH_LINES: tl.constexpr = 0,
    GATED: tl.constexpr = 0,  # 1 SiLU, 2 tanh-GELU: act(gate) * up of interleaved rows (_store_output)
    rope=(),  # with ROPE (a q/k/v projection's head dim): `_rope_args`, for `_store_rope`
    ROPE: tl.constexpr = 0,
    CACHE_BLOCK: tl.constexpr = 0,
    norm=(),  # with NORM (`row_width` of K): x is `NormedRows`' x, normalized here (`NormedRows.args`)
    NORM: tl.constexpr = 0,
    NORM_ADD: tl.constexpr = False,  # NormedRows with a delta
    timeline=None,  # a `timeline.Timeline`'s slice while it records (kernels/gpu/timeline.py)
    ROW_TILES: tl.constexpr = 1,  # row tiles of BLOCK_M a program, each weight tile dequantized once for them
):
    stamp(timeline, ENTRY, INTERPRET)
    tl.static_assert((ROW_TILES == 1) | (ROW_TILES == 2) | (ROW_TILES == 4))
    tl.static_assert((NORM == 0) | (ROW_TILES == 1))
    rows = tl.program_id(0) * (BLOCK_M * ROW_TILES) + tl.arange(0, BLOCK_M)  # the first row tile's
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_begin = tl.program_id(2) * k_per_split
    k_end = tl.minimum(K, k_begin + k_per_split)
    if PREFETCH_LINES > 0:  # the split's codes, and its first and last groups' scales
        prefetch_rows(codes_ptr, cols, N, stride_cn, k_begin, k_end - k_begin, PREFETCH_LINES)
        prefetch_rows(scales_ptr, cols, N, stride_sn, k_begin // 32, tl.cdiv(k_end - k_begin, 32), 2)
    wait_for_prior(PDL)
    stamp(timeline, WAITED, INTERPRET)
    rstd = 0.0  # without NORM, unused
    if NORM:  # each row's 1 / rms, as the norm kernel sums it
        rstd = normed_rows_rstd(
            x_ptr, stride_xm, tl.program_id(0) * BLOCK_M, M, norm, BLOCK_M, NORM, NORM_ADD, INTERPRET
        )
    cols64 = cols.to(tl.int64)[None, :]
    g = tl.arange(0, BLOCK_K // 32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)  # a row tile's sums each (those past ROW_TILES unused)
    acc1 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc3 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    gamma_next = norm_weight(norm, k_begin + tl.arange(0, BLOCK_K), NORM)  # (zeros without NORM)
    for k0 in range(k_begin, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        gamma = gamma_next  # the norm's weight for this step, loaded in the step before, and the next step's
        if NORM:
            gamma_next = norm_weight(norm, ks + BLOCK_K, NORM)
        k_ok = _below(ks, k_end, EVEN_K)
        w_mask = k_ok[:, None] & (cols < N)[None, :]
        codes = tl.load(codes_ptr + cols64 * stride_cn + ks[:, None], mask=w_mask, other=0)  # [BK, BN]
        groups = k0 // 32 + g
        g_mask = _below(groups, k_end // 32, EVEN_K)[:, None] & (cols < N)[None, :]
        scale = tl.load(scales_ptr + cols64 * stride_sn + groups[:, None], mask=g_mask, other=0.0)
        scale = _repeat_rows(scale.to(tl.float32), 32)
        w = cast(codes.to(tl.float32) * scale, x_ptr.dtype.element_ty, INTERPRET)
        acc, acc1, acc2, acc3 = _tiles_dots(
            x_ptr, rows, stride_xm, ks, k_ok, M, w, acc, acc1, acc2, acc3, rstd, norm, gamma, NORM_ADD, NORM,
            ROW_TILES, INTERPRET,
        )  # fmt: skip
    if ROW_TILES > 1:
        acc, rows = _stacked_rows(acc, acc1, acc2, acc3, ROW_TILES)
    stamp_after(timeline, LOOPED, acc, INTERPRET)  # (every tile's sums)
    _finish_tile(
        acc,
        out_ptr,
        partial_ptr,
        counters_ptr,
        bias_ptr,
        rows,
        cols,
        M,
        N,
        stride_om,
        stride_os,
        HAS_BIAS,
        IS_SPLIT,
        SUM_IN_TILE,
        INTERPRET,
        GATED,
        rope,
        ROPE,
        CACHE_BLOCK,
    )
    stamp(timeline, DONE, INTERPRET)


# A matmul's `activation`: its weight's rows interleaved (`interleave_gate_up`: gate j at 2j, up j at
# 2j + 1), it gives act(gate) * up [M, N / 2] instead of [M, N], the gated activation kernel's bits
# (common.gated_product) without its launch, nor the [M, N] output stored and read again. The GATED
# constexpr of the float-input kernels and the sum kernel.
GATED_ACTIVATIONS = {None: 0, "silu": 1, "gelu_tanh": 2}


def _pair_halves(t: torch.Tensor, block: int, rows: int, dim: int, undo: bool = False) -> torch.Tensor:
    """t's first `rows` along `dim`, in blocks of `block`, each block's halves interleaved (i at 2i,
    i + block / 2 at 2i + 1), or (`undo`) put back; the rest as they are. A new contiguous tensor."""
    head, tail = t.split([rows, t.shape[dim] - rows], dim)
    blocks = (rows // block, block // 2, 2) if undo else (rows // block, 2, block // 2)
    head = head.unflatten(dim, blocks).transpose(dim + 1, dim + 2).flatten(dim, dim + 2)
    return torch.cat((head, tail), dim).contiguous()


def interleave_gate_up(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """A fused gate and up projection's tensor, [gate | up] along `dim` (weight or code rows, scales,
    mins, bias), with its halves interleaved for a matmul's `activation`: gate j at 2j, up j at 2j + 1.
    A new contiguous tensor."""
    return _pair_halves(t, t.shape[dim], t.shape[dim], dim)


def deinterleave_gate_up(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """`interleave_gate_up`'s inverse: [gate | up] along `dim` again."""
    return _pair_halves(t, t.shape[dim], t.shape[dim], dim, undo=True)


@dataclass(frozen=True)
class RopeStore:
    """A q/k/v projection's matmul with RoPE and the KV cache's write in its epilogue (`rope` of every
    matmul here; the weight's q and k rows in `interleave_rope`'s layout): each
    row's cos and sin_signed [T, 1, D] (layers/rotary.py's tables), the layer's caches [blocks,
    block_size, Hkv, D], each row's slot [T] (negative: not written), and the number of query heads. The
    call then gives the rotated q [T, H * D], `elementwise.rotate_and_store`'s bits (cos and sin in the
    output's dtype, as the model's tables are), and writes k and v into the caches as it does: one launch
    fewer, and (where the tile's last K split adds the splits, or there are none) no [T, (H + 2 Hkv) * D]
    output stored and read."""

    cos: torch.Tensor
    sin_signed: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor
    num_heads: int


def interleave_rope(t: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, dim: int = 0) -> torch.Tensor:
    """A q/k/v projection's tensor along `dim` (weight or code rows, scales, mins, bias: q's heads, k's,
    then v's, head_dim each) with each q and k head's dimensions paired for `RopeStore`: i at 2i and
    i + head_dim / 2 at 2i + 1, so that a tile holds what RoPE mixes; v's as they are. A new tensor."""
    return _pair_halves(t, head_dim, (num_heads + num_kv_heads) * head_dim, dim)


def deinterleave_rope(t: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, dim: int = 0) -> torch.Tensor:
    """`interleave_rope`'s inverse."""
    return _pair_halves(t, head_dim, (num_heads + num_kv_heads) * head_dim, dim, undo=True)


def _rope_args(rope: RopeStore) -> tuple:
    """`_store_rope`'s `rope` tuple."""
    k_cache, v_cache = rope.k_cache, rope.v_cache
    assert rope.cos.stride(-1) == rope.sin_signed.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1
    return (
        rope.cos,
        rope.sin_signed,
        k_cache,
        v_cache,
        rope.slot_mapping,
        rope.cos.stride(0),
        rope.sin_signed.stride(0),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        rope.num_heads,
        k_cache.shape[2],
    )


def _rotate_and_store_output(out: torch.Tensor, rope: RopeStore) -> torch.Tensor:
    """A q/k/v projection's plain output [T, N] in `interleave_rope`'s layout through the RoPE kernel
    (where the matmul could not apply it: its K splits added by the sum kernel): the rotated q [T, H * D]."""
    from kvserve.kernels.gpu import elementwise

    _, _, num_kv_heads, head_dim = rope.k_cache.shape
    heads = rope.num_heads + num_kv_heads
    out = deinterleave_rope(out, rope.num_heads, num_kv_heads, head_dim, dim=1)
    tokens = out.shape[0]
    qk = out[:, : heads * head_dim].view(tokens, heads, head_dim)
    v = out[:, heads * head_dim :].view(tokens, num_kv_heads, head_dim)
    caches = (rope.k_cache, rope.v_cache, rope.slot_mapping)
    q = elementwise.rotate_and_store(qk, v, rope.cos, rope.sin_signed, *caches)
    return q.view(tokens, rope.num_heads * head_dim)


def _row_major(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch(
    kernel: triton.JITFunction,
    config: TileConfig,
    x: torch.Tensor,
    n: int,
    weight_args: tuple,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype | None,
    k: int | None = None,
    counters: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    activation: str | None = None,
    rope: RopeStore | None = None,
    **constexprs,
) -> torch.Tensor:
    """Run one of the matmul kernels over x [M, K] into [M, n], through float32 partial sums per
    K split when the config splits this K; `k`: K where x's columns are not the inputs one for one
    (int8 codes four to a word); `counters`: the layer's `split_counters`, with which each tile's last
    split adds the partial sums (where the call has at most that many tiles), else
    `_sum_splits_kernel` does, a launch more; `weight`, the codes or weights [N, ...] whose rows'
    splits a program may prefetch (`prefetch_lines`); `activation` (the float-input kernels), a gated
    activation of interleaved rows into [M, n / 2] (`GATED_ACTIVATIONS`); `rope` (every matmul kernel),
    RoPE and the KV cache's write of a q/k/v projection, giving q [M, H * D] (`RopeStore`);
    `constexprs`, the kernel's other compile-time switches (ROW_TILES: row tiles a program, the grid's
    rows so many fewer). x may be `NormedRows` (the float-input
    kernels): the norm made in the kernel's prologue and K loop, with its bits."""
    source, k_given = x, k  # (as given, for the call again without RoPE's epilogue)
    if isinstance(x, NormedRows):
        assert kernel in (_float_kernel, _int4_kernel, _int8_kernel) and k is None, kernel
        x = x.x
    assert x.dim() == 2, x.shape
    x = _row_major(x)
    m = x.shape[0]
    k = k or x.shape[1]
    assert config.k_per_split % config.block_k == 0, config
    k_per_split = config.k_per_split or k
    num_splits = cdiv(k, k_per_split)
    grid = (cdiv(m, config.block_m * constexprs.get("ROW_TILES", 1)), cdiv(n, config.block_n), num_splits)
    is_split = num_splits > 1
    sum_in_tile = is_split and counters is not None and grid[0] * grid[1] <= counters.numel()
    gated = GATED_ACTIVATIONS[activation]
    if gated:
        assert n % 2 == 0 and config.block_n % 2 == 0, (n, config)
        constexprs["GATED"] = gated
    width = n // 2 if gated else n
    if rope is not None:
        _, block_size, num_kv_heads, head_dim = rope.k_cache.shape
        assert n == (rope.num_heads + 2 * num_kv_heads) * head_dim and head_dim % 2 == 0, (n, rope.k_cache.shape)
        assert rope.cos.dtype == rope.sin_signed.dtype == (out_dtype or x.dtype), rope.cos.dtype  # q's rounding
        assert not gated
        # the sum kernel stores the output, or a tile would cut a pair (int8 inputs' splits in one program
        # of 128: one column a program): the RoPE kernel follows
        if (is_split and not sum_in_tile) or config.block_n % 2:
            plain = _launch(
                kernel, config, source, n, weight_args, bias, out_dtype, k_given, counters, weight, **constexprs
            )
            return _rotate_and_store_output(plain, rope)
        constexprs.update(rope=_rope_args(rope), ROPE=head_dim, CACHE_BLOCK=block_size)
        width = rope.num_heads * head_dim
    if source is not x:
        constexprs.update(norm=source.args(), NORM=row_width(k), NORM_ADD=source.delta is not None)
    out = torch.empty(m, width, dtype=out_dtype or x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if bias is not None:
        assert bias.shape == (n,), bias.shape
        bias = bias.contiguous()
    # partial sums [splits, M, N] in float32
    partial = torch.empty(num_splits, m, n, dtype=torch.float32, device=x.device) if is_split else out
    recorder = active_timeline()
    if recorder is not None:  # each program's stamps (bench/gpu_timeline.py)
        constexprs["timeline"] = recorder.take(kernel, grid)
    if weight is not None:  # the bytes of a weight row's split
        lines = prefetch_lines(x.device, weight.shape[1] * weight.element_size() * min(k, k_per_split) // k)
        constexprs.update({"PREFETCH_LINES": lines} if lines else {})
    kernel[grid](
        x,
        out,
        partial,
        counters if sum_in_tile else out,
        bias,
        m,
        n,
        k,
        x.stride(0),
        n,
        m * n,
        k_per_split,
        *weight_args,
        HAS_BIAS=bias is not None,
        IS_SPLIT=is_split,
        SUM_IN_TILE=sum_in_tile,
        EVEN_K=k % config.block_k == 0,
        INTERPRET=INTERPRET,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **constexprs,
        **launch_options(x.device),
    )
    if is_split and not sum_in_tile:
        _sum_splits_kernel[(cdiv(m * n, SUM_BLOCK),)](
            partial,
            bias,
            out,
            m * n,
            n,
            num_splits,
            HAS_BIAS=bias is not None,
            BLOCK=SUM_BLOCK,
            INTERPRET=INTERPRET,
            GATED=gated,
            **launch_options(x.device),
        )
    return out


def matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    counters: torch.Tensor | None = None,
    activation: str | None = None,
    rope: RopeStore | None = None,
) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T (+ bias [N]) -> [M, N] in out_dtype (default x's dtype); with
    `activation` (the weight's rows interleaved: `GATED_ACTIVATIONS`), act(gate) * up [M, N / 2]; with
    `rope` (q's and k's rows paired: `RopeStore`), q rotated [M, H * D], k and v written to the cache.

    Products of x's dtype (the weight is converted to it; bfloat16/float16 on the tensor cores,
    float32 as exact float32 products, never TF32), summed in float32; the bias is added in float32
    before the one rounding to out_dtype. out_dtype=torch.float32 gives an lm_head's logits from
    bfloat16 weights without a bfloat16 rounding in between. `counters` (every matmul here): the
    layer's `split_counters`, so that its K splits are added without a launch of their own; the same
    bits without."""
    assert weight.dim() == 2 and weight.shape[1] == x.shape[1], (x.shape, weight.shape)
    weight = _row_major(weight)
    return _launch(
        _float_kernel,
        config_for(FLOAT_CONFIG, *weight.shape),
        x,
        weight.shape[0],
        (weight, weight.stride(0)),
        bias,
        out_dtype,
        counters=counters,
        weight=weight,
        activation=activation,
        rope=rope,
    )


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """int4 codes [N, K] (uint8 values 0..15, K a multiple of 32) packed two per byte -> [N, K // 2]
    uint8 on the codes' device, in GGML's Q4 order: within each group of 32 inputs, byte j (0..15)
    holds input j in its low nibble and input j + 16 in its high nibble."""
    n, k = codes.shape
    assert k % GROUP_SIZE == 0, f"K={k} is not a multiple of {GROUP_SIZE}"
    groups = codes.to(torch.uint8).reshape(n, k // GROUP_SIZE, 2, GROUP_SIZE // 2)
    return (groups[:, :, 0] | (groups[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def to_group_major(
    packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`pack_int4`'s codes [N, K // 2] with their scales and mins [N, K // 32] -> codes [K // 32, N, 16],
    scales and mins [K // 32, N]: each group's outputs one after another, so that threads holding
    consecutive outputs read consecutive bytes. The int4 kernels take either layout with the same bits
    (`int4_matmul`, `int4_int8_matmul`: only their addresses differ)."""
    n, half_k = packed.shape
    codes = packed.reshape(n, half_k // 16, 16).transpose(0, 1).contiguous()
    return codes, scales.t().contiguous(), mins.t().contiguous()


def _int4_layout(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
) -> tuple[int, bool, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """An int4 weight's outputs N, whether it is group major (`to_group_major`), and its tensors made
    row major where they are not, after checking their shapes against x [M, K]."""
    k = x.shape[1]
    group_major = packed.dim() == 3
    n = packed.shape[1] if group_major else packed.shape[0]
    groups = (k // GROUP_SIZE, n) if group_major else (n, k // GROUP_SIZE)
    codes = (k // GROUP_SIZE, n, 16) if group_major else (n, k // 2)
    assert packed.shape == codes and k % GROUP_SIZE == 0, (x.shape, packed.shape)
    assert scales.shape == mins.shape == groups, (scales.shape, mins.shape)
    if group_major:
        assert packed.is_contiguous() and scales.is_contiguous() and mins.is_contiguous()
        return n, True, (packed, scales, mins)
    return n, False, (_row_major(packed), _row_major(scales), _row_major(mins))


def int4_matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    bias: torch.Tensor | None = None,
    packed_bf16: bool = False,
    counters: torch.Tensor | None = None,
    activation: str | None = None,
    rope: RopeStore | None = None,
) -> torch.Tensor:
    """x [M, K] @ W.T (+ bias [N]) -> [M, N] in out_dtype (default x's dtype), W [N, K] given as
    `pack_int4` codes with scales and mins [N, K // 32] (float16, float32 or bfloat16); `activation` and
    `rope` as `matmul`'s.

    Each weight is w = fma(scale, code, min) in float32 (for float16 scales scale * code is exact,
    so that is scale * code + min), rounded to x's dtype; products and sums as `matmul` (float32
    sums, bias in float32, one rounding at the end). So the result is "dequantize W to x's dtype,
    then matmul", with W dequantized tile by tile in registers, never whole.

    packed_bf16 (for bfloat16 x; GpuInt4Linear's default for bfloat16 models since the H200 measured it
    4.5% faster for one stream, bench/gpu_kernels.py's `int4-bf16x2`): scale and min are first rounded
    to bfloat16, and each weight is their fma rounded once to bfloat16, computed two at a time by packed
    bfloat16 FMAs. Scales and mins stored as bfloat16 save the kernel their conversion.

    The weight may be given group major (`to_group_major`): the same bits."""
    n, group_major, (packed, scales, mins) = _int4_layout(x, packed, scales, mins)
    args = (packed, scales, mins, packed.stride(0), scales.stride(0), mins.stride(0))
    config = config_for(INT4_CONFIG, n, x.shape[1])
    switches = {"PACKED_BF16": packed_bf16, **({"GROUP_MAJOR": True} if group_major else {})}
    switches.update(_row_tiles(x, n, config))
    switches.update({} if ALIGNED_GROUPS else {"ALIGNED_GROUPS": False})
    weight = None if group_major else packed  # the prefetch into L2 reads row-major splits
    return _launch(
        _int4_kernel,
        config,
        x,
        n,
        args,
        bias,
        out_dtype,
        counters=counters,
        weight=weight,
        activation=activation,
        rope=rope,
        **switches,
    )


def int4_int8_matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    bias: torch.Tensor | None = None,
    quantized: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    counters: torch.Tensor | None = None,
    rope: RopeStore | None = None,
) -> torch.Tensor:
    """`int4_matmul` with x quantized to int8 per row and group of 32 (llama.cpp's Q8_1 inputs,
    kvserve's `--activations int8` on the CPU; `quantized`: `quantize_int8(x)` if already made): per
    group an exact integer sum over code * q, then two float32 FMAs per output. Without a K split (K at
    most the layer's `k_per_split`) the result is int4_int8.cpp's on the CPU, bit for bit.

    Every row's arithmetic is its own and its sums exact, so the kernel may follow M without changing a
    bit: below INT4_INT8_MMA_ROWS rows dp4a (`_int4_int8_kernel`, its row tile M rounded up), from
    there the tensor cores (`_int4_int8_mma_kernel`, in INT4_INT8_MMA_TILES, on Blackwell's datacenter GPUs
    INT4_INT8_MMA_TILES_BLACKWELL); all with the layer's K splits. The weight may be given group major
    (`to_group_major`): the same bits. `rope` as `matmul`'s."""
    n, group_major, (packed, scales, mins) = _int4_layout(x, packed, scales, mins)
    words = packed.view(torch.int32)  # [N, K / 8] (or [K / 32, N, 4]): four per group of 32
    return _int8_inputs_launch(
        x, n, words, scales, mins, out_dtype, bias, quantized, counters, code_bits=4, group_major=group_major, rope=rope
    )


def int8_int8_matmul(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    bias: torch.Tensor | None = None,
    quantized: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    counters: torch.Tensor | None = None,
    rope: RopeStore | None = None,
) -> torch.Tensor:
    """`int8_group_matmul`'s weights (int8 codes [N, K], a scale per 32 inputs: GGML's Q8_0) times x
    quantized to int8 per row and group of 32 (`quantize_int8`; `quantized` if already made), as
    llama.cpp's Q8_0 x Q8_0: per group an exact integer sum over code * q, then total = fma(scale * d,
    sum, total), group after group. The kernels and tiles of `int4_int8_matmul` (the same bits for any
    number of rows); `rope` as `matmul`'s."""
    n, k = codes.shape
    assert x.shape[1] == k and k % GROUP_SIZE == 0 and codes.dtype == torch.int8, (x.shape, codes.shape)
    assert scales.shape == (n, k // GROUP_SIZE), scales.shape
    codes, scales = _row_major(codes), _row_major(scales)
    words = codes.view(torch.int32)  # [N, K / 4]: eight per group of 32
    return _int8_inputs_launch(
        x, n, words, scales, scales, out_dtype, bias, quantized, counters, code_bits=8, rope=rope
    )


def _int8_inputs_launch(
    x: torch.Tensor,
    n: int,
    words: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    out_dtype: torch.dtype | None,
    bias: torch.Tensor | None,
    quantized: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    counters: torch.Tensor | None,
    code_bits: int,
    group_major: bool = False,
    rope: RopeStore | None = None,
) -> torch.Tensor:
    """The int4 x int8 or int8 x int8 kernel for x's row count: dp4a below INT4_INT8_MMA_ROWS rows (its
    row tile M rounded up), the tensor cores from there (in INT4_INT8_MMA_TILES, or
    INT4_INT8_MMA_TILES_BLACKWELL); the layer's K splits."""
    k = x.shape[1]
    config = config_for(INT4_INT8_CONFIG, n, k)  # its K splits, whichever kernel runs: the same sums
    constexprs = {"GROUP_MAJOR": True} if group_major else {}
    if x.shape[0] >= INT4_INT8_MMA_ROWS:
        tile = next(t for rows, t in int4_int8_mma_tiles(x.device) if rows is None or x.shape[0] <= rows)
        kernel, config = _int4_int8_mma_kernel, dataclasses.replace(config, **tile)
    else:
        kernel, config = _int4_int8_kernel, dataclasses.replace(config, block_m=_row_tile(x.shape[0]))
        splits = k // config.k_per_split
        padded = next_power_of_2(splits)
        whole = k % config.k_per_split == 0 and splits > 1 and padded <= SPLITS_IN_PROGRAM
        groups = config.k_per_split // 32  # a split's, for the words kernel's `_columns`: 4, 8 or 16
        if (
            WORDS_IN_THREADS
            and not group_major
            and k % config.k_per_split == 0
            and groups in (4, 8, 16)  # and at most 32 splits: `_columns`' sizes
            and padded * groups <= WORDS_GROUPS
        ):
            # the program's outputs' rows [BLOCK_N, splits, groups, words] over its threads, as they lie
            assert WORDS_IN_THREADS & (WORDS_IN_THREADS - 1) == 0 and x.shape[0] <= config.block_m, WORDS_IN_THREADS
            row_words = config.block_m * padded * groups * code_bits
            block_n = max(1, WORDS_IN_THREADS // row_words)
            constexprs.update(SPLITS=splits, PADDED=padded, GROUPS=groups)
            kernel = _int4_int8_words_kernel
            config = dataclasses.replace(config, block_n=block_n, k_per_split=0, num_warps=4)
        elif code_bits == 4 and whole:
            # one (split, output) pair a thread, SPLITS_IN_PROGRAM threads a program (an output's splits
            # at most), the splits padded to a power of two
            assert SPLITS_IN_PROGRAM & (SPLITS_IN_PROGRAM - 1) == 0, SPLITS_IN_PROGRAM
            block_n = SPLITS_IN_PROGRAM // padded
            constexprs.update(SPLITS=splits, PADDED=padded, STEPS=config.k_per_split // config.block_k)
            kernel = _int4_int8_splits_kernel  # one program along K: no partial sums for _launch to make
            num_warps = max(1, padded * block_n // 32)
            config = dataclasses.replace(config, block_n=block_n, k_per_split=0, num_warps=num_warps)
    quantized = quantize_int8(x) if quantized is None else quantized
    q = quantized[0]  # a group's eight words are two 128-bit loads on a GPU (common._load4): 16-byte aligned
    assert q.stride(1) == 1 and q.stride(0) % 4 == 0 and q.data_ptr() % 16 == 0, (q.stride(), q.data_ptr() % 16)
    args = (*quantized[1:], words, scales, mins, words.stride(0), scales.stride(0), mins.stride(0))
    out_dtype = out_dtype or x.dtype
    return _launch(
        kernel,
        config,
        quantized[0],
        n,
        args,
        bias,
        out_dtype,
        k=k,
        counters=counters,
        weight=None
        if group_major or kernel in (_int4_int8_splits_kernel, _int4_int8_words_kernel)
        else words,  # the L2 prefetch: row-major splits
        rope=rope,
        CODE_BITS=code_bits,
        **constexprs,
    )


def _row_tile(m: int) -> int:
    """Rows per program of the kernels whose rows are independent: M rounded up to a power of two, at
    most INT4_INT8_CONFIG's block_m."""
    return min(next_power_of_2(max(m, 1)), INT4_INT8_CONFIG.block_m)


def int8_group_matmul(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    bias: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
    activation: str | None = None,
    rope: RopeStore | None = None,
) -> torch.Tensor:
    """x [M, K] @ W.T (+ bias [N]) -> [M, N] in out_dtype (default x's dtype), W[n, k] =
    codes[n, k] * scales[n, k // 32] (GGML's Q8_0: int8 codes [N, K], float32 scales [N, K // 32]);
    `activation` and `rope` as `matmul`'s.

    Each weight is code * scale in float32 rounded to x's dtype, then as `matmul`: the result of
    "dequantize W to x's dtype, then matmul", dequantized tile by tile in registers."""
    n, k = codes.shape
    assert x.shape[1] == k and k % GROUP_SIZE == 0 and codes.dtype == torch.int8, (x.shape, codes.shape)
    assert scales.shape == (n, k // GROUP_SIZE), scales.shape
    codes, scales = _row_major(codes), _row_major(scales)
    args = (codes, scales, codes.stride(0), scales.stride(0))
    config = config_for(INT8_CONFIG, n, k)
    return _launch(
        _int8_kernel,
        config,
        x,
        n,
        args,
        bias,
        out_dtype,
        counters=counters,
        weight=codes,
        activation=activation,
        rope=rope,
        **_row_tiles(x, n, config),
    )
