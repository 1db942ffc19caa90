"""Weight-only quantized layers on PyTorch's own CPU kernels.

- `Int4Linear`: 4-bit codes in groups of 32 along the input dimension, one (scale, min) pair per
  group, the codes packed in the layout of `aten._weight_int4pack_mm_for_cpu`. GGML's Q4_0 / Q4_1 / Q4_K blocks are
  exactly this shape (w = scale * code + min), so they are repacked without loss.
- `Int8Linear`: int8 with one scale per output row, for `aten._weight_int8pack_mm`.
- `Int8GroupLinear`: int8 codes with a scale per 32 inputs (GGML's Q8_0 and Q5_0 exactly), row-major
  or in the quads layout (layers/quads.py: Q5_0 at 5 bits) for kvserve's C++ kernels.
- `StoredQuadsLinear`: a GGML type held as stored in the quads layout, with its own scales:
  `Int6Linear` (Q6_K: 6-bit quads, scales per 16 and 256 inputs), `Int5Linear` (Q5_1 and Q5_K:
  5-bit quads, a scale and a min per 32 inputs) and `Int4QuadsLinear` (Q4_0, Q4_1 and Q4_K with int8
  inputs on a CPU without AMX: 4-bit quads, a scale and a min per 32 inputs).
- `Int8Embedding`: int8 rows with one scale per group of 32, dequantized only for the looked-up
  rows (GGML's Q8_0 is exactly this shape).

Activations stay in the compute dtype (bfloat16 or float32); with activations="int8", on a CPU
with AVX2, Int4Linear quantizes its inputs to int8 per group of 32 for integer products with the
codes (ACTIVATION_CHOICES). It keeps each group's scale and min as float16 when that is exact (GGUF stores
them so for Q4_0 and Q4_1), else float32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.kernels import ops
from kvserve.layers import quads

GROUP_SIZE = 32
# Rows converted per step while quantizing or packing a weight, so that the temporaries (float
# groups, int32 codes) stay a few MB even for a 49152-row lm_head. A multiple of 64: the CPU int4
# packing works in blocks of 64 rows, so packing in pieces gives the same bytes as packing whole.
CHUNK_ROWS = 4096
# Without batch invariance, Int4Linear multiplies up to INT4_FEW_ROWS rows (decode steps) with the
# C++ int4_mm, which unpacks each code once per call, and more rows (prefill) as a float GEMM over the
# weight dequantized in C++, which wins once there are enough rows to share the unpacking.
INT4_FEW_ROWS = 64
# Where PyTorch's bfloat16 GEMM runs on AMX tiles (Sapphire Rapids and later) it wins from fewer rows.
INT4_FEW_ROWS_AMX_BF16 = 32
# activations="int8": Int4Linear's inputs quantized to int8 per group of 32 (x ~ d * q, d = max|x| / 127)
# and multiplied into the codes in integers (32 products per AVX2 instruction against a float FMA's 8),
# as llama.cpp's CPU backend does. The rounding flips near-ties as llama.cpp's does (the greedy token
# as transformers' at 95-97% of positions: bench/results/numerics.json); "auto" (the default) takes
# it on an AVX2 CPU, as llama.cpp does for every Q4 model, and "float" keeps the arithmetic closest
# to transformers (weights/plan.py). Timings: docs/performance.md.
ACTIVATION_CHOICES = ("auto", "float", "int8")
_int4_block: int | None = None  # rows per block of PyTorch's int4 packing; 0: unknown


def int4_block_rows() -> int | None:
    """Rows per block of `aten._convert_weight_to_int4pack_for_cpu`'s layout (64 where PyTorch's
    kernel runs AVX-512, 32 on AVX2), found by checking the C++ dequantizer against the op itself
    once the extension is loaded; None until then, or for good if no known layout matches (the
    int4 kernel then serves every batch size)."""
    global _int4_block
    if _int4_block is None:
        if not ops.available():
            return None
        groups = Int4Groups.from_float(torch.randn(128, 64, generator=torch.Generator().manual_seed(0)))
        probe = Int4Linear(groups, torch.float32)
        expected = groups.dequantize()
        _int4_block = next(
            (
                rows
                for rows in (64, 32)
                if torch.allclose(
                    ops.dequantize_int4(
                        probe.weight_packed, probe.scales_mins, 128, 64, GROUP_SIZE, rows, torch.float32
                    ).T,
                    expected,
                    atol=1e-5,
                )
            ),
            0,
        )
    return _int4_block or None


def int4_few_rows(dtype: torch.dtype) -> int:
    """Up to how many rows an Int4Linear with float inputs of `dtype` multiplies through int4_mm
    (more rows: a GEMM over the dequantized weight); see INT4_FEW_ROWS."""
    if dtype == torch.bfloat16 and ops.available() and ops.amx():
        return min(INT4_FEW_ROWS, INT4_FEW_ROWS_AMX_BF16)
    return INT4_FEW_ROWS


def set_activations(model: nn.Module, activations: str) -> None:
    """Make every Int4Linear, Int8GroupLinear (the lm_head among them) and StoredQuadsLinear (Int6Linear,
    Int5Linear) of `model` take float ("float") or int8 ("int8") inputs (the GPU's forms:
    layers/gpu.set_int8_inputs)."""
    for module in model.modules():
        if isinstance(module, (Int4Linear, Int8GroupLinear, StoredQuadsLinear)):
            module.int8_activations = activations == "int8"


def set_batch_invariant(model: nn.Module, on: bool) -> None:
    """With `on` (the default), every layer of `model` that has the choice (a `batch_invariant`
    attribute: Int4Linear and Int8GroupLinear here, the GPU forms in layers/gpu.py) computes each row
    with one arithmetic whatever the number of rows: on the CPU the C++ kernels for every batch size,
    never the GEMM over a dequantized weight that is faster for many rows; on the GPU a Triton kernel
    of one configuration, never cuBLAS's choice by shape. A request's tokens then do not depend on
    the requests batched with it."""
    for module in model.modules():
        if hasattr(module, "batch_invariant"):
            module.batch_invariant = on


@dataclass
class Int4Groups:
    """A weight as 4-bit codes: w[n, k] = scales[n, k // g] * codes[n, k] + mins[n, k // g]."""

    codes: torch.Tensor  # [N, K] uint8 in 0..15
    scales: torch.Tensor  # [N, K / g] float32
    mins: torch.Tensor  # [N, K / g] float32
    group_size: int = GROUP_SIZE

    @classmethod
    def from_float(cls, weight: torch.Tensor, group_size: int = GROUP_SIZE) -> Int4Groups:
        """Round-to-nearest, asymmetric (min/max) per group, as GPTQ-free int4 schemes do."""
        return cls.from_rows(weight.shape, lambda rows: weight[rows], group_size)

    @classmethod
    def from_int8_groups(cls, codes: torch.Tensor, scales: torch.Tensor, group_size: int = GROUP_SIZE) -> Int4Groups:
        """`from_float` of the weight w = scales * codes (int8 codes, a scale per group of
        codes.shape[1] / scales.shape[1] values, as in GGML's Q8_0), never held in float whole."""
        rows, cols = codes.shape
        size = cols // scales.shape[1]

        def read(part: slice) -> torch.Tensor:
            part_codes = codes[part].float().view(-1, cols // size, size)
            return (part_codes * scales[part].float().unsqueeze(-1)).view(-1, cols)

        return cls.from_rows((rows, cols), read, group_size)

    @classmethod
    def from_rows(
        cls, shape: tuple[int, int], read: Callable[[slice], torch.Tensor], group_size: int = GROUP_SIZE
    ) -> Int4Groups:
        """`from_float` of a weight of `shape` given by `read(rows)`, quantized CHUNK_ROWS rows at a time."""
        rows, cols = shape
        codes = torch.empty(rows, cols, dtype=torch.uint8)
        scales = torch.empty(rows, cols // group_size)
        mins = torch.empty(rows, cols // group_size)
        for start in range(0, rows, CHUNK_ROWS):
            part = slice(start, start + CHUNK_ROWS)
            groups = read(part).float().reshape(-1, cols // group_size, group_size)
            low, high = groups.amin(-1), groups.amax(-1)
            step = ((high - low) / 15).clamp(min=1e-10)
            codes[part] = ((groups - low[..., None]) / step[..., None]).round().clamp(0, 15).view(-1, cols)
            scales[part], mins[part] = step, low
        return cls(codes, scales, mins, group_size)

    def dequantize(self) -> torch.Tensor:
        rows, cols = self.codes.shape
        codes = self.codes.float().reshape(rows, cols // self.group_size, self.group_size)
        return (codes * self.scales[..., None] + self.mins[..., None]).reshape(rows, cols)

    @staticmethod
    def cat(parts: list[Int4Groups]) -> Int4Groups:
        """Stack weights along the output dimension (the shards of a fused projection)."""
        assert len({p.group_size for p in parts}) == 1
        return Int4Groups(
            torch.cat([p.codes for p in parts]),
            torch.cat([p.scales for p in parts]),
            torch.cat([p.mins for p in parts]),
            parts[0].group_size,
        )

    def permute_rows(self, order: torch.Tensor) -> Int4Groups:
        return Int4Groups(self.codes[order], self.scales[order], self.mins[order], self.group_size)


def _bias(bias: torch.Tensor | None, dtype: torch.dtype) -> nn.Parameter | None:
    return None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)


class Int4Linear(nn.Module):
    """y = x @ W.T (+ bias) with W stored as packed int4 groups (about 4.5 bits per weight)."""

    def __init__(
        self, weight: Int4Groups, dtype: torch.dtype, bias: torch.Tensor | None = None, int8_activations: bool = False
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.codes.shape
        # Inputs quantized to int8 per group of 32 where the CPU kernels can (see ACTIVATION_CHOICES).
        self.int8_activations = int8_activations
        self.group_size = weight.group_size
        if self.in_features % self.group_size:
            raise ValueError(f"in_features={self.in_features} is not a multiple of the group size {self.group_size}")
        # The kernel takes int32 codes: converted and packed CHUNK_ROWS rows at a time.
        packed = torch.cat(
            [
                torch.ops.aten._convert_weight_to_int4pack_for_cpu(part.to(torch.int32), 1)
                for part in weight.codes.split(CHUNK_ROWS)
            ]
        )
        # Each group's (scale, min) as rows [K/g, 2, N]: float16 where that holds them exactly (GGUF's
        # Q4_0 / Q4_1 store them as float16: half the bytes of float32, and of the memory a decode
        # step reads besides the codes), float32 otherwise (Q4_K's products, weights quantized here).
        scales_mins = torch.stack((weight.scales.float(), weight.mins.float()), dim=1).transpose(0, 2).contiguous()
        as_half = scales_mins.half()
        if torch.equal(as_half.float(), scales_mins):
            scales_mins = as_half
        self.dtype = dtype
        self.batch_invariant = True  # see set_batch_invariant
        self.register_buffer("weight_packed", packed)
        self.register_buffer("scales_mins", scales_mins)
        self.bias = _bias(bias, dtype)

    def kernel_scales_and_zeros(self) -> torch.Tensor:
        """[K/g, N, 2] (scale, zero) in the compute dtype, as PyTorch's int4 kernel takes them: it
        computes (code - 8) * scale + zero, so zero = min + 8 * scale. Made per call: that kernel only
        serves while the C++ kernels are not loaded or PyTorch's packing layout is unknown."""
        scales, mins = self.scales_mins.float().unbind(1)
        return torch.stack((scales, mins + 8 * scales), dim=-1).to(self.dtype)

    @staticmethod
    def supports(out_features: int, in_features: int, group_size: int = GROUP_SIZE) -> bool:
        """The CPU kernel packs 16 output rows at a time and whole groups along the input."""
        return out_features % 16 == 0 and in_features % group_size == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., K] -> [..., N]
        x2 = x.reshape(-1, self.in_features)
        block = int4_block_rows() if x2.device.type == "cpu" else None
        if block is not None and self.out_features % block == 0:
            args = (self.weight_packed, self.scales_mins)
            int8 = self.takes_int8()
            if int8 or self.batch_invariant or x2.shape[0] <= int4_few_rows(x2.dtype):
                out = ops.int4_mm(x2, *args, self.out_features, self.group_size, block, int8)
            else:  # a float GEMM over the dequantized weight: weight_t [K, N]
                weight_t = ops.dequantize_int4(
                    *args, self.out_features, self.in_features, self.group_size, block, x2.dtype
                )
                out = torch.mm(x2, weight_t)
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2, self.weight_packed, self.group_size, self.kernel_scales_and_zeros()
            )
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def takes_int8(self) -> bool:
        """Whether the C++ kernels quantize this layer's inputs to int8: asked for
        (int8_activations), groups of 32, and a CPU with the instructions."""
        return self.int8_activations and self.group_size == GROUP_SIZE and ops.int8_activations()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}" + (
            ", int8_activations=True" if self.int8_activations else ""
        )


class Int8Linear(nn.Module):
    """y = x @ W.T (+ bias) with W stored as int8 rows and one scale per output row."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        scales = weight.float().abs().amax(dim=1).clamp(min=1e-10) / 127  # [N]
        codes = (weight.float() / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
        self.register_buffer("weight_int8", codes)
        self.register_buffer("scales", scales.to(dtype))
        self.bias = _bias(bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, self.in_features), self.weight_int8, self.scales)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


def int8_groups_from_float(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [N, K] int8, scales [N, K / g] float32), symmetric per group (one group per row when
    K is not a multiple of g)."""
    rows, cols = weight.shape
    group_size = group_size if cols % group_size == 0 else cols
    groups = weight.float().reshape(rows, cols // group_size, group_size)
    scales = groups.abs().amax(-1) / 127
    codes = (groups / scales.clamp(min=1e-30)[..., None]).round().clamp(-127, 127).to(torch.int8)
    return codes.reshape(rows, cols), scales


class Int8GroupLinear(nn.Module):
    """y = x @ W.T (+ bias) with W as int8 and a scale per group of 32 inputs (GGML's Q8_0 and Q5_0,
    kept exact), summed in float32 and given in `out_dtype` (float32 for logits).

    Serves a tied lm_head from the embedding's own tensors (no second copy). Batch-invariant (the
    default), every row count goes through the C++ kernel (kvserve/csrc), one arithmetic per row;
    otherwise up to FEW_ROWS rows do, and more dequantize the weight for a float GEMM, as without a
    compiled kernel. With AMX and bfloat16 inputs the kernel multiplies tiles (exact bfloat16 codes,
    float32 sums per group); without AMX but with AVX512-BF16, bfloat16 inputs go through a copy of
    the codes interleaved 16 rows x 2 inputs (`_pairs`, int8_pairs.cpp), any row count.
    """

    FEW_ROWS = 256

    def __init__(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        dtype: torch.dtype,
        bias: torch.Tensor | None = None,
        out_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.dtype, self.out_dtype = dtype, out_dtype
        self.batch_invariant = True  # see set_batch_invariant: the C++ kernel for every batch size
        self.int8_activations = False  # see set_activations: inputs quantized to int8 per group
        self.is_grouped = scales.shape[1] * GROUP_SIZE == self.in_features
        # One layout at a time (arrange_quads, arrange_row_major): row-major codes, or quads.
        self.register_buffer("codes", codes)  # [N, K] int8
        self.register_buffer("scales", scales)  # [N, K / 32] float32
        self.register_buffer("quads", None)  # [N' / 16, ...] uint8, 8 or 5 bits (N' = N to 16; layers/quads.py)
        self.register_buffer("quad_scales", None)  # [N' / 16, K / 32, 16] float16 or float32
        self.bias = _bias(bias, out_dtype)
        self._pair_layout: tuple[torch.Tensor, torch.Tensor] | None = None  # see _pairs
        self._tied: tuple[Int8Embedding, ...] = ()  # see tie; a tuple, so not a submodule

    def _pairs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The codes 16 output rows x 2 inputs interleaved, and the scales 16 rows at a time
        (int8_pairs.cpp), for bfloat16 inputs on AVX512-BF16: as many bytes again as the codes, made on
        the first such call (the C++ kernels load after the weights)."""
        if self._pair_layout is None:
            rows = -(-self.out_features // 16) * 16
            codes = F.pad(self.codes, (0, 0, 0, rows - self.out_features))
            scales = F.pad(self.scales, (0, 0, 0, rows - self.out_features))
            pairs = codes.view(rows // 16, 16, self.in_features // 2, 2).permute(0, 2, 1, 3).contiguous()
            self._pair_layout = (pairs, quads.by_16_rows(scales))
        return self._pair_layout

    def uses_quads(self) -> bool:
        """Whether this layer multiplies in the quads layout (int8_quads.cpp): int8 inputs on a CPU with
        AVX2, whole groups, whole vectors of 16 output rows (the layer loop's condition too, so
        that its steps and this module's are the same bits)."""
        return self.is_grouped and self.out_features % 16 == 0 and self.takes_int8() and ops.int8_quads_usable()

    def arrange_quads(self) -> None:
        """Hold the codes 16 output rows x 4 inputs interleaved (layers/quads.py), instead of row-major:
        at 5 bits where every code fits (GGML's Q5_0: the file's own width), else 8, with float16 scales
        where the file's are; read by one vpdpbusd per 4 inputs and 16 outputs for any row count on AVX512-VNNI
        (bench/cpu_kernels.py: 2.5x the row-major kernel for one row, 4-5x from 16), vpmaddubsw on AVX2.
        Arranged at load where the CPU has AVX2 and the inputs are int8 (loader.py), else on the first call that
        multiplies this way. A tied embedding then looks its rows up in these quads (one copy)."""
        if self.quads is not None:
            return
        self.quads, self.quad_scales = quads.to_quads(self.codes, self.scales)
        self.codes = self.scales = None
        self._pair_layout = None
        for embedding in self._tied:
            embedding.read_from(quads=(self.quads, self.quad_scales))

    def arrange_row_major(self) -> None:
        """Back to row-major codes and scales (for float inputs), from the quads."""
        if self.codes is not None:
            return
        self.codes, self.scales = quads.to_row_major(self.quads, self.quad_scales, self.out_features)
        self.quads = self.quad_scales = None
        for embedding in self._tied:
            embedding.read_from(rows=(self.codes, self.scales))

    def tie(self, embedding: Int8Embedding) -> None:
        """Share this layer's codes with `embedding` (a tied lm_head): it then looks rows up in whichever
        layout this layer holds."""
        self._tied = (embedding,)

    def takes_int8(self) -> bool:
        """Whether the C++ kernels quantize this layer's inputs to int8: asked for, and a CPU with the
        instructions."""
        return self.int8_activations and ops.available() and ops.int8_activations()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., K] -> [..., N] in out_dtype, rounded once from the float32 sums
        out = self._float32(x).to(self.out_dtype)
        return out if self.bias is None else out + self.bias

    def _float32(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        kernels = x2.device.type == "cpu" and ops.available()
        is_grouped = self.is_grouped
        if kernels and self.uses_quads():  # one vpdpbusd per four inputs and 16 output rows, any row count
            self.arrange_quads()
            out = ops.int8_quads_matmul(x2, self.quads, self.quad_scales, self.out_features)
            return out.view(*x.shape[:-1], self.out_features)
        self.arrange_row_major()
        if kernels and is_grouped and self.takes_int8():
            out = ops.int8_group_matmul_int8(x2, self.codes, self.scales)
            return out.view(*x.shape[:-1], self.out_features)
        if kernels and is_grouped and x2.dtype == torch.bfloat16 and not ops.amx() and ops.int8_pairs_usable():
            # one vdpbf16ps per pair of inputs and 16 output rows, any row count (batch-invariant)
            out = ops.int8_pairs_matmul(x2, *self._pairs(), self.out_features)
            return out.view(*x.shape[:-1], self.out_features)
        if kernels and is_grouped and (self.batch_invariant or x2.shape[0] <= self.FEW_ROWS):
            amx_min_rows = 1 if self.batch_invariant else ops.amx_min_rows()
            out = ops.int8_group_matmul(x2, self.codes, self.scales, amx_min_rows)
            return out.view(*x.shape[:-1], self.out_features)
        # Many rows: dequantize CHUNK_ROWS output rows at a time and run a GEMM on each, so the
        # temporary stays a few MB whatever the vocabulary. In float32 whatever the compute dtype:
        # logits rounded to bfloat16 (steps of 1/8 near 10) turn near-ties into different tokens.
        out = torch.empty(x2.shape[0], self.out_features, dtype=torch.float32, device=x2.device)
        x2 = x2.float()
        for start in range(0, self.out_features, CHUNK_ROWS):
            end = min(start + CHUNK_ROWS, self.out_features)
            if kernels and is_grouped:
                weight = ops.dequantize_int8_groups(self.codes, self.scales, start, end, torch.float32)
            else:
                groups = self.codes[start:end].view(end - start, self.scales.shape[1], -1)
                weight = (groups * self.scales[start:end].unsqueeze(-1)).view(end - start, -1)
            out[:, start:end] = F.linear(x2, weight)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class StoredQuadsLinear(nn.Module):
    """A GGML type held as stored in the quads layout, its scales in a form of its own (layers/quads.py,
    int8_quads.cpp): y = x @ W.T (+ bias) for int8 inputs (AVX2 and up), where the loader makes these
    layers (WeightPlan.quads). With float inputs (set_activations after load) it multiplies a weight
    dequantized on each call: exact, and slow. A subclass registers `quads` and its scales buffer."""

    kind: str  # the GGML type, "Q6_K", "Q5_1", "Q5_K"
    quads: torch.Tensor

    def _setup(self, out_features: int, in_features: int, dtype: torch.dtype, bias, out_dtype) -> None:
        self.out_features, self.in_features = out_features, in_features
        self.dtype, self.out_dtype = dtype, out_dtype or dtype
        self.int8_activations = True  # see set_activations
        self.bias = _bias(bias, self.out_dtype)

    def scales(self) -> torch.Tensor:
        """The scales int8_quads_matmul takes beside `quads`."""
        raise NotImplementedError

    def dequantized(self) -> torch.Tensor:
        """The float32 weight [N, K], as GGML dequantizes it."""
        raise NotImplementedError

    def takes_int8(self) -> bool:
        return self.int8_activations and ops.available() and ops.int8_quads_usable()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if x2.device.type == "cpu" and self.takes_int8():
            out = ops.int8_quads_matmul(x2, self.quads, self.scales(), self.out_features)
        else:
            out = F.linear(x2.float(), self.dequantized())
        out = out.view(*x.shape[:-1], self.out_features).to(self.out_dtype)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind}"


class Int6Linear(StoredQuadsLinear):
    """GGML's Q6_K: 6-bit codes, an int8 scale per 16 inputs and a float16 scale per 256
    (w = d * scale * (code - 32)), held at the file's 6.5625 bits a weight. Every row count runs one
    kernel (vpdpbusd), so it is batch-invariant."""

    kind = "Q6_K"

    def __init__(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        d: torch.Tensor,
        dtype: torch.dtype,
        bias: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        quads_, k_scales = quads.to_k6_quads(codes, scales, d)
        self.register_buffer("quads", quads_)  # [N / 16, K / 32, 384] uint8
        self.register_buffer("k_scales", k_scales)  # [N / 16, K / 256, 288] uint8
        self._setup(*codes.shape, dtype, bias, out_dtype)

    @staticmethod
    def supports(out_features: int, in_features: int) -> bool:
        return out_features % 16 == 0 and in_features % 256 == 0

    def scales(self) -> torch.Tensor:
        return self.k_scales

    def dequantized(self) -> torch.Tensor:
        return quads.k6_dequantize(self.quads, self.k_scales)


class Int5Linear(StoredQuadsLinear):
    """GGML's Q5_1 or Q5_K: 5-bit codes 0..31 with a scale and a min per 32 inputs (Q5_1: float16 each,
    w = scale * code + min; Q5_K: 6-bit ones times a float16 d and dmin per 256,
    w = (d * scale) * code - dmin * min), held at the file's width. vpdpbusd, and AMX tiles from 16
    rows, with the same integer sums and float steps, so it is batch-invariant."""

    def __init__(
        self,
        kind: str,
        parts: tuple[torch.Tensor, ...],
        dtype: torch.dtype,
        bias: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.kind = kind  # "Q5_1" or "Q5_K"
        quads_, scales = quads.to_q5_quads(kind, parts)
        self.register_buffer("quads", quads_)  # [N / 16, K / 32, 320] uint8
        # Q5_1: [N / 16, K / 32, 2, 16] float16; Q5_K: [N / 16, K / 256, 320] uint8
        self.register_buffer("q5_scales", scales)
        self._setup(*parts[0].shape, dtype, bias, out_dtype)

    @staticmethod
    def supports(kind: str, out_features: int, in_features: int) -> bool:
        return out_features % 16 == 0 and in_features % (256 if kind == "Q5_K" else GROUP_SIZE) == 0

    def scales(self) -> torch.Tensor:
        return self.q5_scales

    def dequantized(self) -> torch.Tensor:
        return quads.q5_dequantize(self.quads, self.q5_scales)


class Int4QuadsLinear(StoredQuadsLinear):
    """4-bit codes with a scale and a min per 32 inputs (GGML's Q4_0 and Q4_1, w = scale * code + min with
    each exact in float16; Q4_K with its own scales), for int8 inputs: the quads layout's nibbles, arranged
    once at load (layers/quads.py), where Int4Linear's int8 kernel rearranges each block of codes on every
    call. The same integer sums and float steps in the same order, so the bits of
    Int4Linear(int8_activations=True) on the same weight, for any number of rows; and the work splits by
    16 outputs, not 64."""

    def __init__(
        self,
        weight: Int4Groups | tuple[torch.Tensor, ...],
        dtype: torch.dtype,
        bias: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> None:
        """weight: Int4Groups whose scales and mins are exact in float16 (`holds`), or Q4_K's parts
        (dequant.q4_k_parts), held with Q5_K's K-quant scales: 6 bits a scale and a min per 32, float16 d
        and dmin per 256 (4.625 bits a weight, the file 4.5). The kernel's float32 products d * scale and
        -(dmin * min) are exact, so they are the scales and mins Int4Linear holds: the same bits again."""
        super().__init__()
        if isinstance(weight, Int4Groups):
            self.kind = "Q4_0/Q4_1"
            quads_, scales = quads.to_q4_quads(weight.codes, weight.scales, weight.mins)
            shape = weight.codes.shape
        else:
            self.kind = "Q4_K"
            quads_, scales = quads.to_k4_quads(weight)
            shape = weight[0].shape
        self.register_buffer("quads", quads_)  # [N / 16, K / 32, 256] uint8
        # [N / 16, K / 32, 2, 16] float16, or Q4_K's [N / 16, K / 256, 320] uint8
        self.register_buffer("q4_scales", scales)
        self._setup(*shape, dtype, bias, out_dtype)

    @staticmethod
    def holds_q4_k(out_features: int, in_features: int) -> bool:
        """Whether a Q4_K layer of this shape can be held so: whole vectors of 16 outputs (its inputs come
        in blocks of 256)."""
        return out_features % 16 == 0 and in_features % 256 == 0

    @staticmethod
    def holds(weight: Int4Groups) -> bool:
        """Whether `weight` can be held so: groups of 32, whole vectors of 16 outputs, and every scale
        and min exact in float16 (as GGUF's Q4_0 and Q4_1 store them; not Q4_K's products)."""
        n, k = weight.codes.shape
        return (
            weight.group_size == GROUP_SIZE
            and n % 16 == 0
            and k % GROUP_SIZE == 0
            and all(torch.equal(t.half().float(), t.float()) for t in (weight.scales, weight.mins))
        )

    def scales(self) -> torch.Tensor:
        return self.q4_scales

    def dequantized(self) -> torch.Tensor:
        return quads.q5_dequantize(self.quads, self.q4_scales)


def float32_linear(x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """linear(x) in float32 for a float (or bfloat16) layer: a bfloat16 lm_head's logits rounded to
    bfloat16 are 1/8 apart near 10, and near-ties then turn into different tokens. On the CPU the C++
    kernel (the same arithmetic for every row); elsewhere a float32 GEMM over CHUNK_ROWS rows of the
    weight at a time, so the float32 copy stays a few MB."""
    x2 = x.reshape(-1, linear.in_features)
    if x2.device.type == "cpu" and ops.available() and linear.in_features % GROUP_SIZE == 0 and linear.bias is None:
        out = ops.float32_matmul(x2, linear.weight)
    else:
        out = torch.empty(x2.shape[0], linear.out_features, dtype=torch.float32, device=x2.device)
        x2 = x2.float()
        for start in range(0, linear.out_features, CHUNK_ROWS):
            end = min(start + CHUNK_ROWS, linear.out_features)
            bias = None if linear.bias is None else linear.bias[start:end].float()
            out[:, start:end] = F.linear(x2, linear.weight[start:end].float(), bias)
    return out.view(*x.shape[:-1], linear.out_features)


class Int8Embedding(nn.Module):
    """An embedding table kept as int8 with a scale per group of 32 values of a row; where the lm_head
    is tied to it and held as quads (Int8GroupLinear.tie), its rows are looked up there instead."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = codes.shape
        self.group_size = self.embedding_dim // scales.shape[1]
        self.dtype = dtype
        self.register_buffer("codes", codes.to(torch.int8))  # [V, D]
        self.register_buffer("scales", scales.float())  # [V, D / g]
        self.register_buffer("quads", None)  # the tied lm_head's, while it holds them (layers/quads.py)
        self.register_buffer("quad_scales", None)

    def read_from(
        self,
        rows: tuple[torch.Tensor, torch.Tensor] | None = None,
        quads: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Look rows up in row-major (codes, scales) or in (quads, quad_scales): the tied lm_head's."""
        self.codes, self.scales = rows or (None, None)
        self.quads, self.quad_scales = quads or (None, None)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [T] -> [T, D]
        if self.quads is not None:
            codes, scales = quads.rows_of(self.quads, self.quad_scales, input_ids.reshape(-1))
        else:
            codes, scales = self.codes[input_ids], self.scales[input_ids]
        groups = codes.float().view(-1, self.embedding_dim // self.group_size, self.group_size)
        rows = groups * scales.view(groups.shape[0], -1).unsqueeze(-1)
        return rows.view(*input_ids.shape, self.embedding_dim).to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, group_size={self.group_size}"
