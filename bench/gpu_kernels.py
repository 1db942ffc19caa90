"""The GPU matmul kernels' tile configurations, timed on the model's own shapes (issue 32): each
candidate `TileConfig` of kvserve/kernels/gpu/matmul.py against cuBLAS (`F.linear`) at several row
counts, so the one configuration per kernel (batch invariance: never chosen per M) is picked on
figures; `int4-convert`, the int4 kernel with its nibbles turned into floats by the conversion
instruction instead of kvserve's PRMT-built bits (common.nibble_to_float), which must give the same
bits (`same_bits` in the JSON); `int4-bf16x2`, the candidate that computes weights by packed bfloat16
FMAs from bfloat16 scales (`int4_matmul(packed_bf16=True)`: other bits by design, fewer instructions
in the loop for sm_90), at each int4 config and two 128-column ones; `int4-int8`, int4 weights times
int8 inputs by dp4a (`int4_int8_matmul`, `--activations int8`: the inputs' quantization included, its
row tile following M), at its candidate configs, and from 16 rows `int4-int8-mma`, its tensor-core
kernel's tiles (the same bits); `int4-tinygemm`, PyTorch's own int4 kernel (`_weight_int4pack_mm`, one
configuration, bfloat16 scales and zeros: other bits by design; kernels/gpu/tinygemm.py), on a CUDA GPU
only; and the int8 kernel on the lm_head (a 4-bit GGUF's Q8_0 embedding),
with float inputs (`int8`) and int8 ones (`int8-int8`, `int8_int8_matmul`). Candidates with the same bits
(`same_bits`): `int4-bf16x2-gm` and `int4-int8-gm`, the codes, scales and mins group major
(`matmul.to_group_major`: a warp's outputs read one block); `int4-bf16x2-waited`, each K step's scales and
mins loaded in the step (`_int4_kernel`'s ALIGNED_GROUPS off: the kernel before 2026-12-05), against which
`int4-bf16x2` shows what loading them steps ahead with the codes gains; from 17 rows `int4-bf16x2-1tile`, `-2tile` and
`-4tile`, programs of that many tiles of 16 rows, each weight dequantized once a program (kvserve's
int4 and int8 kernels take up to `matmul.MAX_ROW_TILES` tiles a program, fewer where the layer would have
fewer than `ROW_TILE_PROGRAMS` programs), and `int8-1tile` on the lm_head; `int4-int8-partials`, up to 8 rows each K
split a program of its own with its partial sums in memory (`matmul.SPLITS_IN_PROGRAM` 0, the kernel
before an int4 layer's splits went into one program); `int4-int8-words512`, `-words1024` and `-words2048`,
up to 8 rows with a program's code words over its threads as memory holds them (`matmul.WORDS_IN_THREADS`,
about that many words a program, `_int4_int8_words_kernel`), and on the Q8_0 lm_head `int8-int8-words512`
to `-words2048`; on the gate and up projection, `float-gated` and
`int4-bf16x2-gated`, the SiLU applied in the matmul's epilogue (the engine's default), against
`float-gated-kernel` and `int4-bf16x2-gated-kernel`, the matmul and then the activation's own kernel; on
the q/k/v projection, `float-rope` and `int4-bf16x2-rope`, RoPE and the KV cache's write in the epilogue,
against `-rope-kernel`, the matmul and then the RoPE kernel (q's bits compared); on both,
`float-normed` and `int4-bf16x2-normed`, the norm before them (with the residual add) in the matmul's
prologue (`NormedRows`, layers/gpu.FUSE_NORMS), against `-normed-kernel`, add_rms_norm's kernel first.
Each layer has its own tile counters, as in the engine, so that a K split's last program adds the
splits; `float-sum-kernel`, `int4-sum-kernel` and `int4-int8-sum-kernel` time kvserve's configs with
`_sum_splits_kernel` launched instead, as before 2026-11-29 (the same bits, `same_bits`).
`--kinds` keeps some of them.
Each timing is a CUDA graph of one call per layer, each layer its own weight (the weights stream from
memory as in a decode step, not from L2), replayed; the result is microseconds per call and the weight
bytes per second that gives.

    PYTHONPATH=. python bench/gpu_kernels.py --out $OUT/kernels.json
    # the plumbing on a CPU (Triton's interpreter, tiny shapes, no graphs):
    PYTHONPATH=. TRITON_INTERPRET=1 python bench/gpu_kernels.py --device cpu --shapes tiny --rows 1,3
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

# (N, K) per layer of the Llama-3.2-1B-like shapes of bench/gpu.py, and the tied lm_head
SHAPES = {
    "llama1b": {
        "qkv": (3072, 2048),
        "o": (2048, 2048),
        "gate_up": (16384, 2048),
        "down": (2048, 8192),
        "lm_head": (49152, 2048),
    },
    "smol135m": {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)},
    "tiny": {"qkv": (128, 64), "gate_up": (128, 64), "lm_head": (96, 64)},
}
# (query heads, KV heads, head dim) of each shapes' q/k/v projection, for its RoPE in the epilogue
HEADS = {"llama1b": (32, 8, 64), "smol135m": (9, 3, 64), "tiny": (4, 2, 16)}
LAYERS = {"llama1b": 16, "smol135m": 30, "tiny": 2}
SUM_KERNEL_KINDS = ("float-sum-kernel", "int4-sum-kernel", "int4-int8-sum-kernel")


def candidates():
    """(float configs, int4 configs, int4 x int8 configs); None is kvserve's own choice per layer
    (matmul.config_for); an int4 x int8 config's block_m is replaced by the row tile for M."""
    from kvserve.kernels.gpu.matmul import TileConfig as c

    floats = [
        None,
        c(64, 64, 64, 0, 4, 3),  # the first configuration (2026-11-27's first GPU run)
        c(64, 64, 128, 2048, 4, 4),
        c(64, 32, 128, 2048, 4, 4),
        c(64, 128, 64, 2048, 4, 3),
        c(128, 64, 64, 2048, 4, 3),
        c(64, 64, 64, 2048, 4, 4),
    ]
    int4s = [
        None,
        c(16, 64, 128, 1024, 4, 3),  # the first configuration
        c(16, 64, 128, 512, 4, 4),
        c(16, 64, 128, 1024, 2, 3),
        c(16, 32, 128, 512, 2, 4),
        c(32, 64, 128, 512, 4, 3),
        c(64, 64, 64, 1024, 4, 3),
        # more programs with shorter K (a one-row program's chain of loads: bench/gpu_timeline.py's loop_p50)
        c(16, 64, 128, 256, 4, 3),
        c(16, 32, 128, 256, 2, 4),
        c(16, 64, 256, 512, 4, 2),  # or fewer, wider K steps: more bytes in flight a step
    ]
    # dp4a, one column per thread at 128 columns and 4 warps (offline ptxas for sm_90, one row: 1.05
    # instructions per weight; 64 columns 3.5, 256 1.09): how many programs keep the loads in flight
    int4_int8s = [
        None,
        c(8, 128, 128, 1024, 4, 3),
        c(8, 128, 128, 256, 4, 3),
        c(8, 64, 128, 512, 2, 3),
        c(8, 256, 128, 512, 8, 3),
        c(8, 256, 128, 1024, 8, 3),
        c(8, 64, 128, 256, 2, 3),
        c(8, 64, 128, 128, 2, 3),  # a step a program: the most programs
    ]
    return floats, int4s, int4_int8s


def timed(fn, device: str, replays: int = 20, warm: bool = True) -> float:
    """Seconds per run of fn (which makes one call per layer), replayed as a CUDA graph; `warm`: fn run
    once before the capture (not where the capture alone must call it: a timeline's recording)."""
    if device != "cuda":
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    if warm:
        fn()
        torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / 1000 / replays


def time_layer(shape, name, n, k, count, rows, device, gen, started, budget_s, result, kinds=None, own=False) -> None:
    """Time cuBLAS and each candidate on `count` layers of n x k weights at each row count, into
    result["records"] (or result["errors"]); `kinds`: only those; `own`: kvserve's configs only."""
    from kvserve.kernels.gpu import matmul as mm

    floats, int4s, int4_int8s = candidates()
    # (block_m, block_n, warps) of the tensor-core int4 x int8 kernel: sm_90 loops of 0.35-0.50
    # instructions per weight and row without spills (offline ptxas); 64 x 64 on 4 warps spilled
    int4_int8_mma_tiles = [
        (16, 128, 4),
        (16, 64, 4),
        (32, 128, 8),
        (64, 128, 8),
        (64, 64, 8),
        (64, 32, 4),
        (128, 64, 8),
    ]
    if mm.int4_int8_mma_tiles(torch.device(device)) is mm.INT4_INT8_MMA_TILES_BLACKWELL:  # tiles past 32 rows trap
        int4_int8_mma_tiles = [tile for tile in int4_int8_mma_tiles if tile[0] <= 32]
    # the packed-bfloat16 candidate's loop for sm_90 has the fewest instructions per weight with 128
    # columns (4.0 against 4.7 for 64, offline ptxas; the default kernel's: 7.0)
    int4_wide = [mm.TileConfig(16, 128, 128, 1024, 4, 3), mm.TileConfig(16, 128, 128, 512, 4, 4)]
    weights = [torch.randn(n, k, device=device, generator=gen).to(torch.bfloat16) for _ in range(count)]
    packed = [mm.pack_int4(torch.randint(0, 16, (n, k), device=device, generator=gen)) for _ in range(count)]
    scales = [torch.rand(n, k // 32, device=device, generator=gen).half() for _ in range(count)]
    mins = [-8 * s for s in scales]
    scales16, mins16 = [s.to(torch.bfloat16) for s in scales], [mn.to(torch.bfloat16) for mn in mins]
    codes8 = (
        [torch.randint(-128, 128, (n, k), device=device, generator=gen, dtype=torch.int8)] if name == "lm_head" else []
    )
    scales8 = [torch.rand(n, k // 32, device=device, generator=gen) * 0.01 for _ in codes8]
    out_dtype = torch.float32 if name == "lm_head" else torch.bfloat16
    counters = [mm.split_counters(device) for _ in range(count)]  # each layer its own, as in the engine

    def float_calls(x, cfg, tile_sums=True):
        cfg = cfg or mm.config_for(mm.FLOAT_CONFIG, n, k)
        layers = list(zip(weights, counters if tile_sums else [None] * count, strict=True))
        return lambda: [
            mm._launch(mm._float_kernel, cfg, x, n, (w, w.stride(0)), None, out_dtype, counters=c) for w, c in layers
        ]

    def int4_calls(
        x, cfg, permute=True, packed_bf16=False, tile_sums=True, group_major=False, row_tiles=None, waited=False
    ):
        if cfg is None:  # kvserve's configuration, and its row tiles where not given
            cfg = mm.config_for(mm.INT4_CONFIG, n, k)
            row_tiles = row_tiles or mm.row_tiles_for(x.shape[0], n, k, cfg)
        row_tiles = row_tiles or 1  # a candidate's tiles: a program a tile of its rows
        groups = zip(packed, scales16, mins16, strict=True) if packed_bf16 else zip(packed, scales, mins, strict=True)
        if group_major:
            groups = [mm.to_group_major(*g) for g in groups]
        layers = [(p, s, mn, p.stride(0), s.stride(0), mn.stride(0)) for p, s, mn in groups]
        layers = list(zip(layers, counters if tile_sums else [None] * count, strict=True))
        switches = {"PERMUTE": permute, "PACKED_BF16": packed_bf16, **({"GROUP_MAJOR": True} if group_major else {})}
        switches.update({"ALIGNED_GROUPS": False} if waited else {})
        switches.update({"ROW_TILES": row_tiles} if row_tiles > 1 else {})
        return lambda: [
            mm._launch(mm._int4_kernel, cfg, x, n, a, None, out_dtype, counters=c, **switches) for a, c in layers
        ]

    def int4_int8_calls(x, cfg, group_major=False, kernel=mm._int4_int8_kernel, tile_sums=True):
        if cfg is None:  # kvserve's: int4_int8_matmul's choice of kernel and tiles
            weights4 = [mm.to_group_major(*w) if group_major else w for w in zip(packed, scales, mins, strict=True)]
            layers = list(zip(weights4, counters if tile_sums else [None] * count, strict=True))
            return lambda: [mm.int4_int8_matmul(x, *w, out_dtype, counters=c) for w, c in layers]
        if kernel is mm._int4_int8_kernel:
            cfg = dataclasses.replace(cfg, block_m=mm._row_tile(x.shape[0]))
        layers = [(p.view(torch.int32), s, mn, c) for p, s, mn, c in zip(packed, scales, mins, counters, strict=True)]

        def calls():
            outs = []
            for words, s, mn, c in layers:
                q, d, sums = mm.quantize_int8(x)
                weight = (d, sums, words, s, mn, words.stride(0), s.stride(0), mn.stride(0))
                outs.append(mm._launch(kernel, cfg, q, n, weight, None, out_dtype, k=k, counters=c))
            return outs

        return calls

    def switched(fn, name, value):  # matmul's switch `name` set while fn launches (a graph replays them)
        def calls():
            before = getattr(mm, name)
            setattr(mm, name, value)
            try:
                return fn()
            finally:
                setattr(mm, name, before)

        return calls

    def tinygemm_calls(x):
        from kvserve.kernels.gpu import tinygemm

        def codes_of(p):  # pack_int4's bytes back to codes [n, k]: input j low, j + 16 high, per group of 32
            groups = p.view(n, k // 32, 16)
            return torch.cat([groups & 15, groups >> 4], dim=-1).view(n, k)

        layers = [tinygemm.pack(codes_of(p), s, mn) for p, s, mn in zip(packed, scales, mins, strict=True)]
        return lambda: [tinygemm.matmul(x, p, sz) for p, sz in layers]

    interleaved = {}  # the projections' tensors in the layout for their epilogue, made once
    tables = {}  # the q/k/v projection's cos, sin, caches and slots per row count; a norm's delta and weight

    def gated_calls(x, kind, fused):
        """A gate and up projection (`kind` float or int4-bf16x2) with its SiLU: in the matmul's epilogue over
        interleaved rows (`fused`, the engine's default since 2026-12-04), or the activation's own kernel
        after the matmul (the launch before): the same bits."""
        from kvserve.kernels.gpu import elementwise

        act = "silu" if fused else None
        if kind == "float":
            layers = weights
            call = lambda w, c: mm.matmul(x, w, None, None, c, act)  # noqa: E731
        else:
            layers = list(zip(packed, scales16, mins16, strict=True))
            call = lambda w, c: mm.int4_matmul(x, *w, None, None, True, c, act)  # noqa: E731
        if not fused:
            return lambda: [
                elementwise.gated_activation(call(w, c), False) for w, c in zip(layers, counters, strict=True)
            ]
        if kind not in interleaved:
            interleaved[kind] = [
                mm.interleave_gate_up(w) if kind == "float" else tuple(mm.interleave_gate_up(t) for t in w)
                for w in layers
            ]
        return lambda: [call(w, c) for w, c in zip(interleaved[kind], counters, strict=True)]

    def rope_calls(x, kind, fused):
        """A q/k/v projection (`kind` float or int4-bf16x2) with RoPE and the KV cache's write: in the
        matmul's epilogue over paired rows (`fused`, the engine's default since 2026-12-04), or the RoPE
        kernel after the plain matmul (the launch before): the same bits."""
        from kvserve.kernels.gpu import elementwise

        heads, kv_heads, head_dim = HEADS[shape]
        m = x.shape[0]
        if m not in tables:  # one set a row count, for both ways
            cos, sin = torch.randn(2, m, 1, head_dim, device=device, generator=gen).to(torch.bfloat16)
            caches = torch.zeros(2, (m + 15) // 16, 16, kv_heads, head_dim, dtype=torch.bfloat16, device=device)
            tables[m] = cos, sin, caches, torch.arange(m, dtype=torch.int32, device=device)
        cos, sin, caches, slots = tables[m]
        rope = mm.RopeStore(cos, sin, caches[0], caches[1], slots, heads) if fused else None
        if kind == "float":
            layers = weights
            call = lambda w, c: mm.matmul(x, w, None, None, c, rope=rope)  # noqa: E731
        else:
            layers = list(zip(packed, scales16, mins16, strict=True))
            call = lambda w, c: mm.int4_matmul(x, *w, None, None, True, c, rope=rope)  # noqa: E731
        if not fused:

            def rotated(w, c):
                qk, v = call(w, c).view(m, -1, head_dim).split([heads + kv_heads, kv_heads], dim=1)
                return elementwise.rotate_and_store(qk, v, cos, sin, caches[0], caches[1], slots).view(m, -1)

            return lambda: [rotated(w, c) for w, c in zip(layers, counters, strict=True)]
        key = f"{kind}-rope"
        if key not in interleaved:
            pair = lambda t: mm.interleave_rope(t, heads, kv_heads, head_dim)  # noqa: E731
            interleaved[key] = [pair(w) if kind == "float" else tuple(pair(t) for t in w) for w in layers]
        return lambda: [call(w, c) for w, c in zip(interleaved[key], counters, strict=True)]

    def normed_calls(x, kind, fused):
        """A projection after a norm (`kind` float or int4-bf16x2): the norm with the residual add in the
        matmul's prologue (`NormedRows`, `fused`: layers/gpu.FUSE_NORMS), or add_rms_norm's kernel before
        the matmul (the default): the same bits."""
        from kvserve.kernels.gpu import norm

        if ("norm", x.shape[0]) not in tables:  # one delta and norm weight a row count, for both ways
            delta = torch.randn(x.shape[0], k, device=device, generator=gen).to(torch.bfloat16)
            tables["norm", x.shape[0]] = delta, (torch.rand(k, device=device, generator=gen) + 0.5).to(torch.bfloat16)
        delta, g = tables["norm", x.shape[0]]
        if kind == "float":
            call = lambda w, c, rows: mm.matmul(rows, w, None, None, c)  # noqa: E731
            layers = weights
        else:
            call = lambda w, c, rows: mm.int4_matmul(rows, *w, None, None, True, c)  # noqa: E731
            layers = list(zip(packed, scales16, mins16, strict=True))
        normed = norm.normed_rows if fused else norm.add_rms_norm  # each gives (x + delta, the matmul's x)
        return lambda: [call(w, c, normed(x, delta, g, 1e-5)[1]) for w, c in zip(layers, counters, strict=True)]

    def int8_calls(x, int8_inputs=False):
        layers = list(zip(codes8, scales8, counters, strict=False))
        if int8_inputs:  # --activations int8: the inputs' quantization included
            return lambda: [mm.int8_int8_matmul(x, c, s, out_dtype, counters=t) for c, s, t in layers]
        return lambda: [mm.int8_group_matmul(x, c, s, out_dtype, counters=t) for c, s, t in layers]

    for m in rows:
        if time.perf_counter() - started > budget_s:
            result["errors"].append(f"past the budget at {shape} {name} M={m}")
            return
        x = torch.randn(m, k, device=device, generator=gen).to(torch.bfloat16)
        runs = [("cublas", "cublas", lambda x=x: [F.linear(x, w) for w in weights])]
        runs += [("int4-int8", cfg, int4_int8_calls(x, cfg)) for cfg in int4_int8s]
        if m >= 16:  # the tensor-core kernel's tiles (kvserve runs it from INT4_INT8_MMA_ROWS rows)
            mma = [
                mm.TileConfig(b_m, b_n, 128, mm.config_for(mm.INT4_INT8_CONFIG, n, k).k_per_split, w, 3)
                for b_m, b_n, w in int4_int8_mma_tiles
            ]
            runs += [("int4-int8-mma", cfg, int4_int8_calls(x, cfg, kernel=mm._int4_int8_mma_kernel)) for cfg in mma]
        runs += [("float", cfg, float_calls(x, cfg)) for cfg in floats]
        runs += [("int4", cfg, int4_calls(x, cfg)) for cfg in int4s]
        runs += [("int4-convert", None, int4_calls(x, None, permute=False))]
        if device == "cuda":  # PyTorch has no CPU kernel for this layout
            runs += [("int4-tinygemm", None, tinygemm_calls(x))]
        runs += [("int4-bf16x2", cfg, int4_calls(x, cfg, packed_bf16=True)) for cfg in int4s + int4_wide]
        runs += [  # the codes, scales and mins group major (matmul.to_group_major): the same bits
            ("int4-bf16x2-gm", None, int4_calls(x, None, packed_bf16=True, group_major=True)),
            # each step's scales and mins loaded in the step, as before 2026-12-05 (ALIGNED_GROUPS): the same bits
            ("int4-bf16x2-waited", None, int4_calls(x, None, packed_bf16=True, waited=True)),
            # from 17 rows, programs of 1, 2 and 4 row tiles whatever the layer's programs (`row_tiles_for`)
            *[
                (f"int4-bf16x2-{tiles}tile", None, int4_calls(x, None, packed_bf16=True, row_tiles=tiles))
                for tiles in (1, 2, 4)
                if m > 16 * max(1, tiles // 2)
            ],
            ("int4-int8-gm", None, int4_int8_calls(x, None, group_major=True)),
            # up to 8 rows, each K split a program of its own (the kernel before SPLITS_IN_PROGRAM)
            ("int4-int8-partials", None, switched(int4_int8_calls(x, None), "SPLITS_IN_PROGRAM", 0)),
        ]
        runs += [  # up to 8 rows, a program's code words over its threads (WORDS_IN_THREADS): the same bits
            (f"int4-int8-words{w}", None, switched(int4_int8_calls(x, None), "WORDS_IN_THREADS", w))
            for w in (512, 1024, 2048)
        ]
        runs += [  # kvserve's configs with the sum kernel launched after each split call
            ("float-sum-kernel", None, float_calls(x, None, tile_sums=False)),
            ("int4-sum-kernel", None, int4_calls(x, None, tile_sums=False)),
            # (up to 8 rows each split a program of its own, as then)
            ("int4-int8-sum-kernel", None, switched(int4_int8_calls(x, None, tile_sums=False), "SPLITS_IN_PROGRAM", 0)),
        ]
        if name == "gate_up":  # the activation in the matmul's epilogue, against its own kernel after it
            runs += [
                (f"{kind}-gated{how}", None, gated_calls(x, kind, fused=not how))
                for kind in ("float", "int4-bf16x2")
                for how in ("-kernel", "")
            ]
        if name in ("qkv", "gate_up"):  # the norm before them in their prologues, against its own kernel
            runs += [
                (f"{kind}-normed{how}", None, normed_calls(x, kind, fused=not how))
                for kind in ("float", "int4-bf16x2")
                for how in ("-kernel", "")
            ]
        if name == "qkv":  # RoPE and the KV cache's write in the matmul's epilogue, against the RoPE kernel
            runs += [
                (f"{kind}-rope{how}", None, rope_calls(x, kind, fused=not how))
                for kind in ("float", "int4-bf16x2")
                for how in ("-kernel", "")
            ]
        if codes8:  # the 4-bit GGUF's Q8_0 embedding is its lm_head
            runs += [("int8", None, int8_calls(x)), ("int8-int8", None, int8_calls(x, int8_inputs=True))]
            if m > 16:  # a program a row tile, each weight dequantized once a tile (as before MAX_ROW_TILES)
                runs += [("int8-1tile", None, switched(int8_calls(x), "MAX_ROW_TILES", 1))]
            runs += [  # up to 8 rows, the code words over the threads: the same bits
                (f"int8-int8-words{w}", None, switched(int8_calls(x, int8_inputs=True), "WORDS_IN_THREADS", w))
                for w in (512, 1024, 2048)
            ]
        runs = [
            run for run in runs if (kinds is None or run[0] in kinds) and not (own and run[1] not in (None, "cublas"))
        ]
        outputs = {}  # kind -> the first layer's output with kvserve's config: the same bits every way
        for kind, cfg, fn in runs:
            try:
                seconds = timed(fn, device) / (len(codes8) if kind.startswith("int8") else count)
                if cfg is None:
                    outputs[kind] = fn()[0]
            except Exception as e:  # a config that does not compile or launch is a finding
                result["errors"].append(f"{kind} {cfg} {name} M={m}: {e!r}"[:500])
                continue
            base = kind.split("-")[0]
            # int4-bf16x2 rounds scales and mins to bfloat16 first, int4-int8 the inputs: other bits by design
            same_as = kind.removesuffix("-sum-kernel") if kind.endswith("-sum-kernel") else base
            same_bits_as = ("-gm", "-partials", "-1tile", "-2tile", "-4tile", "-waited")  # the bits without them
            if "-words" in kind:  # int4-int8-words*, int8-int8-words*: their base kind's bits
                same_as = kind.partition("-words")[0]
            elif kind.endswith(same_bits_as):
                same_as = kind
                while same_as.endswith(same_bits_as):
                    same_as = same_as.rpartition("-")[0]
            if kind.endswith(("-gated", "-rope", "-normed")):  # the same bits as with the other kernel
                same_as = f"{kind}-kernel"
            compared = cfg is None and (
                kind.endswith((*same_bits_as, "-gated", "-rope", "-normed"))
                or kind in ("int4-convert", *SUM_KERNEL_KINDS)
                or "-words" in kind
            )
            compared = compared and same_as in outputs
            same_bits = torch.equal(outputs[kind], outputs[same_as]) if compared else None
            weight_bytes = n * k * {"int4": 0.5 + 4 / 32, "int8": 1 + 4 / 32}.get(base, 2)  # int4-*: int4's
            result["records"].append(
                {
                    "shape": shape,
                    "layer": name,
                    "N": n,
                    "K": k,
                    "M": m,
                    "kind": kind,
                    "config": cfg if cfg in (None, "cublas") else asdict(cfg),
                    "us": round(seconds * 1e6, 2),
                    "weight_gb_s": round(weight_bytes / seconds / 1e9, 1),
                    "tflop_s": round(2 * m * n * k / seconds / 1e12, 2),
                    "same_bits": same_bits,
                }
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shapes", default="llama1b")
    parser.add_argument("--rows", default="1,16,64,1024")
    parser.add_argument("--budget-s", type=float, default=150.0, help="start no timing after this many seconds")
    parser.add_argument("--kinds", default=None, help="comma-separated kinds to time (default: all)")
    parser.add_argument("--own-configs", action="store_true", help="kvserve's configs only, no candidate tiles")
    parser.add_argument("--out", type=Path, default=Path("bench/results/gpu_kernels.json"))
    args = parser.parse_args()
    started = time.perf_counter()
    device = args.device
    rows = [int(r) for r in args.rows.split(",")]
    records: list[dict] = []
    result = {
        "device": torch.cuda.get_device_name() if device == "cuda" else device,
        "torch": torch.__version__,
        "records": records,
        "errors": [],
    }
    gen = torch.Generator(device=device).manual_seed(0)
    for shape in args.shapes.split(","):
        for name, (n, k) in SHAPES[shape].items():
            count = 2 if name == "lm_head" else LAYERS[shape]
            kinds = None if args.kinds is None else set(args.kinds.split(","))
            time_layer(
                shape, name, n, k, count, rows, device, gen, started, args.budget_s, result, kinds, args.own_configs
            )
            if device == "cuda":
                torch.cuda.empty_cache()
    result["seconds"] = round(time.perf_counter() - started, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    # per step: the sum over one model's layers of each configuration, per M
    print(f"{'kind':6} {'config':34} " + " ".join(f"M={m:<8}" for m in rows) + "  (us per decode step's matmuls)")
    for shape in args.shapes.split(","):
        keys = sorted({(r["kind"], json.dumps(r["config"])) for r in records if r["shape"] == shape})
        for kind, cfg in keys:
            totals = []
            for m in rows:
                per = [
                    r
                    for r in records
                    if (r["kind"], json.dumps(r["config"]), r["M"], r["shape"]) == (kind, cfg, m, shape)
                ]
                whole = len(per) == len(SHAPES[shape])
                total = sum(r["us"] * (1 if r["layer"] == "lm_head" else LAYERS[shape]) for r in per)
                totals.append(f"{total:9.0f}" if whole else "        -")
            loaded = json.loads(cfg)
            brief = (
                "kvserve's, per layer"
                if loaded is None
                else loaded
                if isinstance(loaded, str)
                else ",".join(str(v) for v in loaded.values())
            )
            print(f"{kind:6} {brief:34} " + " ".join(totals))
    for e in result["errors"]:
        print("error:", e)


if __name__ == "__main__":
    main()
