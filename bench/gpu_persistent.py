"""What one persistent kernel for a decode step saves at one row (issue 32): a synthetic chain, and kvserve's own.

A one-stream 4-bit 1B step on the H200 took 1.02 ms of graph for about 0.6 GB of weights that memory reads
in 0.15 ms: each of its kernels (about 115 today) pays a floor its bytes do not set (a grid's programs
dispatched and ramping up, the last ones draining), and earlier sessions named "one persistent kernel for
a decode step's layers" as the way past it (docs/performance.md). This measured first whether one could pay,
before kvserve had one (`KVSERVE_PERSISTENT_STEP`, since the thirteenth session). A chain of one-row 4-bit matrix-vector products in the 1B step's
sizes and order (per layer: q/k/v 3072 x 2048, a small attention-like step, o 2048 x 2048, gate and up
16384 x 2048, down 2048 x 8192 taking act(gate) * up; 16 layers, 80 phases, each reading the one before's
output) runs three ways, with the same tile code and so the same bits:

- `launched`: a kernel a phase, a program a tile, replayed as one CUDA graph (as the engine's step is);
- `persistent`: one kernel of `--programs-per-sm` programs a multiprocessor, looping over the phases and
  over each phase's tiles, the programs meeting at a grid-wide barrier (an atomic count) between phases;
- `persistent-prefetch`: the same, each program asking L2 for its next phase's weight rows
  (`prefetch.global.L2`) before it waits at the barrier, so that the loads after it find them there;
- `launched-looped`: a kernel a phase of as many programs as the persistent kernel, each looping over
  tiles (and so with about its registers and bytes in flight): against it, the boundaries' cost alone;
- `launched-real` and `persistent-real` (`RealStep`, run first): a model's 4-bit decoder layers for one token
  at position 200, as kvserve's kernels run them with the norms in the matmuls' prologues
  (`layers/gpu.FUSE_NORMS`): the residual adds and norms in q/k/v's and gate/up's prologues, RoPE and the
  cache's write in q/k/v's epilogue, the paged attention in the engine's one-row key splits, SiLU in gate/up's
  epilogue, K splits added by each tile's last split, bfloat16 activations; a kernel a phase in the graph
  (`matmul.int4_matmul`, `attention._attention_kernel`) against kvserve's persistent step
  (`kernels/gpu/persistent.decode_layers`, `KVSERVE_PERSISTENT_STEP`): what persistence saves with the code
  the engine would run (`real_saved_us_per_phase`), at its 8 warps: uncapped (for sm_90 120 registers a thread
  with Triton 3.9, 177 with 3.6, the GPU machine's: one program a multiprocessor), and (on a GPU)
  `persistent-real-capped`, two programs a multiprocessor at 128 registers (as the engine runs it, no spills)
  and three at 80 (88-104 bytes of spills).

Each run's `step_us` (the graph's replay), `phase_us` (per phase) and `tb_s` (the weights' bytes per
second); `agrees` (its output within float32 rounding of `launched`'s, `same_bits` if equal: a barrier that
let a program read too early would show here), after its first run and after the replays that time it
(`replays_agree`), and `barrier_counts_ok` (each program counted once a barrier). How to read it:
`saved_us_per_phase`, `launched` less the fastest persistent run a phase, is what a persistent step would
save a kernel; kvserve's 4-bit step has about 115, and must lose 0.34 ms for 1.5x bf16, so from 3 us it is
the way to the target and worth its sessions, and at 1 us or less the floors lie inside the kernels, not
between them (`gpu_timeline.py` says where). `boundary_us_per_phase`, `launched-looped` less the persistent
kernel at the same programs, is the boundary's cost alone. A barrier that gives up (`timed_out`: programs
not all resident) ends that run, and more programs are not tried.

    PYTHONPATH=. python bench/gpu_persistent.py --out $OUT/persistent.json     # about a minute (not yet timed)
    # the plumbing on a CPU (Triton's interpreter, tiny shapes; one program, so every barrier passes at once):
    PYTHONPATH=. TRITON_INTERPRET=1 python bench/gpu_persistent.py --device cpu --shapes tiny --layers 2
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import time
from functools import partial
from pathlib import Path

import torch
import triton
import triton.language as tl

from bench import gpu_kernels
from kvserve.kernels.gpu import INTERPRET, attention, persistent
from kvserve.kernels.gpu import matmul as mm
from kvserve.kernels.gpu.common import cast, prefetch_rows
from kvserve.kernels.gpu.norm import NormedRows
from kvserve.kernels.gpu.persistent import grid_barrier
from kvserve.layers.attention_triton import TritonAttentionMetadata
from kvserve.layers.persistent_step import registers_cap

# (q/k/v outputs, hidden, intermediate): the phases' shapes, as gpu_kernels.py's SHAPES (hidden and intermediate,
# a K each, multiples of BLOCK_K; q/k/v at least 1.25 hidden, as the attention's stand-in reads v there)
SHAPES = {"llama1b": (3072, 2048, 8192), "tiny": (384, 256, 512)}
# RealStep's: every layer K-split as kvserve's config splits the 1B shapes (its tiny shapes are wider than Step's)
REAL_SHAPES = {"llama1b": SHAPES["llama1b"], "tiny": (1536, 1024, 2048)}
HEAD_DIM = 64  # the real chain's heads: the 1B shapes' 32 query and 8 KV heads (tiny: 16 and 4)
POSITION = 200  # the real chain's token: 200 keys before it in the cache (the test's: 600, two key splits)
# the furthest position the engine's one-row decode graph is captured for (gpu.py's models: an 8,192-token context):
# its attention's key splits, each (KV head, split) a program, the last split of a head merging them (counters)
MAX_POSITION = 8191
CACHE_BLOCK = 16  # positions a cache block
EPS = 1e-5
CAPPED_PER_SM = (2, 3)  # `persistent-real-capped`'s programs a multiprocessor, its registers capped to let them in
MODES = ("launched", "launched-looped", "persistent", "persistent-prefetch")
BLOCK_N = 16  # outputs a tile
BLOCK_K = 256  # inputs a step of a tile's loop: 128 bytes of each of its rows' codes
NUM_WARPS = 4
STAGES = tl.constexpr(4)  # a tile's K steps in flight (Triton's pipeliner: cp.async, steps ahead)
BARRIER_SPINS = 1 << 16  # polls of the count before a barrier gives up (about 50 ms): a probe must not hang its GPU
_INTERPRET = tl.constexpr(INTERPRET)  # (a jit function's globals must be constexprs)
CODE_SCALE = tl.constexpr(1 / math.sqrt((16 * 16 - 1) / 12))  # 1 / the standard deviation of a code (0..15, less 8)


@triton.jit
def _inputs(x_ptr, ks, K: tl.constexpr, GATED: tl.constexpr):
    """x[ks], or with GATED act(gate) * up of x = [gate | up] (2K values), SiLU as the engine's default."""
    # (written by other multiprocessors the phase before: what makes that safe is the barrier's acquire, which
    # empties this multiprocessor's L1; the pipeliner turns these loads into cp.async through L1 anyway)
    x = tl.load(x_ptr + ks, cache_modifier=".cg")
    if GATED:
        up = tl.load(x_ptr + K + ks, cache_modifier=".cg")
        x = x / (1.0 + tl.exp(-x)) * up
    return x


@triton.jit
def _gemv_tile(
    codes_ptr, x_ptr, y_ptr, tile, K: tl.constexpr, GATED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):
    """y[tile's BLOCK_N outputs] = codes [N, K / 2] (two 4-bit codes a byte, less 8) @ x, scaled to keep its size."""
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    i = tl.arange(0, BLOCK_K // 2)
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        byte = tl.load(codes_ptr + rows.to(tl.int64)[:, None] * (K // 2) + (k0 // 2 + i)[None, :])
        low = (byte & 15).to(tl.float32) - 8.0
        high = (byte >> 4).to(tl.float32) - 8.0
        x_low = _inputs(x_ptr, k0 + 2 * i, K, GATED)
        x_high = _inputs(x_ptr, k0 + 2 * i + 1, K, GATED)
        acc += tl.sum(low * x_low[None, :] + high * x_high[None, :], axis=1)
    tl.store(y_ptr + rows, acc * (CODE_SCALE / K**0.5))


@triton.jit
def _attend_tile(x_ptr, y_ptr, tile, HIDDEN: tl.constexpr, BLOCK_N: tl.constexpr):
    """The attention's stand-in, a step that reads little (q/k/v [QKV] in, [HIDDEN] out): q + v's head, halved,
    in float32 and rounded once to y's dtype (for RealStep's bfloat16, as kvserve's kernels round)."""
    at = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    q = tl.load(x_ptr + at, cache_modifier=".cg").to(tl.float32)
    v = tl.load(x_ptr + HIDDEN + at % (HIDDEN // 4), cache_modifier=".cg").to(tl.float32)
    tl.store(y_ptr + at, cast((q + v) * 0.5, y_ptr.dtype.element_ty, _INTERPRET))


@triton.jit
def _weight_offsets(QKV: tl.constexpr, HIDDEN: tl.constexpr, INTER: tl.constexpr):
    """Where o's, gate/up's and down's codes start in a layer's (after q/k/v's; `Step.layer_bytes` the whole)."""
    o_at = QKV * (HIDDEN // 2)
    gate_up_at = o_at + HIDDEN * (HIDDEN // 2)
    return o_at, gate_up_at, gate_up_at + 2 * INTER * (HIDDEN // 2)


@triton.jit
def _phase(
    phase, codes_ptr, x_ptr, qkv_ptr, attn_ptr, gate_up_ptr, tile,
    QKV: tl.constexpr, HIDDEN: tl.constexpr, INTER: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Tile `tile` of phase `phase` (5 a layer: q/k/v, attention, o, gate and up, down), the layer's codes at
    codes_ptr; x: the layer's input and its output, which the next layer takes."""
    o_at, gate_up_at, down_at = _weight_offsets(QKV, HIDDEN, INTER)
    step = phase % 5
    if step == 0:
        _gemv_tile(codes_ptr, x_ptr, qkv_ptr, tile, HIDDEN, False, BLOCK_N, BLOCK_K)
    elif step == 1:
        _attend_tile(qkv_ptr, attn_ptr, tile, HIDDEN, BLOCK_N)
    elif step == 2:  # o's output is the MLP's input (the residual stream left out)
        _gemv_tile(codes_ptr + o_at, attn_ptr, x_ptr, tile, HIDDEN, False, BLOCK_N, BLOCK_K)
    elif step == 3:
        _gemv_tile(codes_ptr + gate_up_at, x_ptr, gate_up_ptr, tile, HIDDEN, False, BLOCK_N, BLOCK_K)
    else:
        _gemv_tile(codes_ptr + down_at, gate_up_ptr, x_ptr, tile, INTER, True, BLOCK_N, BLOCK_K)


@triton.jit
def _tiles(phase, QKV: tl.constexpr, HIDDEN: tl.constexpr, INTER: tl.constexpr, BLOCK_N: tl.constexpr):
    step = phase % 5
    return (HIDDEN + (step == 0) * (QKV - HIDDEN) + (step == 3) * (2 * INTER - HIDDEN)) // BLOCK_N


@triton.jit(do_not_specialize=["phase"])  # one binary for every phase
def _phase_kernel(
    phase, codes_ptr, x_ptr, qkv_ptr, attn_ptr, gate_up_ptr,
    QKV: tl.constexpr, HIDDEN: tl.constexpr, INTER: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    LOOP: tl.constexpr,
):  # fmt: skip
    """`launched`: one phase, a program a tile; with LOOP (`launched-looped`), fewer programs, each taking
    tiles pid, pid + programs, ... as the persistent kernel's do (and with about its registers)."""
    if LOOP:
        for tile in range(tl.program_id(0), _tiles(phase, QKV, HIDDEN, INTER, BLOCK_N), tl.num_programs(0)):
            _phase(phase, codes_ptr, x_ptr, qkv_ptr, attn_ptr, gate_up_ptr, tile, QKV, HIDDEN, INTER, BLOCK_N, BLOCK_K)
    else:
        tile = tl.program_id(0)
        _phase(phase, codes_ptr, x_ptr, qkv_ptr, attn_ptr, gate_up_ptr, tile, QKV, HIDDEN, INTER, BLOCK_N, BLOCK_K)


@triton.jit
def _prefetch_tiles(codes_ptr, N: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr, LINES: tl.constexpr):
    """Ask L2 for the first LINES 128-byte lines of the weight rows of this program's tiles of a phase, without waiting."""
    for tile in range(tl.program_id(0), N // BLOCK_N, tl.num_programs(0)):
        prefetch_rows(codes_ptr, tile * BLOCK_N + tl.arange(0, BLOCK_N), N, K // 2, 0, K // 2, LINES)


@triton.jit
def _prefetch_phase(
    phase, codes_ptr, QKV: tl.constexpr, HIDDEN: tl.constexpr, INTER: tl.constexpr, BLOCK_N: tl.constexpr,
    LINES_HIDDEN: tl.constexpr, LINES_INTER: tl.constexpr,
):  # fmt: skip
    """`_prefetch_tiles` of phase `phase`'s weights (all of each row: LINES_HIDDEN or LINES_INTER lines), the layer's at codes_ptr."""
    o_at, gate_up_at, down_at = _weight_offsets(QKV, HIDDEN, INTER)
    step = phase % 5
    if step == 0:
        _prefetch_tiles(codes_ptr, QKV, HIDDEN, BLOCK_N, LINES_HIDDEN)
    elif step == 2:
        _prefetch_tiles(codes_ptr + o_at, HIDDEN, HIDDEN, BLOCK_N, LINES_HIDDEN)
    elif step == 3:
        _prefetch_tiles(codes_ptr + gate_up_at, 2 * INTER, HIDDEN, BLOCK_N, LINES_HIDDEN)
    elif step == 4:
        _prefetch_tiles(codes_ptr + down_at, HIDDEN, INTER, BLOCK_N, LINES_INTER)


@triton.jit
def _persistent_kernel(
    codes_ptr, x_ptr, qkv_ptr, attn_ptr, gate_up_ptr, count_ptr, timed_out_ptr, layers, layer_bytes,
    QKV: tl.constexpr, HIDDEN: tl.constexpr, INTER: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PREFETCH: tl.constexpr, SPINS: tl.constexpr,
):  # fmt: skip
    """`persistent` and `persistent-prefetch`: every phase of every layer, each program taking tiles
    pid, pid + programs, ..., a grid-wide barrier after each phase; a layer's codes layer_bytes after the last's."""
    for phase in range(0, 5 * layers):
        codes = codes_ptr + (phase // 5) * layer_bytes
        for tile in range(tl.program_id(0), _tiles(phase, QKV, HIDDEN, INTER, BLOCK_N), tl.num_programs(0)):
            _phase(phase, codes, x_ptr, qkv_ptr, attn_ptr, gate_up_ptr, tile, QKV, HIDDEN, INTER, BLOCK_N, BLOCK_K)
        if PREFETCH:  # (after the last phase, the first's: a hint, which changes nothing)
            ahead = (phase + 1) % (5 * layers)
            _prefetch_phase(
                ahead, codes_ptr + (ahead // 5) * layer_bytes, QKV, HIDDEN, INTER, BLOCK_N, HIDDEN // 256, INTER // 256
            )
        grid_barrier(count_ptr, (phase + 1) * tl.num_programs(0), timed_out_ptr, SPINS)


class RealStep:
    """The chain again as a model's 4-bit decoder layers run on kvserve's kernels, for one token at `position`
    (POSITION): per layer, the attention's norm (adding the last layer's MLP output to the residual stream)
    in q/k/v's prologue, RoPE and the KV cache's write in its epilogue, the paged attention (its keys in the
    splits of the engine's one-row graph, MAX_POSITION's, each KV head's merged by its last split), o, the
    MLP's norm (adding o's output) in gate/up's prologue, SiLU in its epilogue, down; bfloat16 activations
    and scales, packed bfloat16 FMAs, the K splits added by each tile's last split. `launched-real`: a kernel
    a phase in a CUDA graph, as the engine's decode graph launches them with `layers/gpu.FUSE_NORMS` on;
    `persistent-real`: kvserve's persistent step (kernels/gpu/persistent.decode_layers), the same tile code in
    one kernel with grid barriers at the attention kernel's warps, so the same bits."""

    def __init__(self, shapes: str, layers: int, device: str, gen: torch.Generator, position: int = POSITION) -> None:
        self.qkv, self.hidden, self.inter = REAL_SHAPES[shapes]
        self.layers, self.device, self.position = layers, device, position
        self.heads, self.kv_heads = self.hidden // HEAD_DIM, (self.qkv - self.hidden) // (2 * HEAD_DIM)
        self.shapes = persistent.Shapes(self.hidden, self.inter, self.heads, self.kv_heads, HEAD_DIM)
        bf16 = torch.bfloat16
        self.weights = {}
        for name, n, k in (
            ("qkv", self.qkv, self.hidden), ("o", self.hidden, self.hidden),
            ("gate_up", 2 * self.inter, self.hidden), ("down", self.hidden, self.inter),
        ):  # fmt: skip
            codes = torch.randint(0, 256, (layers, n, k // 2), dtype=torch.uint8, device=device, generator=gen)
            # w = scale * (code - 8): mean 0, and about unit outputs for unit inputs
            scales = torch.full((layers, n, k // 32), 1 / (4.6 * k**0.5), device=device).to(bf16)
            self.weights[name] = (codes, scales, (-8 * scales.float()).to(bf16))
        self.config = mm.INT4_CONFIG
        randn = partial(torch.randn, device=device, generator=gen)
        self.input = randn(1, self.hidden).to(bf16)
        self.norm_weights = (1 + 0.1 * randn(layers, 2, self.hidden)).to(bf16)  # each layer's two norms'
        # each layer's cache: `position` keys before the token's (a prompt's), a block table of consecutive blocks
        cache_shape = (layers, position // CACHE_BLOCK + 1, CACHE_BLOCK, self.kv_heads, HEAD_DIM)
        self.k_cache, self.v_cache = randn(*cache_shape).to(bf16), randn(*cache_shape).to(bf16)
        int32 = partial(torch.tensor, dtype=torch.int32, device=device)
        self.attention_counters = attention.attention_counters(device)
        self.metadata = TritonAttentionMetadata(
            slot_mapping=int32([position]),
            block_tables=int32([list(range(cache_shape[1]))]),
            positions=int32([position]),
            tile_seq=int32([0]),
            tile_first=int32([0]),
            tile_len=int32([1]),
            num_splits=attention.num_splits_for(MAX_POSITION),
            split_counters=self.attention_counters,
        )
        angles = position * 10000.0 ** (-torch.arange(0, HEAD_DIM, 2, device=device) / HEAD_DIM)
        self.cos = angles.cos().repeat(2).to(bf16).view(1, 1, HEAD_DIM)
        self.sin_signed = torch.cat((-angles.sin(), angles.sin())).to(bf16).view(1, 1, HEAD_DIM)
        self.work = persistent.Workspace(self.shapes, device)
        # the step's output (the last layer's MLP output) and the barrier's, as `Step`'s
        self.x, self.count, self.timed_out, self.counters = (
            self.work.down,
            self.work.count,
            self.work.timed_out,
            self.work.counters,
        )
        self.weight_bytes = sum(t.numel() * t.element_size() for w in self.weights.values() for t in w)

    def reference(self) -> torch.Tensor:
        """The same layers in PyTorch (float64, over each cache's keys before the token's), for the plumbing's
        check: the weights' rows as the kernels' epilogues take them (q's and k's dimensions paired for RoPE,
        gate and up interleaved)."""
        f64, heads, kv_heads, position = torch.float64, self.heads, self.kv_heads, self.position

        def weight(name: str, layer: int) -> torch.Tensor:
            codes, scales, mins = (t[layer].to(f64) if t.is_floating_point() else t[layer] for t in self.weights[name])
            byte = codes.long().view(codes.shape[0], -1, 16)  # a group's byte j: input j, and j + 16 in its high nibble
            values = torch.cat((byte & 15, byte >> 4), dim=-1).flatten(1).to(f64)
            return values * scales.repeat_interleave(32, 1) + mins.repeat_interleave(32, 1)

        def norm(x: torch.Tensor, layer: int, which: int) -> torch.Tensor:
            return x * torch.rsqrt(x.pow(2).mean() + EPS) * self.norm_weights[layer, which].to(f64)

        def rope(t: torch.Tensor) -> torch.Tensor:
            return t * self.cos.view(HEAD_DIM).to(f64) + t.roll(HEAD_DIM // 2, -1) * self.sin_signed.view(HEAD_DIM).to(
                f64
            )

        x, delta = self.input[0].to(f64), torch.zeros(self.hidden, dtype=f64, device=self.device)
        for layer in range(self.layers):
            keys = self.k_cache[layer].flatten(0, 1)[:position].to(f64)  # [position, Hkv, D]
            values = self.v_cache[layer].flatten(0, 1)[:position].to(f64)
            x = x + delta
            qkv = weight("qkv", layer) @ norm(x, layer, 0)
            qkv = mm.deinterleave_rope(qkv[None], heads, kv_heads, HEAD_DIM, dim=1)[0]
            q, k, v = (t.view(-1, HEAD_DIM) for t in qkv.split([self.hidden, *2 * [kv_heads * HEAD_DIM]]))
            group = heads // kv_heads
            k_all = torch.cat((keys, rope(k)[None])).repeat_interleave(group, 1)  # [position + 1, H, D]
            v_all = torch.cat((values, v[None])).repeat_interleave(group, 1)
            scores = torch.einsum("hd,phd->hp", rope(q), k_all) * HEAD_DIM**-0.5
            x = x + weight("o", layer) @ torch.einsum("hp,phd->hd", scores.softmax(-1), v_all).flatten()
            gate_up = weight("gate_up", layer) @ norm(x, layer, 1)
            gate, up = gate_up[0::2], gate_up[1::2]
            delta = weight("down", layer) @ (gate * torch.sigmoid(gate) * up)
        return delta[None]

    def launched(self, programs: int | None = None) -> None:
        """`launched-real`: a kernel a phase, as the engine launches them (`programs` unused)."""
        stream, delta = self.input, None
        metadata = self.metadata
        for layer in range(self.layers):
            w = {name: [t[layer] for t in weights] for name, weights in self.weights.items()}
            k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]
            total = None if delta is None else torch.empty_like(stream)
            normed = NormedRows(stream, delta, self.norm_weights[layer, 0], EPS, total)
            stream = stream if total is None else total
            rope = mm.RopeStore(self.cos, self.sin_signed, k_cache, v_cache, metadata.slot_mapping, self.heads)
            q = mm.int4_matmul(normed, *w["qkv"], packed_bf16=True, counters=self.counters, rope=rope)
            attn = attention.paged_attention(
                q.view(1, self.heads, HEAD_DIM), k_cache, v_cache, metadata.block_tables, metadata.positions,
                metadata.tile_seq, metadata.tile_first, metadata.tile_len, HEAD_DIM**-0.5, 0, metadata.num_splits,
                counters=self.attention_counters,
            )  # fmt: skip
            o = mm.int4_matmul(attn.view(1, self.hidden), *w["o"], packed_bf16=True, counters=self.counters)
            total = torch.empty_like(stream)
            normed = NormedRows(stream, o, self.norm_weights[layer, 1], EPS, total)
            stream = total
            act = mm.int4_matmul(normed, *w["gate_up"], packed_bf16=True, counters=self.counters, activation="silu")
            delta = mm.int4_matmul(act, *w["down"], packed_bf16=True, counters=self.counters)
        self.x.copy_(delta)  # (one copy a step: the persistent kernel writes the last layer's MLP output there)

    def persistent(self, programs: int, prefetch: bool = False, maxnreg: int | None = None) -> None:
        """`persistent-real`: kvserve's persistent step on `programs` programs (`prefetch` unused); with
        `maxnreg`, its registers a thread capped there (`persistent-real-capped`: ptxas spills the rest)."""
        persistent.decode_layers(
            self.input, list(self.weights.values()), self.norm_weights, EPS, 1, self.cos, self.sin_signed,
            self.k_cache, self.v_cache, self.metadata, HEAD_DIM**-0.5, self.shapes, self.work, programs, maxnreg,
            BARRIER_SPINS,
        )  # fmt: skip


class Step:
    """A step's weights (one buffer of every layer's codes), activations and barrier count, on `device`."""

    def __init__(self, shapes: str, layers: int, device: str, gen: torch.Generator) -> None:
        self.qkv, self.hidden, self.inter = SHAPES[shapes]
        self.layers, self.device = layers, device
        hidden, inter = self.hidden, self.inter
        # codes of q/k/v, o and gate/up (each `hidden` inputs), then down's (`inter` inputs): two a byte
        self.layer_bytes = (self.qkv + hidden + 2 * inter) * hidden // 2 + hidden * inter // 2
        self.codes = torch.randint(
            0, 256, (layers * self.layer_bytes,), dtype=torch.uint8, device=device, generator=gen
        )
        self.input = torch.randn(self.hidden, device=device, generator=gen)
        self.x = torch.empty(self.hidden, device=device)
        self.qkv_out = torch.empty(self.qkv, device=device)
        self.attn_out = torch.empty(self.hidden, device=device)
        self.gate_up_out = torch.empty(2 * self.inter, device=device)
        self.count = torch.zeros(1, dtype=torch.int32, device=device)
        self.timed_out = torch.zeros(1, dtype=torch.int32, device=device)
        self.constexprs = {
            "QKV": self.qkv,
            "HIDDEN": self.hidden,
            "INTER": self.inter,
            "BLOCK_N": BLOCK_N,
            "BLOCK_K": BLOCK_K,
        }

    def buffers(self) -> tuple:
        return self.x, self.qkv_out, self.attn_out, self.gate_up_out

    def tiles(self, phase: int) -> int:
        return {0: self.qkv, 3: 2 * self.inter}.get(phase % 5, self.hidden) // BLOCK_N

    def launched(self, programs: int | None = None) -> None:
        """A kernel a phase: of a program a tile, or of at most `programs` programs."""
        self.x.copy_(self.input)
        for phase in range(5 * self.layers):
            codes = self.codes[(phase // 5) * self.layer_bytes :]
            grid = (min(self.tiles(phase), programs or self.tiles(phase)),)
            loop = programs is not None
            _phase_kernel[grid](phase, codes, *self.buffers(), **self.constexprs, LOOP=loop, num_warps=NUM_WARPS)

    def persistent(self, programs: int, prefetch: bool = False) -> None:
        """Every phase in one kernel of `programs` programs, each prefetching its next phase's weights or not."""
        self.x.copy_(self.input)
        self.count.zero_()
        _persistent_kernel[(programs,)](
            self.codes, *self.buffers(), self.count, self.timed_out, self.layers, self.layer_bytes,
            **self.constexprs, PREFETCH=prefetch, SPINS=BARRIER_SPINS, num_warps=NUM_WARPS,
        )  # fmt: skip

    def reference(self) -> torch.Tensor:
        """The same chain in PyTorch (float64), for the plumbing's check."""

        def gemv(codes: torch.Tensor, n: int, k: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            """codes' first n x k / 2 bytes times x, and the codes after them."""
            byte = codes[: n * k // 2].view(n, k // 2).long()
            w = torch.stack(((byte & 15) - 8, (byte >> 4) - 8), dim=-1).reshape(n, k).double()
            return w @ x * (CODE_SCALE.value / k**0.5), codes[n * k // 2 :]

        x = self.input.double()
        for layer in range(self.layers):
            codes = self.codes[layer * self.layer_bytes : (layer + 1) * self.layer_bytes]
            qkv, codes = gemv(codes, self.qkv, self.hidden, x)
            v = qkv[self.hidden :][torch.arange(self.hidden, device=x.device) % (self.hidden // 4)]
            x, codes = gemv(codes, self.hidden, self.hidden, (qkv[: self.hidden] + v) * 0.5)
            gate_up, codes = gemv(codes, 2 * self.inter, self.hidden, x)
            gate, up = gate_up.split(self.inter)
            x, _ = gemv(codes, self.hidden, self.inter, gate * torch.sigmoid(gate) * up)
        return x


def relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest difference over the largest magnitude of `expected`."""
    return (got.double() - expected.double()).abs().max().item() / expected.double().abs().max().item()


class BarrierGaveUp(RuntimeError):
    pass


def check(run: dict, step: Step, expected: torch.Tensor, phases: int) -> dict:
    """Record into `run` whether the step's last output is `expected`'s and its barriers held; raise if one gave up."""
    run["timed_out"] = bool(step.timed_out.item())
    if run["mode"].startswith("persistent"):  # each program counted once at each phase's barrier (one thread's atomic)
        run["barrier_counts_ok"] = step.count.item() == phases * run["programs"]
    run["same_bits"] = bool(torch.equal(step.x, expected))
    # the same tiles in another kernel may round alike or not; a barrier that let a program read its inputs
    # early would leave another layer's values (or none): far from expected
    run["relative_diff"] = relative(step.x, expected)
    run["agrees"] = run["relative_diff"] < 1e-4 and run.get("barrier_counts_ok", True)
    if run["timed_out"]:
        raise BarrierGaveUp("a grid barrier gave up waiting: the programs were not all resident")
    return run


def summarize(result: dict) -> None:
    """`saved_us_per_phase`: `launched` less the fastest persistent run whose every output agreed, a phase;
    `boundary_us_per_phase`: at the same programs, `launched-looped` less the persistent kernel (the boundary
    alone, without the persistent kernel's fewer programs in flight); and the ratios to `launched`."""

    def fastest(mode: str, programs: int | None = None) -> float | None:
        times = [
            r["step_us"] for r in result["runs"]
            if r["mode"] == mode and r["agrees"] and r["replays_agree"] and programs in (None, r["programs"])
        ]  # fmt: skip
        return min(times, default=None)

    def persistent(programs: int | None = None) -> float | None:
        return min(
            filter(None, (fastest("persistent", programs), fastest("persistent-prefetch", programs))), default=None
        )

    launched, phases = fastest("launched"), result["phases"]
    best = persistent()
    result["saved_us_per_phase"] = round((launched - best) / phases, 3) if launched and best else None
    real = fastest("launched-real")
    real_best = min(filter(None, (fastest("persistent-real"), fastest("persistent-real-capped"))), default=None)
    result["real_saved_us_per_phase"] = round((real - real_best) / phases, 3) if real and real_best else None
    result["real_persistent_over_launched"] = round(real_best / real, 3) if real and real_best else None
    boundaries = []
    for programs in {r["programs"] for r in result["runs"] if r["mode"] == "launched-looped"}:
        looped, best = fastest("launched-looped", programs), persistent(programs)
        if looped and best:
            boundaries.append((looped - best) / phases)
    result["boundary_us_per_phase"] = round(max(boundaries), 3) if boundaries else None
    for key, mode in (("persistent_over_launched", "persistent"), ("prefetch_over_launched", "persistent-prefetch")):
        best = fastest(mode)
        result[key] = round(best / launched, 3) if best and launched else None


def write(path: Path, result: dict) -> None:
    """The JSON, whole or not at all: written beside it, then renamed over it (a timeout may kill the probe)."""
    partial_path = path.with_suffix(".partial")
    partial_path.write_text(json.dumps(result, indent=1) + "\n")
    partial_path.replace(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shapes", default="llama1b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=16, help="decoder layers in the step (5 phases each)")
    parser.add_argument(
        "--programs-per-sm",
        default="1,2,3,4",
        help="comma-separated: the persistent kernels' programs a multiprocessor",
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/gpu_persistent.json"))
    args = parser.parse_args()
    started = time.perf_counter()
    gen = torch.Generator(device=args.device).manual_seed(0)
    step = Step(args.shapes, args.layers, args.device, gen)
    cuda = args.device == "cuda"
    sms = torch.cuda.get_device_properties(args.device).multi_processor_count if cuda else 1
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {
        "device": torch.cuda.get_device_name() if cuda else "cpu (Triton's interpreter)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "commit": commit,
        "shapes": args.shapes,
        "layers": args.layers,
        "phases": 5 * args.layers,
        "weight_bytes": step.codes.numel(),
        "multiprocessors": sms,
        "runs": [],
        "errors": [],
    }
    step.launched()
    expected = step.x.clone()
    result["relative_error"] = relative(expected, step.reference())  # float32 sums against float64: about 1e-6
    real = expected_real = None  # made at the first real run, inside its try: a failure there costs only those
    # the interpreter runs programs one after another, so there one program
    per_sm = dict.fromkeys(sms * int(p) if cuda else 1 for p in args.programs_per_sm.split(","))
    # kvserve's own layers first, as the engine runs them first (capped, two programs of 8 warps a multiprocessor:
    # a probe cut short has them), then uncapped and three capped a multiprocessor; then the synthetic chain
    capped = [("persistent-real-capped", per * sms) for per in CAPPED_PER_SM] if cuda else []
    cases = [("launched-real", None), *capped[:1]] + [("persistent-real", p) for p in per_sm] + capped[1:]
    cases += [("launched", None)] + [
        (mode, p) for p in per_sm for mode in MODES[1:] if cuda or mode != "persistent-prefetch"
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write(args.out, result)  # the device, the commit and the synthetic chain's check, whatever comes of the runs
    gave_up = {}  # per chain, the fewest programs its persistent kernel's barrier gave up at: not all resident
    for mode, programs in cases:
        is_real = "-real" in mode
        # (the capped kernel is resident where the other is not: its give-up is its own)
        chain_kind = "capped" if mode.endswith("-capped") else is_real
        if mode.startswith("persistent") and programs >= gave_up.get(chain_kind, math.inf):
            result["errors"].append(f"{mode} programs={programs}: not run, a barrier gave up at fewer")
            continue
        run = {"mode": mode, "programs": programs}
        try:
            if is_real and real is None:
                real = RealStep(args.shapes, args.layers, args.device, gen)
                result["real_weight_bytes"] = real.weight_bytes
                real.launched()
                expected_real = real.x.clone()
                result["real_finite"] = bool(expected_real.isfinite().all())
                # the layers in float64: about 0.015 for two layers of the tiny shapes (bfloat16 activations)
                result["real_relative_error"] = relative(expected_real, real.reference())
            chain, want = (real, expected_real) if is_real else (step, expected)
            if mode.startswith("launched"):
                fn = partial(chain.launched, programs)
            else:
                fn = partial(chain.persistent, programs, mode == "persistent-prefetch")
                if mode.endswith("-capped"):
                    maxnreg = registers_cap(programs // sms)
                    run["capped_registers"] = maxnreg
                    fn = partial(chain.persistent, programs, maxnreg=maxnreg)
            chain.timed_out.zero_()
            chain.x.zero_()
            fn()
            check(run, chain, want, result["phases"])
            seconds = gpu_kernels.timed(fn, args.device)
            replayed = check({"mode": mode, "programs": programs}, chain, want, result["phases"])
            run["replays_agree"] = replayed["agrees"]  # 21 more chances for a barrier to let a read through early
            run["step_us"] = round(seconds * 1e6, 2)
            run["phase_us"] = round(seconds * 1e6 / result["phases"], 3)
            weight_bytes = real.weight_bytes if chain is real else step.codes.numel()
            run["tb_s"] = round(weight_bytes / seconds / 1e12, 3)
            result["runs"].append(run)
            print(json.dumps(run), flush=True)
        except Exception as e:  # a mode that fails is a finding; the others still run
            if isinstance(e, BarrierGaveUp):
                gave_up[chain_kind] = min(programs, gave_up.get(chain_kind, programs))
            result["errors"].append(f"{mode} programs={programs}: {e!r}"[:500])
            print(result["errors"][-1], flush=True)
        summarize(result)
        write(args.out, result)  # after every run: a probe cut short leaves its runs
    result["seconds"] = round(time.perf_counter() - started, 1)
    write(args.out, result)
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}))
    print(f"wrote {args.out} in {result['seconds']} s")


if __name__ == "__main__":
    main()
