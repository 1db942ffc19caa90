"""The GPU matmul kernels' tile configurations, timed on the model's own shapes (issue 32): each
candidate `TileConfig` of kvserve/kernels/gpu/matmul.py against cuBLAS (`F.linear`) at several row
counts, so the one configuration per kernel (batch invariance: never chosen per M) is picked on
figures; and the quantized kernels with each way of turning codes into floats (common.CONVERT_*:
`int4-convert` the conversion instruction, `int4-bits` by the bits, `int4` kvserve's), which must
give the same bits (`same_bits` in the JSON, against kvserve's way). Each timing is a CUDA graph of
one call per layer, each layer its own weight (the weights stream from memory as in a decode step,
not from L2), replayed; the result is microseconds per call and the weight bytes per second that gives.

    PYTHONPATH=. python bench/gpu_kernels.py --out $OUT/kernels.json
    # the plumbing on a CPU (Triton's interpreter, tiny shapes, no graphs):
    PYTHONPATH=. TRITON_INTERPRET=1 python bench/gpu_kernels.py --device cpu --shapes tiny --rows 1,3
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kvserve.kernels.gpu.common import cast, dot, nibble_to_float
from kvserve.kernels.gpu.matmul import _below, _finish_tile

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
    "tiny": {"a": (64, 64), "b": (128, 64), "lm_head": (96, 64)},
}
LAYERS = {"llama1b": 16, "smol135m": 30, "tiny": 2}


@triton.jit(do_not_specialize=["M"])
def _int4_swapped_kernel(
    x_ptr,
    out_ptr,
    bias_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_om,
    stride_os,
    k_per_split,
    packed_ptr,
    scales_ptr,
    mins_ptr,
    stride_pn,
    stride_sn,
    stride_mn,
    HAS_BIAS: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr,
    INTERPRET: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CONVERT: tl.constexpr,
):
    """An experiment (not kvserve's kernel): matmul._int4_kernel's weights, dequantized the same way,
    as the dot's first operand, W_tile [BN, BK] @ x_tile.T [BK, BM], so that the weight tile's 64
    columns are the tensor cores' 64-row side (Hopper's warpgroup MMA, which takes that operand from
    registers) and a few rows of x the narrow side. Batch invariant as the kernel is (one tile for
    every M), but another MMA's sums: not int4_matmul's bits."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_begin = tl.program_id(2) * k_per_split
    k_end = tl.minimum(K, k_begin + k_per_split)
    x_rows = x_ptr + rows.to(tl.int64)[None, :] * stride_xm
    cols64 = cols.to(tl.int64)[:, None]
    i = tl.arange(0, BLOCK_K // 2)
    g = tl.arange(0, BLOCK_K // 32)
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k_lo = k0 + (i // 16) * 32 + i % 16  # [BK/2]
        w_mask = (cols < N)[:, None] & _below(k_lo, k_end, EVEN_K)[None, :]
        x_mask = _below(k_lo, k_end, EVEN_K)[:, None] & (rows < M)[None, :]
        byte = tl.load(packed_ptr + cols64 * stride_pn + (k0 // 2 + i)[None, :], mask=w_mask, other=0)  # [BN, BK/2]
        groups = k0 // 32 + g
        g_mask = (cols < N)[:, None] & _below(groups, k_end // 32, EVEN_K)[None, :]
        scale = _repeat_cols(tl.load(scales_ptr + cols64 * stride_sn + groups[None, :], mask=g_mask, other=0.0), 16)
        low = _repeat_cols(tl.load(mins_ptr + cols64 * stride_mn + groups[None, :], mask=g_mask, other=0.0), 16)
        x = tl.load(x_rows + k_lo[:, None], mask=x_mask, other=0.0)  # [BK/2, BM]
        w = cast(tl.fma(scale, nibble_to_float(byte, False, CONVERT, INTERPRET), low), x.dtype, INTERPRET)
        acc = dot(w, x, acc, INTERPRET)
        x = tl.load(x_rows + (k_lo + 16)[:, None], mask=x_mask, other=0.0)
        w = cast(tl.fma(scale, nibble_to_float(byte, True, CONVERT, INTERPRET), low), x.dtype, INTERPRET)
        acc = dot(w, x, acc, INTERPRET)
    acc = tl.trans(acc)
    _finish_tile(acc, out_ptr, bias_ptr, rows, cols, M, N, stride_om, stride_os, HAS_BIAS, IS_SPLIT, INTERPRET)


@triton.jit
def _repeat_cols(values, TIMES: tl.constexpr):
    """values [R, C] -> [R, C * TIMES] in float32, each column repeated TIMES times."""
    num_rows: tl.constexpr = values.shape[0]
    num_cols: tl.constexpr = values.shape[1]
    repeated = tl.broadcast_to(values.to(tl.float32)[:, :, None], (num_rows, num_cols, TIMES))
    return tl.reshape(repeated, (num_rows, num_cols * TIMES))


def candidates():
    """(float configs, int4 configs); None is kvserve's own choice per layer (matmul.config_for)."""
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
    ]
    return floats, int4s


def timed(fn, device: str, replays: int = 20) -> float:
    """Seconds per run of fn (which makes one call per layer), replayed as a CUDA graph."""
    if device != "cuda":
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
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


def time_layer(shape, name, n, k, count, rows, device, gen, started, budget_s, result) -> None:
    """Time cuBLAS and each candidate on `count` layers of n x k weights at each row count, into
    result["records"] (or result["errors"])."""
    from kvserve.kernels.gpu import matmul as mm
    from kvserve.kernels.gpu.common import CONVERT_BITS, CONVERT_INSTRUCTION

    floats, int4s = candidates()
    swapped = [*int4s[:3], mm.TileConfig(16, 128, 128, 512, 4, 3)]
    weights = [torch.randn(n, k, device=device, generator=gen).to(torch.bfloat16) for _ in range(count)]
    packed = [mm.pack_int4(torch.randint(0, 16, (n, k), device=device, generator=gen)) for _ in range(count)]
    scales = [torch.rand(n, k // 32, device=device, generator=gen).half() for _ in range(count)]
    mins = [-8 * s for s in scales]
    codes8 = (
        [torch.randint(-128, 128, (n, k), device=device, generator=gen, dtype=torch.int8)] if name == "lm_head" else []
    )
    scales8 = [torch.rand(n, k // 32, device=device, generator=gen) * 0.01 for _ in codes8]
    out_dtype = torch.float32 if name == "lm_head" else torch.bfloat16

    def float_calls(x, cfg):
        cfg = cfg or mm.config_for(mm.FLOAT_CONFIG, n, k)
        return lambda: [mm._launch(mm._float_kernel, cfg, x, n, (w, w.stride(0)), None, out_dtype) for w in weights]

    def int4_calls(x, cfg, convert=mm.INT4_CONVERT, kernel=mm._int4_kernel):
        cfg = cfg or mm.config_for(mm.INT4_CONFIG, n, k)
        layers = [
            (p, s, mn, p.stride(0), s.stride(0), mn.stride(0)) for p, s, mn in zip(packed, scales, mins, strict=True)
        ]
        return lambda: [mm._launch(kernel, cfg, x, n, a, None, out_dtype, CONVERT=convert) for a in layers]

    def int8_calls(x, convert):
        cfg = mm.config_for(mm.INT8_CONFIG, n, k)
        layers = [(c, s, c.stride(0), s.stride(0)) for c, s in zip(codes8, scales8, strict=True)]
        return lambda: [mm._launch(mm._int8_kernel, cfg, x, n, a, None, out_dtype, CONVERT=convert) for a in layers]

    for m in rows:
        if time.perf_counter() - started > budget_s:
            result["errors"].append(f"past the budget at {shape} {name} M={m}")
            return
        x = torch.randn(m, k, device=device, generator=gen).to(torch.bfloat16)
        runs = [("cublas", "cublas", lambda x=x: [F.linear(x, w) for w in weights])]
        runs += [("float", cfg, float_calls(x, cfg)) for cfg in floats]
        runs += [("int4", cfg, int4_calls(x, cfg)) for cfg in int4s]
        runs += [("int4-convert", None, int4_calls(x, None, CONVERT_INSTRUCTION))]
        runs += [("int4-bits", None, int4_calls(x, None, CONVERT_BITS))]
        runs += [("int4swapped", cfg, int4_calls(x, cfg, mm.INT4_CONVERT, _int4_swapped_kernel)) for cfg in swapped]
        if codes8:  # the 4-bit GGUF's Q8_0 embedding is its lm_head
            runs += [("int8", None, int8_calls(x, mm.INT8_CONVERT))]
            runs += [("int8-convert", None, int8_calls(x, CONVERT_INSTRUCTION))]
        outputs = {}  # kind -> the first layer's output with kvserve's config: the same bits every way
        for kind, cfg, fn in runs:
            try:
                seconds = timed(fn, device)
                outs = fn()
                seconds /= len(outs)
                if cfg is None:
                    outputs[kind] = outs[0]
            except Exception as e:  # a config that does not compile or launch is a finding
                result["errors"].append(f"{kind} {cfg} {name} M={m}: {e!r}"[:500])
                continue
            base = kind.split("-")[0]
            compared = cfg is None and kind != base and base in outputs
            same_bits = torch.equal(outputs[kind], outputs[base]) if compared else None
            weight_bytes = n * k * {"int4": 0.5 + 4 / 32, "int4swapped": 0.5 + 4 / 32, "int8": 1 + 4 / 32}.get(base, 2)
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
            time_layer(shape, name, n, k, count, rows, device, gen, started, args.budget_s, result)
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
