"""A typed wrapper per C++ op. Each needs the extension loaded (`available()`); callers check that
first and otherwise take their PyTorch path. Shapes: x [M, K] activations, weights [N, K] (or
packed), results [M, N]."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
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


def int8_pairs_usable() -> bool:
    """Whether this build multiplies bfloat16 rows by int8 codes in pairs (AVX512-BF16)."""
    return bool(_ext().int8_pairs_usable())


def int8_pairs_matmul(x: torch.Tensor, pairs: torch.Tensor, pair_scales: torch.Tensor, rows: int) -> torch.Tensor:
    """`int8_group_matmul` for bfloat16 x, from the codes as `int8_pairs` lays them out."""
    return _ext().int8_pairs_matmul(x, pairs, pair_scales, rows)


def int8_quads_usable() -> bool:
    """Whether this build multiplies int8-quantized rows by int8 codes four inputs at a time (int8_quads.cpp: AVX2, FMA and F16C; vpdpbusd on AVX512-VNNI)."""
    return bool(_ext().int8_quads_usable())


def int8_quads_matmul(x: torch.Tensor, quads: torch.Tensor, quad_scales: torch.Tensor, rows: int) -> torch.Tensor:
    """`int8_group_matmul_int8` from the codes as `int8_quads` lays them out (x quantized the same way):
    quads [V / 16, K / 4, 16, 4] uint8, each code + 128 (8 bits), or [V / 16, K / 32, 320] uint8 (5 bits:
    codes in -16..15 + 16, as nibbles and fifth-bit masks); quad_scales [V / 16, K / 32, 16] float32 or
    float16; or Q6_K's [V / 16, K / 32, 384] (6 bits) with K-quant scales [V / 16, K / 256, 288] uint8; or
    Q5_1's and Q5_K's 5-bit quads (codes 0..31) with scales and mins, [V / 16, K / 32, 2, 16] float16 or
    [V / 16, K / 256, 320] uint8, or 4-bit quads [V / 16, K / 32, 256] (codes 0..15) with either: Q4_0's and
    Q4_1's float16, Q4_K's bytes (layers/quads.py, int8_quads.cpp). From 16 rows on AMX tiles where the CPU
    has them (Q6_K: vpdpbusd for all)."""
    return _ext().int8_quads_matmul(x, quads, quad_scales, rows)


def int8_group_matmul_int8(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`int8_group_matmul` with x's rows quantized to int8 per group of 32, in integers as llama.cpp's
    Q8_0 x Q8_0 (needs `int8_activations()`)."""
    return _ext().int8_group_matmul_int8(x, codes, scales)


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


def sample_rows(
    logits: torch.Tensor, rows: torch.Tensor, inv_temperatures: torch.Tensor, seeds: torch.Tensor
) -> torch.Tensor:
    """A draw from each row rows[i] of float32 logits [B, V] (filters applied) at inverse temperature
    inv_temperatures[i] (float32) under its int64 seed seeds[i]: argmax of exp((logit - max) / T) / E with
    E = -log(U), U a hash of the seed and the token id (sampling.cpp); a draw depends on its row, its
    temperature and its seed only. [R] int64."""
    return _ext().sample_rows(logits, rows, inv_temperatures, seeds)


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place on float32 logits [B, V]: -inf for every token that row rows[i]'s grammar bitmask
    (bitmask[i], int32 [W], bit t % 32 of word t // 32 for token t) forbids."""
    _ext().apply_token_bitmask(logits, rows, bitmask)


def linear_kinds() -> Any:
    """The C++ enum LinearKind: how a layer loop's linear weight is stored (Float, Int4, Int8, Int8Groups,
    Int8Quads)."""
    return _ext().LinearKind


@dataclass(frozen=True, eq=False)  # eq would compare tensors
class Linear:
    """A linear layer of the layer loop: weight [N, ...] as its `kind` stores it (Float: [N, K] in the
    compute dtype; Int4: packed, with scales = scales_mins; Int8: [N, K] codes, with scales [N];
    Int8Groups: [N, K] codes, with scales [N, K / 32] float32; Int8Quads: Int8GroupLinear's quads and
        quad_scales, or a StoredQuadsLinear's quads and scales(): Int6Linear's, Int5Linear's, Int4QuadsLinear's)."""

    kind: Any  # a member of linear_kinds()
    weight: torch.Tensor
    scales: torch.Tensor | None = None
    bias: torch.Tensor | None = None


def activations() -> Any:
    """The C++ enum Activation: the MLP's gate (SiLU, GeluTanh)."""
    return _ext().Activation


@dataclass(frozen=True)
class LayerShape:
    """A decoder layer's sizes (Hugging Face config names), its attention's softmax scale and its
    family's differences: the dimensions RoPE rotates, the gate's activation (an `activations()`
    member), RMSNorms over each q and k head, norms on the sub-layers' outputs."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    scale: float
    rotary_dim: int
    activation: Any
    qk_norm: bool = False
    sandwich_norms: bool = False


@dataclass(frozen=True)
class Int4Policy:
    """How every int4 layer of the loop multiplies: up to `few_rows` rows int4_mm, more a float GEMM
    over the dequantized weight; `block_rows` is the packing's rows per block (0: unknown, PyTorch's
    int4 kernel); inputs quantized to int8 per group with `int8_activations`."""

    group_size: int
    few_rows: int
    block_rows: int
    int8_activations: bool


def _layer_shape(shape: LayerShape) -> Any:
    return _ext().LayerShape(**{f.name: getattr(shape, f.name) for f in fields(shape)})


def decode_attention(
    qkv: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    shape: LayerShape,
    window: int = 0,
) -> torch.Tensor:
    """The layer loop's attention, [B, H D]: row b of qkv [B, (H + 2 Hkv) D] (its rotated q, then k
    and v) attends to its first seq_lens[b] keys (the last `window` of them; 0: all) in the paged
    caches [num_blocks, block_size, Hkv, D] through block_tables[b] (int64)."""
    return _ext().decode_attention(qkv, k_cache, v_cache, block_tables, seq_lens, _layer_shape(shape), window)


class LayerStack:
    """The C++ layer loop over a decoder's layers, holding what does not change between steps:
    norms (per layer: attention in, MLP in, then with `sandwich_norms` attention out and MLP out,
    then with `qk_norm` the q and k head norms; the final norm last), linears (qkv, o, gate_up, down
    per layer), the KV caches (one [num_blocks, block_size, num_kv_heads, head_dim] K and V per layer,
    of one dtype, which may differ from the compute dtype), sizes, the int4 policy, and per layer its
    attention window (0: every position) and RoPE table. References, not copies: `forward` writes
    the caches in place. Without `final_norm` (and no final norm in `norms`) the stack is a pipeline
    stage's layers: `forward` returns the residual stream after them, for the next stage."""

    def __init__(
        self,
        norms: list[torch.Tensor],
        linears: list[Linear],
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        shape: LayerShape,
        int4: Int4Policy,
        windows: list[int],
        rope_tables: list[int],
        final_norm: bool = True,
    ) -> None:
        extension = _ext()
        self._stack = extension.LayerStack(
            norms,
            [extension.Linear(m.kind, m.weight, m.scales, m.bias) for m in linears],
            k_caches,
            v_caches,
            _layer_shape(shape),
            extension.Int4Policy(**asdict(int4)),
            windows,
            rope_tables,
            final_norm,
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        prefill_starts: list[int],
    ) -> torch.Tensor:
        """Hidden states [B, hidden] after every layer and the final norm for B rows: x [B, hidden]
        embeddings in the norms' dtype, cos and sin_signed [tables, B, rotary_dim]; row b writes its K/V at
        slot_mapping[b] and attends to its first seq_lens[b] keys through block_tables[b] (int64, [B]
        and [B, max_blocks]). With prefill_starts (S + 1 row offsets), the rows are instead the whole
        prompts of S fresh sequences (block_tables and seq_lens unused). Raises RuntimeError once the
        kernels are turned off (KVSERVE_FUSED_DECODE=0)."""
        _ext()
        return self._stack.forward(x, cos, sin_signed, slot_mapping, block_tables, seq_lens, prefill_starts)
