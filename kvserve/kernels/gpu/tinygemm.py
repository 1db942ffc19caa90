"""PyTorch's own int4 kernel on CUDA ("tinygemm", `aten._weight_int4pack_mm`, which gpt-fast and torchao
run for 4-bit decoding): a candidate beside kvserve's Triton int4 kernels, off until a GPU measures it
(issue 32 names it among the choices; `bench/gpu.py`'s `q4-tinygemm`, `bench/gpu_kernels.py`'s
`int4-tinygemm`).

What it computes, from PyTorch's int4mm.cu: each weight is `fma(code - 8, scale, zero)` in bfloat16
(`__hfma2`, one rounding), then bfloat16 tensor-core products summed in float32, given in bfloat16.
kvserve's weights are `scale * code + min` per group of 32, so `zero = min + 8 * scale`, rounded to
bfloat16 like the scale: other bits than the Triton kernels' (which keep float16 or float32 scales
and mins and round each weight once from them), by design, as `packed_bf16` is.

Batch invariance (R7): the kernel has one configuration (8 warps, 8 K tiles a warp) for every row
count; a block computes 8 outputs of one tile of 16 rows over all of K, its warps' sums added in warp
order. So a row's sums do not depend on the rows beside it; `tests/test_cuda.py` checks that on a GPU.

Only a CUDA GPU of compute capability 8.0 or later runs it (PyTorch has no such kernel for the CPU's
layout of these bytes); the packing below is plain torch and is tested on the CPU.
"""

from __future__ import annotations

import torch

GROUP_SIZE = 32  # inputs per scale and zero, as kvserve's 4-bit weights hold them


def supported(device: torch.device | str) -> bool:
    """Whether `device` runs the kernel: a CUDA GPU of compute capability 8.0 or later."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 8


def code_pairs(codes: torch.Tensor) -> torch.Tensor:
    """int4 codes [N, K] (values 0..15) as the kernel's packing takes them: [N, K // 2] uint8, byte i
    holding input 2i in its high nibble and input 2i + 1 in its low one (gpt-fast's order)."""
    codes = codes.to(torch.uint8)
    return ((codes[:, 0::2] << 4) | codes[:, 1::2]).contiguous()


def scales_and_zeros(scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """Per group of 32 inputs, (scale, zero) with w = (code - 8) * scale + zero for kvserve's
    w = scale * code + min: [K // 32, N, 2] bfloat16, zero = min + 8 * scale computed in float32."""
    scales, mins = scales.float(), mins.float()
    return torch.stack([scales, mins + 8 * scales], dim=-1).to(torch.bfloat16).transpose(0, 1).contiguous()


def inner_k_tiles(k: int) -> int:
    """The kernel's K tiles (of 16 inputs) packed side by side: the widest load (8: 16 bytes) that K allows."""
    return next(t for t in (8, 4, 2) if k % (16 * t) == 0)


def takes(n: int, k: int) -> bool:
    """Whether the kernel takes an [n, k] weight: n a multiple of 8 (its column tiles), k of 32."""
    return n % 8 == 0 and k % GROUP_SIZE == 0


def pack(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the codes in the kernel's layout, int32 [N / 8, K / (16 t), 32, t / 2]; its scales and zeros)
    for a weight of codes [N, K] (0..15) and (scale, min) per 32 inputs, on the codes' device (a CUDA
    GPU: the layout is made by PyTorch's CUDA kernel)."""
    n, k = codes.shape
    if not takes(n, k):
        raise ValueError(
            f"PyTorch's int4 kernel takes a multiple of 8 outputs and of {GROUP_SIZE} inputs, not {n} x {k}"
        )
    packed = torch.ops.aten._convert_weight_to_int4pack(code_pairs(codes), inner_k_tiles(k))
    return packed, scales_and_zeros(scales, mins).to(codes.device)


def matmul(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ W.T in bfloat16 ([M, N]), W as `pack` made it."""
    return torch.ops.aten._weight_int4pack_mm(x.to(torch.bfloat16).contiguous(), packed, GROUP_SIZE, scales_zeros)


def dequantized(pairs: torch.Tensor, scales_zeros: torch.Tensor) -> torch.Tensor:
    """The weights [N, K] the kernel computes from `code_pairs` and `scales_and_zeros`, in float32: each
    fma(code - 8, scale, zero) rounded to bfloat16 (in float32 first, which is exact unless zero and
    the product lie more than 12 binary orders apart). The reference of the tests."""
    n = pairs.shape[0]
    codes = torch.stack([pairs >> 4, pairs & 15], dim=-1).reshape(n, -1).float() - 8
    groups = scales_zeros.float().transpose(0, 1).repeat_interleave(GROUP_SIZE, dim=1)  # [N, K, 2]
    return (codes * groups[..., 0] + groups[..., 1]).to(torch.bfloat16).float()
