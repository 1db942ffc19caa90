"""The elementwise steps of a layer, each one kernel where PyTorch launches two or three: the gated
activation (SiLU or tanh-GELU of the gate times the up projection) and RoPE of q and k, with the
new keys and values written into the KV cache in the same kernel (the residual add with the RMSNorm
after it is norm.add_rms_norm). On a GPU a decode step of a small model is
hundreds of such launches of a few microseconds each, so fewer launches is what they are for.

Each element's arithmetic is the same whatever the batch (R7): no reduction across rows, whichever
program a row falls in. Each keeps the roundings of the PyTorch ops it replaces (a rounding to
the activations' dtype wherever PyTorch stores a tensor in between).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.kernels.gpu import INTERPRET, cdiv, launch_options, next_power_of_2
from kvserve.kernels.gpu.common import cast, gated_product, quantize_groups, rope_values, store_groups, wait_for_prior

ACT_ROWS, ACT_BLOCK = 4, 512  # rows x outputs of the gated activation per program
ROTATE_ROWS = 32  # (token, head) rows that one program of RoPE rotates


@triton.jit(do_not_specialize=["num_rows"])  # one binary for every number of rows
def _gated_kernel(
    gate_up_ptr,
    out_ptr,
    num_rows,
    intermediate,
    stride_in,
    stride_out,
    words_ptr,
    d_ptr,
    s_ptr,
    GELU: tl.constexpr,
    QUANTIZE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_prior(PDL)
    rows = (tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS))[:, None]
    cols = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]
    mask = (rows < num_rows) & (cols < intermediate)
    gate = tl.load(gate_up_ptr + rows * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + rows * stride_in + intermediate + cols, mask=mask, other=0.0).to(tl.float32)
    out = gated_product(gate, up, GELU, out_ptr.dtype.element_ty, INTERPRET)
    tl.store(out_ptr + rows * stride_out + cols, out, mask=mask)
    if QUANTIZE:  # the output as stored, per group of 32 (intermediate a multiple of 32): the down projection's
        words, d, s = quantize_groups(tl.reshape(out.to(tl.float32), (BLOCK_ROWS * (BLOCK // 32), 32)), INTERPRET)
        groups = (tl.program_id(1) * (BLOCK // 32) + tl.arange(0, BLOCK // 32))[None, :]  # [1, BLOCK / 32]
        g_mask = (rows < num_rows) & (groups < intermediate // 32)  # [BLOCK_ROWS, BLOCK / 32]
        store_groups(words, d, s, rows * (intermediate // 32) + groups, g_mask, words_ptr, d_ptr, s_ptr)


def gated_activation(gate_up: torch.Tensor, gelu: bool, quantized: list | None = None) -> torch.Tensor:
    """act(gate) * up for gate_up [M, 2I] = [gate | up] -> [M, I] in gate_up's dtype, act SiLU or (gelu)
    tanh-GELU, the activation rounded to that dtype before the product, as
    `F.silu(gate) * up` stores it. With `quantized` (I a multiple of 32), the result's
    `matmul.quantize_int8` is appended to it, made by the same kernel."""
    assert gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0, gate_up.shape
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    rows, intermediate = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, intermediate, dtype=gate_up.dtype, device=gate_up.device)
    if quantized is not None:
        assert intermediate % 32 == 0, intermediate
        d = torch.empty(rows, intermediate // 32, dtype=torch.float32, device=gate_up.device)
        words = torch.empty(rows, intermediate // 4, dtype=torch.int32, device=gate_up.device)
        quantized.append((words, d, torch.empty_like(d)))
    words, d, s = quantized[-1] if quantized is not None else (out, out, out)  # (not written without QUANTIZE)
    if rows > 0:
        grid = (cdiv(rows, ACT_ROWS), cdiv(intermediate, ACT_BLOCK))
        _gated_kernel[grid](
            gate_up,
            out,
            rows,
            intermediate,
            gate_up.stride(0),
            out.stride(0),
            words,
            d,
            s,
            GELU=gelu,
            QUANTIZE=quantized is not None,
            BLOCK_ROWS=ACT_ROWS,
            BLOCK=ACT_BLOCK,
            INTERPRET=INTERPRET,
            **launch_options(gate_up.device),
        )
    return out


@triton.jit
def _rope(x_row, cos_row, sin_row, d, mask, out_ptr, ROTARY_DIM: tl.constexpr, INTERPRET: tl.constexpr):
    """x * cos + roll(x, R / 2) * sin_signed for rows of x (pointers x_row, cos_row, sin_row, [R, 1]) at
    columns d, in out_ptr's dtype; x * cos rounded to it first, as PyTorch stores it."""
    x = tl.load(x_row + d, mask=mask, other=0.0).to(tl.float32)
    rolled = tl.load(x_row + (d + ROTARY_DIM // 2) % ROTARY_DIM, mask=mask, other=0.0).to(tl.float32)
    cos = tl.load(cos_row + d, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_row + d, mask=mask, other=0.0).to(tl.float32)
    return rope_values(x, rolled, cos, sin, out_ptr.dtype.element_ty, INTERPRET)


@triton.jit(do_not_specialize=["num_rows"])  # one binary for every number of rows
def _rotate_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    num_rows,
    stride_xt,
    stride_xh,
    stride_ct,
    stride_st,
    num_heads,
    ROTARY_DIM: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """BLOCK_ROWS of the step's (token, head) rows per program, token-major."""
    wait_for_prior(PDL)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    token, head = (rows // num_heads)[:, None], (rows % num_heads)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (rows < num_rows)[:, None] & (d < ROTARY_DIM)
    x_row = x_ptr + token * stride_xt + head * stride_xh
    out = _rope(
        x_row, cos_ptr + token * stride_ct, sin_ptr + token * stride_st, d, mask, out_ptr, ROTARY_DIM, INTERPRET
    )
    tl.store(out_ptr + rows[:, None] * ROTARY_DIM + d, out, mask=mask)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [T, heads, R] (any strides but the last) with cos, sin_signed [T, 1, R]
    (layers/rotary.rotate's arguments): x * cos + roll(x, R / 2) * sin_signed, x * cos rounded to x's
    dtype first as torch.addcmul(x * cos, ...) has it. Returns a new contiguous [T, heads, R]."""
    tokens, heads, rotary_dim = x.shape
    assert x.stride(-1) == 1 and cos.stride(-1) == 1 and sin_signed.stride(-1) == 1, "rows must be contiguous"
    assert cos.shape == sin_signed.shape == (tokens, 1, rotary_dim), (x.shape, cos.shape)
    out = torch.empty(tokens, heads, rotary_dim, dtype=torch.promote_types(x.dtype, cos.dtype), device=x.device)
    if tokens > 0:
        rows = tokens * heads
        _rotate_kernel[(cdiv(rows, ROTATE_ROWS),)](
            x,
            cos,
            sin_signed,
            out,
            rows,
            x.stride(0),
            x.stride(1),
            cos.stride(0),
            sin_signed.stride(0),
            heads,
            ROTARY_DIM=rotary_dim,
            BLOCK_ROWS=ROTATE_ROWS,
            BLOCK_D=next_power_of_2(rotary_dim),
            INTERPRET=INTERPRET,
            num_warps=4,
            **launch_options(x.device),
        )
    return out


@triton.jit(do_not_specialize=["num_rows", "slot_mapping"])  # one binary for every number of rows
def _rotate_store_kernel(
    qk_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    q_ptr,
    k_cache,
    v_cache,
    slot_mapping,
    num_rows,
    stride_xt,
    stride_xh,
    stride_vt,
    stride_vh,
    stride_ct,
    stride_st,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    num_heads,
    num_kv_heads,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """`_rotate_kernel` over the (token, head) rows of q and k, then q's rows to q_ptr and k's, with v's
    row of the same KV head, into the caches at the token's slot, as attention.store_kv writes them
    (nothing for a negative slot)."""
    wait_for_prior(PDL)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    heads = num_heads + num_kv_heads
    token, head = (rows // heads)[:, None], (rows % heads)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (rows < num_rows)[:, None] & (d < HEAD_DIM)
    x_row = qk_ptr + token * stride_xt + head * stride_xh
    out = _rope(x_row, cos_ptr + token * stride_ct, sin_ptr + token * stride_st, d, mask, q_ptr, HEAD_DIM, INTERPRET)
    is_q = head < num_heads
    tl.store(q_ptr + (token * num_heads + head) * HEAD_DIM + d, out, mask=mask & is_q)
    slot = tl.load(slot_mapping + token, mask=(rows < num_rows)[:, None], other=-1).to(tl.int64)  # [R, 1]
    kv_mask = mask & (~is_q) & (slot >= 0)
    kv_head = tl.maximum(head - num_heads, 0)
    block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    k = cast(out.to(tl.float32), k_cache.dtype.element_ty, INTERPRET)
    tl.store(k_cache + block * stride_kcb + offset * stride_kcs + kv_head * stride_kch + d, k, mask=kv_mask)
    v = tl.load(v_ptr + token * stride_vt + kv_head * stride_vh + d, mask=kv_mask, other=0.0)
    v = cast(v.to(tl.float32), v_cache.dtype.element_ty, INTERPRET)
    tl.store(v_cache + block * stride_vcb + offset * stride_vcs + kv_head * stride_vch + d, v, mask=kv_mask)


def rotate_and_store(
    qk: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin_signed: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """RoPE over the whole head of q and k, qk [T, H + Hkv, D] (`rotate`'s bits), with k and v [T, Hkv, D]
    then written into the caches at slot_mapping [T] (`attention.store_kv`'s bits; none for a negative
    slot), in one kernel where those are two: returns the rotated q, a new contiguous [T, H, D]."""
    tokens, heads, head_dim = qk.shape
    num_kv_heads = v.shape[1]
    assert v.shape == (tokens, num_kv_heads, head_dim) and slot_mapping.shape == (tokens,), (qk.shape, v.shape)
    assert cos.shape == sin_signed.shape == (tokens, 1, head_dim), (qk.shape, cos.shape)
    assert k_cache.shape[2:] == (num_kv_heads, head_dim) and v_cache.shape == k_cache.shape, k_cache.shape
    assert qk.stride(-1) == v.stride(-1) == cos.stride(-1) == sin_signed.stride(-1) == 1, "rows must be contiguous"
    assert k_cache.stride(-1) == v_cache.stride(-1) == 1
    num_heads = heads - num_kv_heads
    q = torch.empty(tokens, num_heads, head_dim, dtype=torch.promote_types(qk.dtype, cos.dtype), device=qk.device)
    if tokens > 0:
        rows = tokens * heads
        _rotate_store_kernel[(cdiv(rows, ROTATE_ROWS),)](
            qk,
            v,
            cos,
            sin_signed,
            q,
            k_cache,
            v_cache,
            slot_mapping,
            rows,
            qk.stride(0),
            qk.stride(1),
            v.stride(0),
            v.stride(1),
            cos.stride(0),
            sin_signed.stride(0),
            *k_cache.stride()[:3],
            *v_cache.stride()[:3],
            num_heads,
            num_kv_heads,
            BLOCK_SIZE=k_cache.shape[1],
            HEAD_DIM=head_dim,
            BLOCK_ROWS=ROTATE_ROWS,
            BLOCK_D=next_power_of_2(head_dim),
            INTERPRET=INTERPRET,
            num_warps=4,
            **launch_options(qk.device),
        )
    return q
