"""The quads layout of int8-group weights (kvserve/kernels/csrc/int8_quads.cpp): codes stored 16 output
rows x 4 inputs interleaved, so that one vpdpbusd (AVX512-VNNI; vpmaddubsw and vpmaddwd on AVX2) multiplies
16 rows' codes by four inputs.

Per vector of 16 output rows and group of 32 inputs the codes are eight 64-byte vectors (j = 0..7:
inputs 4j..4j+3 of the group, each 16 rows x 4), held at one of two widths:

- 8 bits: `[V / 16, K / 4, 16, 4]` uint8, each code + 128 (GGML's Q8_0, and types rounded to int8);
- 5 bits: `[V / 16, K / 32, 320]` uint8 where every code lies in -16..15 (GGML's Q5_0): each code + 16,
  bytes 0..255 four vectors of nibbles (vector t: vector 2t's low 4 bits in the low nibble, vector
  2t + 1's in the high one), bytes 256..319 a 64-byte plane of fifth bits (byte i's bit j: the fifth
  bit of vector j's byte i; one shift puts vector j's at bit 4 of every byte). 5 bits a code, as the
  file holds them.

The scales are `[V / 16, K / 32, 16]`: float16 where every scale is one (the file's own, Q8_0 and
Q5_0), float32 otherwise. Either width and scale type gives the kernel the same integers and
floats, so the same bits.

GGML's Q5_1 and Q5_K have a min per group besides the scale (w = scale * code + min, codes 0..31):
`to_q5_quads` holds their codes in the 5-bit layout as GGML's 0..31 (no offset), with Q5_1's float16
scales and mins `[V / 16, K / 32, 2, 16]` (6 bits a weight, as the file), or Q5_K's "K-quant scales"
`[V / 16, K / 256, 320]` uint8: per block of 256 inputs the 6-bit scales [8 groups][16 rows] and mins
[8][16] a byte each, then the rows' float16 d [16] and dmin [16] (5.625 bits a weight, the file 5.5).

GGML's Q4_0 and Q4_1 (4-bit codes 0..15 with a float16 scale and min per group: Q4_0's code - 8 taken
as min = -8 * scale) are held by `to_q4_quads` as the 5-bit layout's four nibble vectors alone,
`[V / 16, K / 32, 256]`, with Q5_1's scales and mins: the file's bytes for Q4_1, 20 against 18 per 32
for Q4_0. Q4_K's (`to_k4_quads`) take Q5_K's scale bytes. The kernel's integer sums and float steps are
int4_int8.cpp's, in its order: the same bits as those codes packed for `int4_mm`, but arranged once at
load instead of on every call.

GGML's Q6_K has a scale per 16 inputs (int8, times a float16 one per 256): `to_k6_quads` holds it
as stored, 6 bits a code, `[V / 16, K / 32, 384]` (the 5-bit layout's nibbles, then two vectors of
2-bit crumbs: vector u's byte i, bits 2t and 2t + 1, are the fifth and sixth bits of vector 4u + t's
byte i), each code as GGML's 0..63, with "K-quant scales" `[V / 16, K / 256, 288]` uint8 (per block of
256 inputs the int8 scales [16 sub-blocks][16 rows], then the float16 ones of the 16 rows): the file's
6.5625 bits a weight.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.nn.functional as F

GROUP = 32
FIVE_BIT_BYTES = 320  # per vector of 16 rows and group of 32 inputs
FOUR_BIT_BYTES = 256
SIX_BIT_BYTES = 384
K_SCALE_BYTES = 288  # per vector of 16 rows and block of 256 inputs (Q6_K's scales)
K5_SCALE_BYTES = 320  # the same for Q5_K's scales and mins
_CHUNK_VECTORS = 256  # vectors (of 16 rows) arranged per step: temporaries of a few MB


@functools.cache
def _cpu_flags() -> set[str]:
    """The CPU's feature flags, from Linux's /proc/cpuinfo (empty where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((line for line in text.splitlines() if line.startswith("flags")), "").split())


def int4_quads_cpu() -> bool:
    """Whether Q4_0, Q4_1 and Q4_K layers are held as 4-bit quads (Int4QuadsLinear) rather than for int4_mm:
    where the quads kernel runs and the CPU has no AMX tiles. With AMX both forms unpack the codes into
    tile bytes on each call, and int4_mm's tile kernel is the one measured on tiles (the bits are the
    same either way)."""
    return quads_cpu() and "amx_int8" not in _cpu_flags()


@functools.cache
def quads_cpu() -> bool:
    """Whether this CPU has AVX2, FMA and F16C, as int8_quads.cpp needs (vpmaddubsw, or vpdpbusd where it
    has AVX512-VNNI and AVX512BW; the kernels build with -march=native): asked of Linux's
    /proc/cpuinfo, so that a layer can be arranged at load, before the C++ kernels have loaded (they
    say for sure: ops.int8_quads_usable(); a layer whose guess was wrong is arranged back on its first
    call)."""
    return {"avx2", "fma", "f16c"} <= _cpu_flags()


def code_bits(quads: torch.Tensor) -> int:
    """8, 5 or 4: the width a quads tensor holds its codes at."""
    if quads.dim() == 4:
        return 8
    return 4 if quads.shape[-1] == FOUR_BIT_BYTES else 5


def to_quads(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(quads, quad_scales) of row-major codes [N, K] int8 and scales [N, K / 32] float32: 5 bits where
    every code fits, float16 scales where every scale is one; rows past N to a multiple of 16 zero."""
    n, k = codes.shape
    rows = -(-n // 16) * 16
    codes = F.pad(codes, (0, 0, 0, rows - n))
    scales = F.pad(scales, (0, 0, 0, rows - n))
    vectors, groups = rows // 16, k // GROUP
    five = bool(codes.min() >= -16) and bool(codes.max() <= 15)
    quads = torch.empty((vectors, groups, FIVE_BIT_BYTES) if five else (vectors, k // 4, 16, 4), dtype=torch.uint8)
    for start in range(0, vectors, _CHUNK_VECTORS):
        end = min(start + _CHUNK_VECTORS, vectors)
        # [v, 16, G, 8, 4] -> [v, G, 8, 16, 4]: vector j of group g is 16 rows x inputs 4j..4j+3
        part = codes[start * 16 : end * 16].view(end - start, 16, groups, 8, 4).permute(0, 2, 3, 1, 4)
        if five:
            quads[start:end] = _pack_five((part + 16).view(torch.uint8).reshape(end - start, groups, 8, 64))
        else:
            quads[start:end] = (part.view(torch.uint8) ^ 0x80).reshape(end - start, k // 4, 16, 4)
    by_16 = by_16_rows(scales)
    half = by_16.half()
    return quads, half if torch.equal(half.float(), by_16) else by_16


def by_16_rows(per_row: torch.Tensor) -> torch.Tensor:
    """[rows, groups] values as [rows / 16, groups, 16]: each group's values of 16 rows side by side."""
    return per_row.view(per_row.shape[0] // 16, 16, -1).permute(0, 2, 1).contiguous()


def to_row_major(quads: torch.Tensor, quad_scales: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The row-major (codes [n, K] int8, scales [n, K / 32] float32) of to_quads' result."""
    vectors, groups = quads.shape[0], quad_scales.shape[1]
    codes = _unsigned_vectors(quads).view(vectors, groups, 8, 16, 4).permute(0, 3, 1, 2, 4)
    codes = (codes.reshape(vectors * 16, groups * GROUP).to(torch.int16) - _offset(quads)).to(torch.int8)
    scales = quad_scales.float().permute(0, 2, 1).reshape(vectors * 16, groups)
    return codes[:n].contiguous(), scales[:n].contiguous()


def rows_of(quads: torch.Tensor, quad_scales: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows `ids` [T] of the weight as (codes [T, K] int8, scales [T, K / 32] float32): an embedding's
    lookup from the quads of the lm_head tied to it."""
    vector, row = ids // 16, ids % 16
    vectors, groups = quad_scales.shape[:2]
    # only the rows' own bytes: each row's four in each 64-byte vector (8 bits: the 8 code vectors; 5 bits:
    # the 4 nibble vectors and the plane, then unpacked as whole vectors are), [T, G, 8, 4]
    if code_bits(quads) == 8:
        codes = quads.view(vectors, groups, 8, 16, 4)[vector, :, :, row]
    else:
        codes = _unsigned_vectors(quads.view(vectors, groups, 5, 16, 4)[vector, :, :, row].flatten(2), width=4)
    codes = (codes.reshape(ids.numel(), groups * GROUP).to(torch.int16) - _offset(quads)).to(torch.int8)
    return codes, quad_scales[vector, :, row].float()


def to_k6_quads(codes: torch.Tensor, scales: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(quads, K-quant scales) of Q6_K's codes [N, K] uint8 in 0..63, scales [N, K / 16] int8 and d
    [N, K / 256] float16 (dequant.q6_k_parts), N a multiple of 16."""
    n, k = codes.shape
    vectors, groups, blocks = n // 16, k // GROUP, k // 256
    u = codes.view(vectors, 16, groups, 8, 4).permute(0, 2, 3, 1, 4).reshape(vectors, groups, 8, 64)
    nibbles = _nibble_vectors(u)
    high = (u >> 4) & 3
    crumbs = torch.zeros(vectors, groups, 2, 64, dtype=torch.uint8)
    for t in range(4):
        crumbs |= high[:, :, t::4] << (2 * t)  # vector 4u + t into crumb vector u
    quads = torch.cat([nibbles.flatten(2), crumbs.flatten(2)], dim=2)
    sub = scales.view(vectors, 16, blocks, 16).permute(0, 2, 3, 1).reshape(vectors, blocks, 256).view(torch.uint8)
    block = d.view(vectors, 16, blocks).permute(0, 2, 1).contiguous().view(torch.uint8)  # [v, B, 32]
    return quads.contiguous(), torch.cat([sub, block], dim=2).contiguous()


def k6_parts(quads: torch.Tensor, k_scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (codes, scales, d) to_k6_quads was made from."""
    vectors, groups = quads.shape[:2]
    low = _low_vectors(quads)
    crumbs = quads[..., 256:].view(vectors, groups, 2, 1, 64)
    high = (crumbs >> torch.arange(0, 8, 2, dtype=torch.uint8).view(1, 1, 1, 4, 1)) & 3  # [v, G, u, t, 64]
    codes = low | (high.view(vectors, groups, 8, 64) << 4)
    codes = codes.view(vectors, groups, 8, 16, 4).permute(0, 3, 1, 2, 4).reshape(vectors * 16, groups * GROUP)
    blocks = k_scales.shape[1]
    sub = k_scales[..., :256].contiguous().view(torch.int8).view(vectors, blocks, 16, 16)
    d = k_scales[..., 256:].contiguous().view(torch.float16).view(vectors, blocks, 16)
    return (
        codes.contiguous(),
        sub.permute(0, 3, 1, 2).reshape(vectors * 16, blocks * 16),
        d.permute(0, 2, 1).reshape(vectors * 16, blocks),
    )


def k6_dequantize(quads: torch.Tensor, k_scales: torch.Tensor) -> torch.Tensor:
    """The float32 weight [N, K], as GGML (and dequant._q6_k) computes it: (d * scale) * (code - 32)."""
    codes, scales, d = k6_parts(quads, k_scales)
    n, k = codes.shape
    scale = (d.float().repeat_interleave(16, dim=1) * scales.float()).view(n, k // 16, 1)
    return (scale * (codes.to(torch.int8) - 32).view(n, k // 16, 16).float()).view(n, k)


def to_q5_quads(kind: str, parts: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(quads, scales) of Q5_1's (codes [N, K] uint8 in 0..31, scales, mins [N, K / 32] float16) or Q5_K's
    (codes, scales, mins [N, K / 32] uint8, d, dmin [N, K / 256] float16) (dequant.q5_1_parts /
    q5_k_parts), N a multiple of 16."""
    codes = parts[0]
    n, k = codes.shape
    vectors, groups = n // 16, k // GROUP
    u = codes.view(vectors, 16, groups, 8, 4).permute(0, 2, 3, 1, 4).reshape(vectors, groups, 8, 64)
    held = _pack_five(u).contiguous()
    if kind == "Q5_1":
        scales, mins = (by_16_rows(t) for t in parts[1:])  # [v, G, 16] each
        return held, torch.stack([scales, mins], dim=2).contiguous()
    return held, _k_quant_scales(parts[1:])


def to_k4_quads(parts: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(quads [N / 16, K / 32, 256] uint8, K-quant scales [N / 16, K / 256, 320] uint8) of Q4_K's parts
    (dequant.q4_k_parts: codes [N, K] in 0..15, 6-bit scales and mins [N, K / 32], d and dmin [N, K / 256]
    float16), N a multiple of 16: the 4-bit quads with Q5_K's scale bytes (Int4QuadsLinear)."""
    return _pack_four(parts[0]), _k_quant_scales(parts[1:])


def _pack_four(codes: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] in 0..15 -> [N / 16, K / 32, 256] uint8: the 5-bit layout's four nibble vectors."""
    n, k = codes.shape
    vectors, groups = n // 16, k // GROUP
    u = codes.to(torch.uint8).view(vectors, 16, groups, 8, 4).permute(0, 2, 3, 1, 4).reshape(vectors, groups, 8, 64)
    return _nibble_vectors(u).reshape(vectors, groups, FOUR_BIT_BYTES).contiguous()


def _k_quant_scales(parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Q5_K's (or Q4_K's) 6-bit scales and mins [N, K / 32] uint8 and d and dmin [N, K / 256] float16 as
    [N / 16, K / 256, 320] uint8: per block of 256 inputs the scales [8 groups][16 rows], the mins, then
    the 16 rows' d and dmin."""
    n, blocks = parts[0].shape[0], parts[0].shape[1] // 8
    vectors = n // 16
    sub = [t.view(vectors, 16, blocks, 8).permute(0, 2, 3, 1).reshape(vectors, blocks, 128) for t in parts[0:2]]
    block = [by_16_rows(t).view(torch.uint8) for t in parts[2:]]  # [v, B, 32] each
    return torch.cat([*sub, *block], dim=2).contiguous()


def to_q4_quads(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(quads [N / 16, K / 32, 256] uint8, scales and mins [N / 16, K / 32, 2, 16] float16) of 4-bit codes
    [N, K] in 0..15 with a scale and a min [N, K / 32] each exact in float16, N a multiple of 16."""
    scales, mins = (by_16_rows(t.half()) for t in (scales, mins))  # [v, G, 16] each
    return _pack_four(codes), torch.stack([scales, mins], dim=2).contiguous()


def q5_parts(quads: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The parts to_q5_quads (or to_q4_quads) was made from (Q5_1's three or Q5_K's five)."""
    vectors, groups = quads.shape[:2]
    codes = _unsigned_vectors(quads).view(vectors, groups, 8, 16, 4).permute(0, 3, 1, 2, 4)
    codes = codes.reshape(vectors * 16, groups * GROUP).contiguous()
    if scales.dtype == torch.float16:  # Q5_1: [v, G, 2, 16]
        return codes, *(scales[:, :, i].permute(0, 2, 1).reshape(vectors * 16, groups) for i in range(2))
    blocks = scales.shape[1]
    sub = [scales[..., i : i + 128].reshape(vectors, blocks, 8, 16) for i in (0, 128)]
    block = [scales[..., i : i + 32].contiguous().view(torch.float16) for i in (256, 288)]  # [v, B, 16]
    return (
        codes,
        *(t.permute(0, 3, 1, 2).reshape(vectors * 16, groups) for t in sub),
        *(t.permute(0, 2, 1).reshape(vectors * 16, blocks) for t in block),
    )


def q5_dequantize(quads: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 weight [N, K], as GGML (dequant._q5_1, _q5_k) computes it: scale * code + min for
    Q5_1, (d * scale) * code - dmin * min for Q5_K."""
    parts = q5_parts(quads, scales)
    codes = parts[0]
    n, k = codes.shape
    q = codes.view(n, k // GROUP, GROUP).float()
    if len(parts) == 3:
        scale, mins = (t.float()[..., None] for t in parts[1:])
        return (scale * q + mins).view(n, k)
    _, sc, mn, d, dmin = parts
    scale = (d.float().repeat_interleave(8, dim=1) * sc.float())[..., None]
    offset = (dmin.float().repeat_interleave(8, dim=1) * mn.float())[..., None]
    return (scale * q - offset).view(n, k)


def _offset(quads: torch.Tensor) -> int:
    return 128 if code_bits(quads) == 8 else 16


def _pack_five(u: torch.Tensor) -> torch.Tensor:
    """[v, G, 8, 64] codes 0..31 (uint8) -> [v, G, 320] in the 5-bit layout."""
    nibbles = _nibble_vectors(u)
    fifth = (u >> 4) & 1  # [v, G, 8 vectors, 64 bytes]
    plane = torch.zeros(*u.shape[:2], 64, dtype=torch.uint8)
    for j in range(8):
        plane |= fifth[:, :, j] << j
    return torch.cat([nibbles.flatten(2), plane], dim=2)


def _unsigned_vectors(quads: torch.Tensor, width: int = 64) -> torch.Tensor:
    """[v, G, 8, width] uint8: each vector's codes plus the offset, from either width (`width` bytes a
    vector: 64 as held, fewer where rows_of took some rows' bytes)."""
    v = quads.shape[0]
    if code_bits(quads) == 8:
        return quads.reshape(v, -1, 8, width)
    groups = quads.shape[1]
    low = _low_vectors(quads, width)
    if code_bits(quads) == 4:
        return low
    plane = quads[..., 4 * width :].view(v, groups, 1, width)
    fifth = (plane >> torch.arange(8, dtype=torch.uint8).view(8, 1)) & 1  # [v, G, 8 vectors, width bytes]
    return low | (fifth << 4)


def _nibble_vectors(u: torch.Tensor) -> torch.Tensor:
    """[v, G, 8, 64] codes -> [v, G, 4, 64]: vector t holds vector 2t's low 4 bits, then vector 2t + 1's."""
    return (u[:, :, 0::2] & 0x0F) | ((u[:, :, 1::2] & 0x0F) << 4)


def _low_vectors(quads: torch.Tensor, width: int = 64) -> torch.Tensor:
    """The low 4 bits of the eight code vectors [v, G, 8, width] from the 5- or 6-bit layout's nibbles."""
    vectors, groups = quads.shape[:2]
    nibbles = quads[..., : 4 * width].view(vectors, groups, 4, width)
    return torch.stack([nibbles & 0x0F, nibbles >> 4], dim=3).view(vectors, groups, 8, width)
