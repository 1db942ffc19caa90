"""A typed wrapper per C++ op. Each needs the extension loaded (`available()`); callers check that
first and otherwise take their PyTorch path. Shapes: x [M, K] activations, weights [N, K] (or
packed), results [M, N]."""

from __future__ import annotations

from typing import Any

import torch

from kvserve.kernels import build


def available() -> bool:
    """Whether the C++ kernels are loaded (and not turned off by KVSERVE_FUSED_DECODE=0)."""
    return build.loaded() is not None


def _ext() -> Any:
    extension = build.loaded()
    if extension is None:
        raise RuntimeError("kvserve's C++ kernels are not loaded; check kernels.ops.available() first")
    return extension


def int8_activations() -> bool:
    """Whether int4_mm can quantize its inputs to int8 on this CPU (AVX2, F16C and FMA)."""
    return bool(_ext().int8_activations())


def amx() -> bool:
    """Whether this build runs AMX tiles (Sapphire Rapids and later)."""
    return bool(_ext().amx())


def amx_min_rows() -> int:
    """Rows from which the lm_head kernel's AMX tiles beat its float tiles."""
    return int(_ext().amx_min_rows())


def int4_mm(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales_mins: torch.Tensor,
    n: int,
    group_size: int,
    block_rows: int,
    int8: bool,
) -> torch.Tensor:
    """x @ W.T for W in PyTorch's CPU int4 packing (`block_rows` rows per packed block), with
    (scale, min) per group as [K / g, 2, N]; inputs quantized to int8 per group when `int8`."""
    return _ext().int4_mm(x, packed, scales_mins, n, group_size, block_rows, int8)


def dequantize_int4(
    packed: torch.Tensor,
    scales_mins: torch.Tensor,
    n: int,
    k: int,
    group_size: int,
    block_rows: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The transposed weight W.T [K, N] of `int4_mm`'s operands, in `dtype`."""
    return _ext().dequantize_int4(packed, scales_mins, n, k, group_size, block_rows, dtype)


def int8_group_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, amx_min_rows: int) -> torch.Tensor:
    """x @ (codes * scales per group of 32).T in float32 (the Q8_0 lm_head); bfloat16 inputs take
    AMX tiles from `amx_min_rows` rows where the CPU has them."""
    return _ext().int8_group_matmul(x, codes, scales, amx_min_rows)


def dequantize_int8_groups(
    codes: torch.Tensor, scales: torch.Tensor, begin: int, end: int, dtype: torch.dtype
) -> torch.Tensor:
    """Rows begin:end of the weight codes * scales (per group of 32), in `dtype`."""
    return _ext().dequantize_int8_groups(codes, scales, begin, end, dtype)


def float32_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T in float32 for a float32 or bfloat16 weight, the same arithmetic for every row."""
    return _ext().float32_matmul(x, weight)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first index of its largest value (NaN counts as largest), [B] int64, for float32
    logits [B, V]: torch.argmax's answer."""
    return _ext().argmax_rows(logits)


def decode_forward(*args: Any) -> torch.Tensor:
    """The layer loop of a Llama model over T tokens (see layers/fused_decode.FusedDecoder)."""
    return _ext().decode_forward(*args)
