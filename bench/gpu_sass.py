"""The int4 matmul kernels' main loops for a Hopper GPU (sm_90), read without one (issue 32): each
variant is compiled by Triton for sm_90 with the ptxas it ships, disassembled with its nvdisasm, and its
K loop's instructions counted by opcode, per weight per thread. On an H200 the int4 kernel took as long
as bf16's for one row while reading a third of the bytes (1.13 TB/s on the widest layer against 3.6):
it is bound by its work per weight, not by memory, so fewer instructions per weight is the first sign
of a faster kernel. The GPU's own timing (bench/gpu_kernels.py) decides.

    PYTHONPATH=. python bench/gpu_sass.py --out bench/results/gpu_sass.json

`--digests FILE` instead writes each launch that a refactor must leave alone (of the 4-bit kernel, the attention,
and the matmuls that take a norm's rows: `digest_launches`, `attention_digest_launches`, `normed_digest_launches`)
with digests of its whole SASS and of its LLVM IR, its registers and shared memory: run it before and after, and
compare.

Runs on a CPU (nothing is launched); needs Triton's NVIDIA backend binaries (the PyPI wheel has them).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import hashlib
import json
import re
import subprocess
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
N, K = 16384, 2048  # the 1B shapes' gate and up projection, the widest layer of a step


class _Hopper:
    """Tells Triton's JIT that the current device is an sm_90 GPU, so a launch compiles for it."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


def loop_body(sass: str) -> list[str]:
    """The opcodes of the longest backward-branching block that holds an MMA (or the dp4a kernel's
    IDP): the kernel's K loop."""
    labels: dict[str, int] = {}
    ops: list[tuple[str, str]] = []
    for line in sass.splitlines():
        if m := re.match(r"^\s*(\.L_x_\d+):", line):
            labels[m.group(1)] = len(ops)
        elif m := re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*)", line):
            ops.append((m.group(1), m.group(2)))
    best: list[str] = []
    for i, (op, rest) in enumerate(ops):
        target = re.search(r"\((\.L_x_\d+)\)", rest) if op == "BRA" else None
        if target and labels.get(target.group(1), i + 1) <= i:
            body = [o for o, _ in ops[labels[target.group(1)] : i + 1]]
            if any("MMA" in o or "IDP" in o for o in body) and len(body) > len(best):  # IGMMA too
                best = body
    return best


def variants():
    """(name, kernel, config, scale dtype, kernel switches): the default kernel and the packed-bfloat16
    candidate, with the layer's scales as stored (float16) or as bfloat16, at 64 and 128 columns and in
    programs of 2 and 4 row tiles; the
    int8-input kernel (dp4a) for one row at 128 (its own), 64 and 256 columns, and for 16 rows, and
    its tensor-core kernel (int8 wgmma) in its tiles; and int8 codes (Q8_0) times int8 inputs for one row,
    and times float inputs in programs of one and four row tiles."""
    from kvserve.kernels.gpu import matmul as mm

    base = mm.config_for(mm.INT4_CONFIG, N, K)
    wide = dataclasses.replace(base, block_n=128)
    dp4a = dataclasses.replace(mm.config_for(mm.INT4_INT8_CONFIG, N, K), block_m=1)
    q8 = mm.config_for(mm.INT8_CONFIG, N, K)
    half, bf16 = torch.float16, torch.bfloat16
    return [
        ("default", mm._int4_kernel, base, half, {}),
        ("packed-bf16, float16 scales", mm._int4_kernel, base, half, {"PACKED_BF16": True}),
        ("packed-bf16", mm._int4_kernel, base, bf16, {"PACKED_BF16": True}),
        # a program's 2 or 4 row tiles (`row_tiles_for`: 17 to 32 rows, and more), each weight dequantized once
        ("packed-bf16, 2 row tiles", mm._int4_kernel, base, bf16, {"PACKED_BF16": True, "ROW_TILES": 2}),
        ("packed-bf16, 4 row tiles", mm._int4_kernel, base, bf16, {"PACKED_BF16": True, "ROW_TILES": 4}),
        ("default, 4 row tiles", mm._int4_kernel, base, half, {"ROW_TILES": 4}),
        ("packed-bf16, 128 columns", mm._int4_kernel, wide, bf16, {"PACKED_BF16": True}),
        ("default, 128 columns", mm._int4_kernel, wide, half, {}),
        ("int8 inputs (dp4a), one row", mm._int4_int8_kernel, dp4a, half, {}),
        (
            "int8 inputs (dp4a), one row, 64 columns",
            mm._int4_int8_kernel,
            dataclasses.replace(dp4a, block_n=64),
            half,
            {},
        ),
        (
            "int8 inputs (dp4a), one row, 256 columns",
            mm._int4_int8_kernel,
            dataclasses.replace(dp4a, block_n=256),
            half,
            {},
        ),
        ("int8 inputs (dp4a), 8 rows", mm._int4_int8_kernel, dataclasses.replace(dp4a, block_m=8), half, {}),
        ("int8 inputs (dp4a), 16 rows", mm._int4_int8_kernel, dataclasses.replace(dp4a, block_m=16), half, {}),
        ("int8 codes, int8 inputs (dp4a), one row", mm._int4_int8_kernel, dp4a, torch.float32, {"CODE_BITS": 8}),
        # int8 codes (Q8_0) times float inputs on the tensor cores, a program of one row tile and of four
        ("int8 codes, float inputs", mm._int8_kernel, q8, torch.float32, {}),
        ("int8 codes, float inputs, 4 row tiles", mm._int8_kernel, q8, torch.float32, {"ROW_TILES": 4}),
    ] + [
        (
            f"int8 inputs, tensor cores, {tile['block_m']} rows",
            mm._int4_int8_mma_kernel,
            dataclasses.replace(dp4a, **tile),
            half,
            {},
        )
        for _, tile in mm.INT4_INT8_MMA_TILES
    ]


def digest_launches():
    """(name, n, k, rows, counters, scale dtype, int4_matmul's options): the 1B gate/up and down shapes and a
    short K without splits, at 1 to 64 rows; the splits summed in the tile and by the sum kernel; float16 and
    bfloat16 scales, packed bfloat16 FMAs, SiLU in the epilogue, 4 row tiles, ALIGNED_GROUPS off, PDL with
    the prefetch."""
    half, bf16 = torch.float16, torch.bfloat16
    switches = [
        ("float", half, {}),
        ("packed-bf16", bf16, {"PACKED_BF16": True}),
        ("packed-bf16 silu", bf16, {"PACKED_BF16": True, "activation": "silu"}),
        ("packed-bf16 4 row tiles", bf16, {"PACKED_BF16": True, "ROW_TILES": 4}),
        ("scales in the step", half, {"ALIGNED_GROUPS": False}),
        ("packed-bf16 pdl prefetch", bf16, {"PACKED_BF16": True, "PDL": True, "PREFETCH_LINES": 2}),
    ]
    for n, k, counters in ((16384, 2048, True), (2048, 8192, True), (2048, 8192, False), (2048, 512, True)):
        for rows in (1, 20, 64) if counters and k != 512 else (1,):
            for name, scale_dtype, options in switches:
                if ("activation" in options and n != 16384) or ("ROW_TILES" in options and rows != 64):
                    continue
                label = f"{n}x{k}, {rows} rows, {'counters' if counters else 'sum kernel'}, {name}"
                yield label, n, k, rows, counters, scale_dtype, options


def attention_digest_launches():
    """(name, cache dtype, key splits, counters, int8 form): the 1B shapes' decode attention (32 query heads,
    8 KV heads of 64) for one token at position 200, bfloat16 and float32 caches, its splits merged in one
    program, by the last split with counters and by the combine kernel, with and without o_proj's int8 form."""
    for dtype in (torch.bfloat16, torch.float32):
        for splits, counters in ((1, False), (4, True), (4, False)):
            for quantized in (False, True):
                name = f"attention {str(dtype).removeprefix('torch.')}, {splits} splits"
                name += (", counters" if counters else ", combine kernel") if splits > 1 else ""
                yield name + (", int8 form" if quantized else ""), dtype, splits, counters, quantized


def normed_digest_launches():
    """(name, kernel, n, rows, with a delta): the matmuls that normalize their rows in their prologue
    (`norm.NormedRows`) at the 1B shapes' q/k/v and gate/up (K 2,048) for one and two rows, with the residual's
    delta added (its x + delta stored by one tile) and without; the 4-bit kernel with SiLU in gate/up's epilogue."""
    for kernel in ("int4", "float", "int8"):
        for n in (3072, 16384):
            for rows in (1, 2):
                for delta in (False, True):
                    if kernel != "int4" and (n != 3072 or rows != 1):
                        continue
                    label = f"normed {kernel} {n}x2048, {rows} rows{', x + delta' if delta else ''}"
                    yield label, kernel, n, rows, delta


def llvm_ir_digest(compiled) -> str:
    """A digest of the kernel's LLVM IR without its debug locations: what it computes, where ptxas may
    still name registers differently when only the lines behind the code moved."""
    ir = re.sub(r", !dbg !\d+", "", compiled.asm["llir"])
    return hashlib.sha256("\n".join(line for line in ir.splitlines() if not line.startswith("!")).encode()).hexdigest()


def sass_of(compiled, work: Path) -> tuple[str, str]:
    """A compiled kernel's SASS and its resource usage (registers, stack), by Triton's nvdisasm and cuobjdump."""
    cubin = work / "kernel.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    sass = subprocess.run([BIN / "nvdisasm", "-c", cubin], capture_output=True, text=True, check=True).stdout
    usage = subprocess.run(
        [BIN / "cuobjdump", "--dump-resource-usage", cubin], capture_output=True, text=True, check=True
    ).stdout
    return sass, usage


def digests(out: Path, work: Path, current: dict) -> None:
    from kvserve.kernels.gpu import attention, norm
    from kvserve.kernels.gpu import matmul as mm

    records = {}

    def record(label: str) -> None:  # the launch just compiled
        sass, usage = sass_of(current["compiled"], work)
        records[label] = {
            "sass_sha256": hashlib.sha256(sass.encode()).hexdigest(),
            "llvm_ir_sha256": llvm_ir_digest(current["compiled"]),
            "registers": int(re.search(r"REG:(\d+)", usage).group(1)),
            "shared_bytes": current["compiled"].metadata.shared,
        }
        print(label, records[label]["sass_sha256"][:16], records[label]["registers"], "registers")

    for label, n, k, rows, counters, scale_dtype, options in digest_launches():
        packed = mm.pack_int4(torch.randint(0, 16, (n, k), dtype=torch.uint8))
        scales = torch.rand(n, k // 32).to(scale_dtype)
        weight = (packed, scales, scales, packed.stride(0), scales.stride(0), scales.stride(0))
        x = torch.randn(rows, k).to(torch.bfloat16)
        config = mm.config_for(mm.INT4_CONFIG, n, k)
        layer_counters = mm.split_counters("cpu") if counters else None
        mm._launch(mm._int4_kernel, config, x, n, weight, None, None, counters=layer_counters, **options)
        record(label)
    heads, kv_heads, head_dim, block_size = 32, 8, 64, 16
    for label, dtype, splits, counters, quantized in attention_digest_launches():
        q = torch.randn(1, heads, head_dim).to(dtype)
        k_cache = torch.randn(16, block_size, kv_heads, head_dim).to(dtype)
        table = torch.arange(16, dtype=torch.int32)[None, :]
        one = torch.zeros(1, dtype=torch.int32)
        attention.paged_attention(
            q, k_cache, k_cache.clone(), table, torch.full((1,), 200, dtype=torch.int32), one, one, one + 1,
            head_dim**-0.5, 0, splits, counters=attention.attention_counters("cpu") if counters else None,
            quantized=[] if quantized else None,
        )  # fmt: skip
        record(label)
    for label, kernel, n, rows, delta in normed_digest_launches():
        hidden = 2048
        x = torch.randn(rows, hidden).to(torch.bfloat16)
        _, normed = norm.normed_rows(x, torch.randn_like(x) if delta else None, torch.rand(hidden).to(x.dtype), 1e-5)
        counters = mm.split_counters("cpu")
        if kernel == "int4":
            packed = mm.pack_int4(torch.randint(0, 16, (n, hidden), dtype=torch.uint8))
            scales = torch.rand(n, hidden // 32).to(torch.bfloat16)
            activation = "silu" if n == 16384 else None
            mm.int4_matmul(normed, packed, scales, scales, None, None, True, counters, activation)
        elif kernel == "float":
            mm.matmul(normed, torch.randn(n, hidden).to(torch.bfloat16), counters=counters)
        else:
            codes = torch.randint(-128, 128, (n, hidden), dtype=torch.int8)
            mm.int8_group_matmul(normed, codes, torch.rand(n, hidden // 32), counters=counters)
        record(label)
    out.write_text(json.dumps({"target": "sm_90", "triton": triton.__version__, "launches": records}, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results/gpu_sass.json"))
    parser.add_argument(
        "--digests", type=Path, help="write the digests of the launches a refactor must leave alone here instead"
    )
    args = parser.parse_args()
    from kvserve.kernels.gpu import attention
    from kvserve.kernels.gpu import matmul as mm

    driver.set_active(_Hopper())
    work = Path(tempfile.mkdtemp(prefix="kvserve-sass-"))
    records = []
    current: dict = {}

    def compile_only(kernel, grid):
        def warmup(*a, **kw):
            compiled = kernel.run(*a, grid=grid, warmup=True, **kw)
            if kernel in (
                mm._int4_kernel, mm._int8_kernel, mm._int4_int8_kernel, mm._int4_int8_mma_kernel, mm._float_kernel
            ):  # fmt: skip
                current["compiled"], current["kw"] = compiled, kw
            if kernel is attention._attention_kernel:
                current["compiled"] = compiled

        return warmup

    JITFunction.__getitem__ = compile_only
    if args.digests:
        digests(args.digests, work, current)
        return
    x = torch.randn(64, K).to(torch.bfloat16)
    packed = mm.pack_int4(torch.randint(0, 16, (N, K), dtype=torch.uint8))
    codes8 = torch.randint(-128, 128, (N, K), dtype=torch.int8)  # a Q8_0 layer's
    for name, kernel, config, scale_dtype, switches in variants():
        scales = torch.rand(N, K // 32).to(scale_dtype)
        if kernel is mm._int8_kernel:
            weight = (codes8, scales, codes8.stride(0), scales.stride(0))
            mm._launch(kernel, config, x, N, weight, None, None, **switches)
        elif kernel is not mm._int4_kernel:  # x as quantize_int8 gives it (that kernel compiles, not counted)
            words, d, s = mm.quantize_int8(x)
            codes = (codes8 if switches.get("CODE_BITS") == 8 else packed).view(torch.int32)
            weight = (d, s, codes, scales, scales, codes.stride(0), scales.stride(0), scales.stride(0))
            mm._launch(kernel, config, words, N, weight, None, x.dtype, k=K, **switches)
        else:
            weight = (packed, scales, scales, packed.stride(0), scales.stride(0), scales.stride(0))
            mm._launch(kernel, config, x, N, weight, None, None, **switches)
        sass, usage = sass_of(current["compiled"], work)
        body = loop_body(sass)
        rows = config.block_m * switches.get("ROW_TILES", 1)  # a program's
        weights_per_thread = config.block_k * config.block_n / (32 * config.num_warps)
        counts = collections.Counter(op.split(".")[0] for op in body)
        records.append(
            {
                "variant": name,
                "config": dataclasses.asdict(config),
                "scales": str(scale_dtype).removeprefix("torch."),
                "loop_instructions": len(body),
                "per_weight": round(len(body) / weights_per_thread, 2),
                # the program's rows share each weight's unpacking (the MMA kernels' tiles are 16 rows)
                "per_weight_and_row": round(len(body) / weights_per_thread / rows, 3),
                "shared_bytes": current["compiled"].metadata.shared,
                "registers": int(re.search(r"REG:(\d+)", usage).group(1)),
                "stack_bytes": int(re.search(r"STACK:(\d+)", usage).group(1)),  # spilled registers
                "opcodes": dict(counts.most_common(14)),
            }
        )
        record = records[-1]
        print(
            f"{name:42} {len(body):4} instructions in the loop, {record['per_weight']:.2f} per weight, {record['per_weight_and_row']:.3f} per weight and row, {record['registers']} registers, {record['stack_bytes']} bytes of stack"
        )
    result = {"target": "sm_90", "triton": triton.__version__, "layer": {"N": N, "K": K}, "records": records}
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
