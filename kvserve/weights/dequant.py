"""Dequantization of GGML block formats to float32, in PyTorch.

Each function takes raw blocks as a uint8 tensor `[num_blocks, type_size]` and returns
`[num_blocks, block_elements]` float32, following the block layouts of ggml (ggml-common.h).
The arithmetic is done in the same order as ggml's reference dequantizers, so results are
bit-for-bit equal to the `gguf` package's numpy reference (tests/test_gguf.py checks it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kvserve.errors import UnsupportedTensorTypeError

QK_K = 256


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """[N, 2] uint8 little-endian halves -> [N, 1] float32."""
    return raw.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[N, G, B] packed bytes -> [N, G, 2B]: the B low nibbles, then the B high nibbles."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks[:, :2])
    q = blocks[:, 2:].contiguous().view(torch.int8).float()
    return q * d


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks[:, :2])
    q = _nibbles(blocks[:, None, 2:])[:, 0].to(torch.int8) - 8  # [N, 32]
    return d * q.float()


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks[:, :2])
    m = _f16(blocks[:, 2:4])
    q = _nibbles(blocks[:, None, 4:])[:, 0].float()  # [N, 32]
    return d * q + m


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """[N, 4] bytes of a little-endian uint32 -> [N, 32] its bits (bit j: value j's fifth bit)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=qh.device).view(1, 1, 8)
    return ((qh[:, :, None] >> shifts) & 1).reshape(-1, 32)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks[:, :2])
    q = _nibbles(blocks[:, None, 6:])[:, 0] | (_fifth_bits(blocks[:, 2:6]) << 4)  # [N, 32] in 0..31
    return d * (q.to(torch.int8) - 16).float()


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    q = _nibbles(blocks[:, None, 8:])[:, 0] | (_fifth_bits(blocks[:, 4:8]) << 4)
    return d * q.float() + m


# IQ4_NL / IQ4_XS: a 4-bit code indexes this non-linear table of int8 values (ggml-common.h).
_IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _iq4(codes: torch.Tensor) -> torch.Tensor:
    return torch.tensor(_IQ4_VALUES, dtype=torch.float32, device=codes.device)[codes.long()]


def _iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks[:, :2])
    return d * _iq4(_nibbles(blocks[:, None, 2:])[:, 0])


def _iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = _f16(blocks[:, 0:2])
    scales_h = blocks[:, 2:4].contiguous().view(torch.int16).to(torch.int32) & 0xFFFF  # [N, 1]
    scales_l = blocks[:, 4:8].to(torch.int32)  # two 4-bit low parts per byte
    low = torch.stack((scales_l & 0x0F, scales_l >> 4), dim=-1).reshape(n, 8)
    high = (scales_h >> torch.arange(0, 16, 2, device=blocks.device).view(1, 8)) & 0x03
    scales = ((low | (high << 4)) - 32).float()  # [N, 8] in -32..31
    dl = (d * scales).view(n, 8, 1)
    codes = _nibbles(blocks[:, 8:136].reshape(n, 8, 16))  # [N, 8, 32]: 16 low nibbles, then 16 high
    return (dl * _iq4(codes)).reshape(n, QK_K)


def _crumbs(qs: torch.Tensor) -> torch.Tensor:
    """[N, 64] bytes of Q2_K / Q3_K -> [N, 16, 16] 2-bit values: each 32-byte half gives 4 x 32
    values, taking bits 0-1, 2-3, 4-5, then 6-7 of its bytes."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=qs.device).view(1, 1, 4, 1)
    return ((qs.reshape(-1, 2, 1, 32) >> shifts) & 3).reshape(-1, 16, 16)


def _q2_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    scales = blocks[:, 0:16]  # per sub-block of 16: scale in the low nibble, min in the high one
    d, dmin = _f16(blocks[:, 80:82]), _f16(blocks[:, 82:84])
    dl = (d * (scales & 0x0F).float()).view(n, 16, 1)
    ml = (dmin * (scales >> 4).float()).view(n, 16, 1)
    return (dl * _crumbs(blocks[:, 16:80]).float() - ml).reshape(n, QK_K)


def _q3_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = _f16(blocks[:, 108:110])
    lo, hi = blocks[:, 96:104], blocks[:, None, 104:108]  # 6-bit scales: 4 low bits, then 2 high bits
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=blocks.device).view(1, 4, 1)
    low = torch.cat((lo & 0x0F, lo >> 4), dim=1)
    high = ((hi >> shifts) & 3).reshape(n, 16)
    scales = ((low | (high << 4)).to(torch.int8) - 32).float()  # [N, 16] in -32..31
    dl = (d * scales).view(n, 16, 1)
    bits = torch.arange(8, dtype=torch.uint8, device=blocks.device).view(1, 8, 1)
    hmask = ((blocks[:, None, 0:32] >> bits) & 1).reshape(n, 16, 16)  # value j: bit j // 32 of byte j % 32
    q = _crumbs(blocks[:, 32:96]).to(torch.int8) - ((hmask ^ 1) << 2).to(torch.int8)  # a clear bit subtracts 4
    return (dl * q.float()).reshape(n, QK_K)


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12-byte, 6-bit scales and mins of Q4_K / Q5_K into two [N, 8] tensors."""
    s = scales.to(torch.int32)
    lo_sc, lo_m, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat((lo_sc & 0x3F, (hi & 0x0F) | ((lo_sc >> 6) << 4)), dim=1)
    mn = torch.cat((lo_m & 0x3F, (hi >> 4) | ((lo_m >> 6) << 4)), dim=1)
    return sc, mn


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, mn = _k_scales(blocks[:, 4:16])
    scale = (d * sc.float()).view(n, 8, 1)
    offset = (dmin * mn.float()).view(n, 8, 1)
    q = _nibbles(blocks[:, 16:144].reshape(n, 4, 32)).reshape(n, 8, 32).float()
    return (scale * q - offset).reshape(n, QK_K)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, mn = _k_scales(blocks[:, 4:16])
    scale = (d * sc.float()).view(n, 8, 1)
    offset = (dmin * mn.float()).view(n, 8, 1)
    low = _nibbles(blocks[:, 48:176].reshape(n, 4, 32)).reshape(n, 8, 32)
    shifts = torch.arange(8, dtype=torch.uint8, device=blocks.device).view(1, 8, 1)
    high = (blocks[:, None, 16:48] >> shifts) & 1  # sub-block s takes bit s of qh
    q = (low | (high << 4)).float()
    return (scale * q - offset).reshape(n, QK_K)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    ql = blocks[:, 0:128].reshape(n, 2, 64)
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32)
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()  # [N, 16]
    d = _f16(blocks[:, 208:210])
    low = torch.cat((ql & 0x0F, ql >> 4), dim=-1)  # [N, 2, 128]
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=blocks.device).view(1, 1, 4, 1)
    high = ((qh >> shifts) & 3).reshape(n, 2, 128)
    q = (low | (high << 4)).to(torch.int8) - 32
    scale = (d * scales).view(n, 16, 1)
    return (scale * q.view(n, 16, 16).float()).reshape(n, QK_K)


BLOCK_DEQUANTIZERS: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    GGMLQuantizationType.Q8_0: _q8_0,
    GGMLQuantizationType.Q4_0: _q4_0,
    GGMLQuantizationType.Q4_1: _q4_1,
    GGMLQuantizationType.Q5_0: _q5_0,
    GGMLQuantizationType.Q5_1: _q5_1,
    GGMLQuantizationType.IQ4_NL: _iq4_nl,
    GGMLQuantizationType.IQ4_XS: _iq4_xs,
    GGMLQuantizationType.Q2_K: _q2_k,
    GGMLQuantizationType.Q3_K: _q3_k,
    GGMLQuantizationType.Q4_K: _q4_k,
    GGMLQuantizationType.Q5_K: _q5_k,
    GGMLQuantizationType.Q6_K: _q6_k,
}
FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
SUPPORTED_TYPES = FLOAT_TYPES + tuple(BLOCK_DEQUANTIZERS)


# ----- codes without dequantization (weights kept quantized in memory) ---------------------------
def _q4_0_groups(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d = _f16(blocks[:, :2])
    return _nibbles(blocks[:, None, 2:])[:, 0], d, -8 * d


def _q4_1_groups(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _nibbles(blocks[:, None, 4:])[:, 0], _f16(blocks[:, :2]), _f16(blocks[:, 2:4])


def _q4_k_groups(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, mn = _k_scales(blocks[:, 4:16])
    codes = _nibbles(blocks[:, 16:144].reshape(n, 4, 32)).reshape(n * 8, 32)
    return codes, (d * sc.float()).reshape(n * 8, 1), -(dmin * mn.float()).reshape(n * 8, 1)


INT4_GROUP_READERS = {
    GGMLQuantizationType.Q4_0: _q4_0_groups,
    GGMLQuantizationType.Q4_1: _q4_1_groups,
    GGMLQuantizationType.Q4_K: _q4_k_groups,
}


def int4_groups(raw: torch.Tensor, qtype: GGMLQuantizationType) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw rows `[rows, row_bytes]` of a 4-bit tensor -> (codes [rows, K] uint8 in 0..15,
    scales [rows, K/32], mins [rows, K/32]) with w = scale * code + min per group of 32 values.

    The products are the ones `dequantize` computes, so Q4_1 and Q4_K values are reproduced
    bit for bit (Q4_0's d * (q - 8) becomes d * q - 8d, equal up to rounding)."""
    rows = raw.shape[0]
    codes, scales, mins = INT4_GROUP_READERS[qtype](raw.reshape(-1, GGML_QUANT_SIZES[qtype][1]))
    return codes.reshape(rows, -1), scales.reshape(rows, -1), mins.reshape(rows, -1)


def q8_0_groups(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw Q8_0 rows -> (codes [rows, K] int8, scales [rows, K/32] float32); w = scale * code."""
    rows = raw.shape[0]
    blocks = raw.reshape(-1, GGML_QUANT_SIZES[GGMLQuantizationType.Q8_0][1])
    codes = blocks[:, 2:].contiguous().view(torch.int8)
    return codes.reshape(rows, -1), _f16(blocks[:, :2]).reshape(rows, -1)


def q5_0_groups(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw Q5_0 rows -> (codes [rows, K] int8 in -16..15, scales [rows, K/32] float32); w = scale * code,
    the same float32 product as `_q5_0`, so exact."""
    rows = raw.shape[0]
    blocks = raw.reshape(-1, GGML_QUANT_SIZES[GGMLQuantizationType.Q5_0][1])
    q = _nibbles(blocks[:, None, 6:])[:, 0] | (_fifth_bits(blocks[:, 2:6]) << 4)
    return (q.to(torch.int8) - 16).reshape(rows, -1), _f16(blocks[:, :2]).reshape(rows, -1)


def q4_0_groups(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw Q4_0 rows -> (codes [rows, K] int8 in -8..7, scales [rows, K/32] float32); w = scale * code,
    the same float32 product as `_q4_0`, so exact (an embedding or lm_head stored so was rounded to
    int8 from its float values, up to a 32nd of a step off)."""
    rows = raw.shape[0]
    blocks = raw.reshape(-1, GGML_QUANT_SIZES[GGMLQuantizationType.Q4_0][1])
    q = _nibbles(blocks[:, None, 2:])[:, 0].to(torch.int8) - 8
    return q.reshape(rows, -1), _f16(blocks[:, :2]).reshape(rows, -1)


def q6_k_parts(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw Q6_K rows -> (codes [rows, K] uint8 in 0..63, scales [rows, K/16] int8, d [rows, K/256]
    float16): w = (d * scale) * (code - 32) in float32, as `_q6_k` computes it (Int6Linear)."""
    rows = raw.shape[0]
    blocks = raw.reshape(-1, GGML_QUANT_SIZES[GGMLQuantizationType.Q6_K][1])
    n = blocks.shape[0]
    ql = blocks[:, 0:128].reshape(n, 2, 64)
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32)
    low = torch.cat((ql & 0x0F, ql >> 4), dim=-1)  # [N, 2, 128]
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=blocks.device).view(1, 1, 4, 1)
    codes = low | (((qh >> shifts) & 3).reshape(n, 2, 128) << 4)
    scales = blocks[:, 192:208].contiguous().view(torch.int8)
    d = blocks[:, 208:210].contiguous().view(torch.float16)
    return codes.reshape(rows, -1), scales.reshape(rows, -1), d.reshape(rows, -1)


def q5_1_parts(raw: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Raw Q5_1 rows -> (codes [rows, K] uint8 in 0..31, scales and mins [rows, K/32] float16):
    w = scale * code + min, as `_q5_1` computes it (Int5Linear)."""
    rows = raw.shape[0]
    blocks = raw.reshape(-1, GGML_QUANT_SIZES[GGMLQuantizationType.Q5_1][1])
    q = _nibbles(blocks[:, None, 8:])[:, 0] | (_fifth_bits(blocks[:, 4:8]) << 4)
    halves = blocks[:, :4].contiguous().view(torch.float16)  # [N, 2]: d, m
    return q.reshape(rows, -1), halves[:, 0].reshape(rows, -1), halves[:, 1].reshape(rows, -1)


def q5_k_parts(raw: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Raw Q5_K rows -> (codes [rows, K] uint8 in 0..31, 6-bit scales and mins [rows, K/32] uint8, d and
    dmin [rows, K/256] float16): w = (d * scale) * code - dmin * min in float32, as `_q5_k` (Int5Linear)."""
    rows = raw.shape[0]
    blocks = raw.reshape(-1, GGML_QUANT_SIZES[GGMLQuantizationType.Q5_K][1])
    n = blocks.shape[0]
    sc, mn = _k_scales(blocks[:, 4:16])
    low = _nibbles(blocks[:, 48:176].reshape(n, 4, 32)).reshape(n, 8, 32)
    shifts = torch.arange(8, dtype=torch.uint8, device=blocks.device).view(1, 8, 1)
    codes = low | (((blocks[:, None, 16:48] >> shifts) & 1) << 4)  # sub-block s takes bit s of qh
    return _k_quant_parts(blocks, codes, sc, mn, rows)


def q4_k_parts(raw: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Raw Q4_K rows -> (codes [rows, K] uint8 in 0..15, 6-bit scales and mins [rows, K/32] uint8, d and
    dmin [rows, K/256] float16): w = (d * scale) * code - dmin * min in float32, as `_q4_k` computes it
    (Int4QuadsLinear; `_q4_k_groups` gives the same products as float32 scales and mins)."""
    rows = raw.shape[0]
    blocks = raw.reshape(-1, GGML_QUANT_SIZES[GGMLQuantizationType.Q4_K][1])
    n = blocks.shape[0]
    sc, mn = _k_scales(blocks[:, 4:16])
    codes = _nibbles(blocks[:, 16:144].reshape(n, 4, 32)).reshape(n, 8, 32)
    return _k_quant_parts(blocks, codes, sc, mn, rows)


def _k_quant_parts(
    blocks: torch.Tensor, codes: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor, rows: int
) -> tuple[torch.Tensor, ...]:
    """Q4_K's or Q5_K's parts by rows: the codes, the 6-bit scales and mins as bytes, d and dmin (the
    blocks' first four bytes, float16)."""
    halves = blocks[:, :4].contiguous().view(torch.float16)  # [N, 2]: d, dmin
    return (
        codes.reshape(rows, -1),
        sc.to(torch.uint8).reshape(rows, -1),
        mn.to(torch.uint8).reshape(rows, -1),
        halves[:, 0].reshape(rows, -1),
        halves[:, 1].reshape(rows, -1),
    )


# Types held as 5-bit codes with a scale and a min per 32 values (Int5Linear), and their readers.
INT5_READERS: dict[GGMLQuantizationType, Callable[[torch.Tensor], tuple[torch.Tensor, ...]]] = {
    GGMLQuantizationType.Q5_1: q5_1_parts,
    GGMLQuantizationType.Q5_K: q5_k_parts,
}


# Types whose values are int8 codes times a float scale per 32: kept so, exactly (Int8GroupLinear).
INT8_GROUP_READERS: dict[GGMLQuantizationType, Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]] = {
    GGMLQuantizationType.Q8_0: q8_0_groups,
    GGMLQuantizationType.Q5_0: q5_0_groups,
    GGMLQuantizationType.Q4_0: q4_0_groups,
}


def dequantize(raw: torch.Tensor, qtype: GGMLQuantizationType, num_elements_per_row: int) -> torch.Tensor:
    """Raw bytes `[rows, row_bytes]` (uint8) of a tensor stored as `qtype` -> float32 `[rows, elements]`."""
    rows = raw.shape[0]
    raw = raw.reshape(rows, -1)
    if qtype == GGMLQuantizationType.F32:
        return raw.contiguous().view(torch.float32).clone()
    if qtype == GGMLQuantizationType.F16:
        return raw.contiguous().view(torch.float16).float()
    if qtype == GGMLQuantizationType.BF16:
        return raw.contiguous().view(torch.bfloat16).float()
    fn = BLOCK_DEQUANTIZERS.get(qtype)
    if fn is None:
        name = getattr(qtype, "name", str(qtype))
        raise UnsupportedTensorTypeError(
            f"GGUF tensor type {name} is not supported; kvserve dequantizes "
            f"{', '.join(t.name for t in SUPPORTED_TYPES)}. Re-quantize the model to one of those."
        )
    type_size = GGML_QUANT_SIZES[qtype][1]
    blocks = raw.reshape(-1, type_size)
    return fn(blocks).reshape(rows, num_elements_per_row)
