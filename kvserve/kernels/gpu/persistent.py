"""One kernel for a one-row decode step's decoder layers: the persistent step (issue 32).

A one-stream 4-bit step launches about 115 kernels, and each pays a floor its bytes do not set: its programs
dispatched and ramping up, the last ones draining. Here a few programs a multiprocessor, all resident, loop
over every layer's five phases and meet at a grid-wide barrier (`grid_barrier`) after each:

1. q/k/v, with the attention's norm in its prologue (adding the last layer's MLP output to the residual
   stream) and RoPE with the KV cache's write in its epilogue;
2. the attention over the paged cache, in the graph's key splits, each KV head's merged by its last;
3. o;
4. gate/up, with the MLP's norm in its prologue (adding o's output) and the gated activation in its epilogue;
5. down.

Each phase's tiles go to the programs pid, pid + programs, ..., through the launched kernels' own tile
functions (`matmul._int4_tile`, `attention._attention_tile`), so a row's bits are the launched step's (R7).
Each phase is a call, not inlined: inlined, every phase's values were live at once and the kernel took 243
registers a thread for sm_90 (at 4 warps), where it takes about 165 so; at the attention's 8 warps, 110 with
Triton 3.9 and 128 with 3.6 (docs/performance.md).

What it takes: 4-bit weights in kvserve's kernel (packed bfloat16 FMAs, row major), each kind's layers one
[layers, ...] buffer, the norms' weights one [layers, 2, hidden] buffer, the caches one [layers, ...] tensor
each; one row. `layers/persistent_step.py` builds these from a model and runs the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvserve.kernels.gpu import INTERPRET, cdiv
from kvserve.kernels.gpu import attention as att
from kvserve.kernels.gpu import matmul as mm
from kvserve.kernels.gpu.norm import row_width

# Polls of the barrier's count before it gives up (seconds): a grid whose programs cannot all be resident
# sets `timed_out` and leaves that step wrong instead of hanging the GPU. The engine's grid is sized so that
# they can (layers/persistent_step.PROGRAMS_PER_SM, checked for sm_90 by the compile test; tests/test_cuda.py
# reads the flag); a program kept waiting by another kernel starts when that one ends.
BARRIER_SPINS = 1 << 24


@triton.jit
def grid_barrier(count_ptr, target, timed_out_ptr, SPINS: tl.constexpr):
    """Wait until every program has arrived (the count reaches `target`); each program's stores before it are
    seen by every program's loads after it. One thread a program counts and polls (Triton's scalar atomics;
    for sm_90 the poll is a strong load and an L1 invalidation). Once a barrier has given up, no later one
    waits."""
    tl.debug_barrier()  # this program's stores issued
    tl.atomic_add(count_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
    spins = tl.where(tl.load(timed_out_ptr, volatile=True) != 0, SPINS, 0)
    while (seen < target) & (spins < SPINS):
        seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
        spins += 1
    if seen < target:
        tl.store(timed_out_ptr, 1)
    tl.debug_barrier()


@triton.jit(noinline=True)
def _matmul_phase(
    x_ptr, out_ptr, partial_ptr, counters_ptr, packed_ptr, scales_ptr, mins_ptr, layer, rope, norm,
    N: tl.constexpr, K: tl.constexpr, K_PER_SPLIT: tl.constexpr, GATED: tl.constexpr, ROPE: tl.constexpr,
    CACHE_BLOCK: tl.constexpr, NORM: tl.constexpr, NORM_ADD: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """This program's tiles of a one-row 4-bit matmul of layer `layer`, as `matmul.int4_matmul` launches it for
    one row: packed bfloat16 FMAs, the K splits (if any) added by each tile's last split; `rope` and `norm` its
    epilogue's and prologue's (`matmul._rope_args`, `NormedRows.args`), where ROPE and NORM."""
    packed_ptr += layer * (N * K // 2)
    scales_ptr += layer * (N * (K // 32))
    mins_ptr += layer * (N * (K // 32))
    tiles_n = tl.cdiv(N, BLOCK_N)
    splits = tl.cdiv(K, K_PER_SPLIT)
    for t in range(tl.program_id(0), tiles_n * splits, tl.num_programs(0)):
        mm._int4_tile(
            x_ptr, out_ptr, partial_ptr, counters_ptr, None, 1, N, K, K, N, N, K_PER_SPLIT,
            packed_ptr, scales_ptr, mins_ptr, K // 2, K // 32, K // 32,
            False, K > K_PER_SPLIT, K > K_PER_SPLIT, K % BLOCK_K == 0, INTERPRET, BLOCK_M, BLOCK_N, BLOCK_K,
            PACKED_BF16=True, GATED=GATED, rope=rope, ROPE=ROPE, CACHE_BLOCK=CACHE_BLOCK, norm=norm, NORM=NORM,
            NORM_ADD=NORM_ADD, tile_m=0, tile_n=t // splits, split=t % splits, tiles_n=tiles_n, splits=splits,
        )  # fmt: skip


@triton.jit(noinline=True)
def _attention_phase(
    q_ptr, k_cache, v_cache, out_ptr, part_m, part_denom, part_acc, counters_ptr, block_tables, positions,
    tile_seq, tile_first, tile_len, scale, stride_kb, stride_ks, stride_kh, stride_table,
    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, CACHE_BLOCK: tl.constexpr,
    SPLITS: tl.constexpr, DOT_DTYPE: tl.constexpr, ROWS: tl.constexpr, KEYS: tl.constexpr,
    SPLIT_KEYS: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """This program's (KV head, key split)s of the row's attention over the paged cache (`paged_attention` for
    one token, no window, caches of q's dtype), each head's last split to finish merging them."""
    GROUP: tl.constexpr = HEADS // KV_HEADS
    for t in range(tl.program_id(0), KV_HEADS * SPLITS, tl.num_programs(0)):
        att._attention_tile(
            q_ptr, k_cache, v_cache, out_ptr, part_m, part_denom, part_acc, counters_ptr, block_tables, positions,
            tile_seq, tile_first, tile_len, scale, 0, HEADS * HEAD_DIM, HEAD_DIM, HEADS * HEAD_DIM, HEAD_DIM,
            stride_kb, stride_ks, stride_kh, stride_kb, stride_ks, stride_kh, stride_table, HEADS, HEADS,
            part_m, part_m, part_m, DOT_DTYPE, GROUP, ROWS, CACHE_BLOCK, HEAD_DIM, HEAD_DIM, KEYS, SPLIT_KEYS,
            SPLITS > 1, SPLITS > 1, False, INTERPRET,
            tile_at=0, kv_head_at=t // SPLITS, split_at=t % SPLITS, kv_heads=KV_HEADS, splits=SPLITS,
        )  # fmt: skip


@triton.jit
def _decode_layers_kernel(
    x_ptr, resid_a, resid_b, q_ptr, attn_ptr, o_ptr, act_ptr, down_ptr, partial_ptr, counters_ptr, count_ptr,
    timed_out_ptr, layers, qkv_w, qkv_s, qkv_m, o_w, o_s, o_m, gate_up_w, gate_up_s, gate_up_m, down_w, down_s,
    down_m, norm_weights, eps, cos_ptr, sin_ptr, stride_ct, stride_st, k_cache, v_cache, cache_layer, slots,
    stride_kb, stride_ks, stride_kh, part_m, part_denom, part_acc, attention_counters, block_tables, positions,
    tile_seq, tile_first, tile_len, scale, stride_table, empty,
    HIDDEN: tl.constexpr, INTER: tl.constexpr, HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, CACHE_BLOCK: tl.constexpr, SPLITS: tl.constexpr, SPLIT_QKV: tl.constexpr,
    SPLIT_O: tl.constexpr, SPLIT_GATE_UP: tl.constexpr, SPLIT_DOWN: tl.constexpr, GATED: tl.constexpr,
    NORM: tl.constexpr, DOT_DTYPE: tl.constexpr, ROWS: tl.constexpr, KEYS: tl.constexpr, SPLIT_KEYS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr,
    SPINS: tl.constexpr,
):  # fmt: skip
    """Every phase of `layers` decoder layers for the one row x [1, HIDDEN] (the embedding): the residual stream
    goes x -> resid_b in layer 0, then resid_b -> resid_a (the attention's norm adds down's output) -> resid_b
    (the MLP's norm adds o's); the last layer leaves the stream in resid_b and its MLP output in down_ptr.
    `empty`: (), a phase's rope or norm where it has none."""
    QKV: tl.constexpr = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    Q: tl.constexpr = HEADS * HEAD_DIM
    for phase in range(0, 5 * layers):
        layer = phase // 5
        step = phase % 5
        attn_weight = norm_weights + layer * (2 * HIDDEN)
        k_layer = k_cache + layer.to(tl.int64) * cache_layer  # (a pool's layers may span more than 2^31 elements)
        v_layer = v_cache + layer.to(tl.int64) * cache_layer
        if step == 0:
            rope = (cos_ptr, sin_ptr, k_layer, v_layer, slots, stride_ct, stride_st, stride_kb, stride_ks, stride_kh,
                    stride_kb, stride_ks, stride_kh, HEADS, KV_HEADS)  # fmt: skip
            if layer == 0:  # the embedding normalized as it is
                _matmul_phase(
                    x_ptr, q_ptr, partial_ptr, counters_ptr, qkv_w, qkv_s, qkv_m, layer, rope,
                    (x_ptr, HIDDEN, attn_weight, x_ptr, HIDDEN, eps), QKV, HIDDEN, SPLIT_QKV, 0, HEAD_DIM,
                    CACHE_BLOCK, NORM, False, BLOCK_M, BLOCK_N, BLOCK_K, INTERPRET,
                )  # fmt: skip
            else:
                _matmul_phase(
                    resid_b, q_ptr, partial_ptr, counters_ptr, qkv_w, qkv_s, qkv_m, layer, rope,
                    (down_ptr, HIDDEN, attn_weight, resid_a, HIDDEN, eps), QKV, HIDDEN, SPLIT_QKV, 0, HEAD_DIM,
                    CACHE_BLOCK, NORM, True, BLOCK_M, BLOCK_N, BLOCK_K, INTERPRET,
                )  # fmt: skip
        elif step == 1:
            _attention_phase(
                q_ptr, k_layer, v_layer, attn_ptr, part_m, part_denom, part_acc, attention_counters, block_tables,
                positions, tile_seq, tile_first, tile_len, scale, stride_kb, stride_ks, stride_kh, stride_table,
                HEADS, KV_HEADS, HEAD_DIM, CACHE_BLOCK, SPLITS, DOT_DTYPE, ROWS, KEYS, SPLIT_KEYS, INTERPRET,
            )  # fmt: skip
        elif step == 2:
            _matmul_phase(
                attn_ptr, o_ptr, partial_ptr, counters_ptr, o_w, o_s, o_m, layer, empty, empty, HIDDEN, Q, SPLIT_O,
                0, 0, 0, 0, False, BLOCK_M, BLOCK_N, BLOCK_K, INTERPRET,
            )  # fmt: skip
        elif step == 3:
            stream = resid_a
            if layer == 0:  # (the embedding, normalized as it is by q/k/v)
                stream = x_ptr
            ffn = (o_ptr, HIDDEN, attn_weight + HIDDEN, resid_b, HIDDEN, eps)
            _matmul_phase(
                stream, act_ptr, partial_ptr, counters_ptr, gate_up_w, gate_up_s, gate_up_m, layer, empty, ffn,
                2 * INTER, HIDDEN, SPLIT_GATE_UP, GATED, 0, 0, NORM, True, BLOCK_M, BLOCK_N, BLOCK_K, INTERPRET,
            )  # fmt: skip
        else:
            _matmul_phase(
                act_ptr, down_ptr, partial_ptr, counters_ptr, down_w, down_s, down_m, layer, empty, empty, HIDDEN, INTER,
                SPLIT_DOWN, 0, 0, 0, 0, False, BLOCK_M, BLOCK_N, BLOCK_K, INTERPRET,
            )  # fmt: skip
        grid_barrier(count_ptr, (phase + 1) * tl.num_programs(0), timed_out_ptr, SPINS)


class Workspace:
    """A persistent step's buffers for one row: the residual stream's two, each phase's output, the K splits'
    sums and counters, the attention's split states (per key splits), the barrier's count and give-up flag."""

    def __init__(self, shapes: Shapes, device: torch.device | str) -> None:
        bf16, f32, i32 = torch.bfloat16, torch.float32, torch.int32
        self.device = torch.device(device)
        row = lambda width, dtype=bf16: torch.empty(1, width, dtype=dtype, device=device)  # noqa: E731
        self.resid_a, self.resid_b = row(shapes.hidden), row(shapes.hidden)
        self.q, self.attn = row(shapes.q_size), row(shapes.q_size)
        self.o, self.act, self.down = row(shapes.hidden), row(shapes.inter), row(shapes.hidden)
        widest = max(n * cdiv(k, split) for n, k, split in shapes.matmuls())
        self.partial = torch.empty(widest, dtype=f32, device=device)  # one phase's K splits' sums at a time
        self.counters = mm.split_counters(device)
        self.count = torch.zeros(1, dtype=i32, device=device)
        self.timed_out = torch.zeros(1, dtype=i32, device=device)
        self._parts: dict[int, tuple[torch.Tensor, ...]] = {}
        self.heads, self.head_dim = shapes.heads, shapes.head_dim

    def parts(self, splits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The attention's running max, sum and output per key split and query head (`paged_attention`'s)."""
        if splits not in self._parts:
            state = (splits, 1, self.heads)
            f32 = dict(dtype=torch.float32, device=self.device)
            acc = torch.empty(*state, self.head_dim, **f32)
            self._parts[splits] = (torch.empty(state, **f32), torch.empty(state, **f32), acc)
        return self._parts[splits]


@dataclass(frozen=True)
class Shapes:
    """A model's one-row step: its widths, heads and each 4-bit matmul's K split (`matmul.config_for`)."""

    hidden: int
    inter: int
    heads: int
    kv_heads: int
    head_dim: int

    @property
    def q_size(self) -> int:
        return self.heads * self.head_dim

    def matmuls(self) -> list[tuple[int, int, int]]:
        """(N, K, K a split) of q/k/v, o, gate/up and down."""
        qkv = (self.heads + 2 * self.kv_heads) * self.head_dim
        sizes = [
            (qkv, self.hidden),
            (self.hidden, self.q_size),
            (2 * self.inter, self.hidden),
            (self.hidden, self.inter),
        ]
        return [(n, k, mm.config_for(mm.INT4_CONFIG, n, k).k_per_split or k) for n, k in sizes]


def decode_layers(
    x: torch.Tensor,
    weights: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    norm_weights: torch.Tensor,
    eps: float,
    gated: int,
    cos: torch.Tensor,
    sin_signed: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata,
    scale: float,
    shapes: Shapes,
    work: Workspace,
    programs: int,
    maxnreg: int | None = None,
    spins: int = BARRIER_SPINS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder layers for the one row x [1, H] (the embedding): (the residual stream, the last layer's MLP
    output), for the final norm to add. `weights`: (codes, scales, mins) [layers, ...] of q/k/v (q's and k's
    rows paired for RoPE), o, gate/up (interleaved for the gated activation `gated`: 1 SiLU, 2 tanh-GELU) and
    down, bfloat16 scales and mins; `norm_weights` [layers, 2, H] (the attention's, the MLP's); cos, sin_signed
    [1, 1, D]; k_cache, v_cache [layers, blocks, block_size, Hkv, D] bfloat16; `metadata`: the step's slots,
    block table, tiles and key splits (layers/attention_triton.TritonAttentionMetadata); `programs` all
    resident at once (a grid barrier waits for every one); `maxnreg`, a cap on the kernel's registers a thread,
    and `spins`, the polls before a barrier gives up (bench/gpu_persistent.py's runs). The kernel runs with the
    attention kernel's warps (`attention.NUM_WARPS`): the attention's row sums follow the layout, so that is
    what gives its bits; the matmuls' tiles sum along K in their MMAs' order, whatever the warps."""
    layers, _, block_size, _, _ = k_cache.shape
    assert k_cache.shape == v_cache.shape and k_cache.is_contiguous() and v_cache.is_contiguous(), k_cache.shape
    assert x.shape == (1, shapes.hidden) and norm_weights.shape == (layers, 2, shapes.hidden), norm_weights.shape
    splits = metadata.num_splits
    part_m, part_denom, part_acc = work.parts(splits)
    counters = metadata.split_counters
    if splits > 1:  # each KV head's last split merges them
        assert counters is not None and counters.numel() >= shapes.kv_heads, "key splits merge by their counters"
    else:
        counters = part_m  # (not used)
    (_, _, split_qkv), (_, _, split_o), (_, _, split_gate_up), (_, _, split_down) = shapes.matmuls()
    config, tables = mm.INT4_CONFIG, metadata.block_tables
    work.count.zero_()
    work.timed_out.zero_()  # (a step's own: a give-up does not carry into the next)
    _decode_layers_kernel[(programs,)](
        x, work.resid_a, work.resid_b, work.q, work.attn, work.o, work.act, work.down, work.partial, work.counters,
        work.count, work.timed_out, layers, *(t for kind in weights for t in kind), norm_weights, eps, cos,
        sin_signed, cos.stride(0), sin_signed.stride(0), k_cache, v_cache, k_cache.stride(0), metadata.slot_mapping,
        *k_cache.stride()[1:4], part_m, part_denom, part_acc, counters, tables, metadata.positions, metadata.tile_seq,
        metadata.tile_first, metadata.tile_len, scale, tables.stride(0), (),
        HIDDEN=shapes.hidden, INTER=shapes.inter, HEADS=shapes.heads, KV_HEADS=shapes.kv_heads,
        HEAD_DIM=shapes.head_dim, CACHE_BLOCK=block_size, SPLITS=splits, SPLIT_QKV=split_qkv, SPLIT_O=split_o,
        SPLIT_GATE_UP=split_gate_up, SPLIT_DOWN=split_down, GATED=gated, NORM=row_width(shapes.hidden),
        DOT_DTYPE=att._TL_DTYPES[k_cache.dtype], ROWS=att._rows(shapes.heads // shapes.kv_heads), KEYS=att.BLOCK_N,
        SPLIT_KEYS=att.SPLIT_KEYS, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        INTERPRET=INTERPRET, SPINS=spins, num_warps=att.NUM_WARPS, num_stages=config.num_stages,
        enable_fp_fusion=True,  # (no programmatic dependent launch: one kernel)
        **({} if maxnreg is None else {"maxnreg": maxnreg}),
    )  # fmt: skip
    return work.resid_b, work.down
