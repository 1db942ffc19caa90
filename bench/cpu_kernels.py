"""Each CPU matmul kernel's GMAC/s by row count, against the machine's peak (issue 36, 4).

The kernels kvserve's quantized and float layers run (kvserve/kernels/csrc), called through
kernels/ops.py on random weights in a model's layer shapes (Gemma 3 270M by default: gate/up
2048 x 640 and down 640 x 2048), at 1, 16, 64 and 512 rows, best of --repeats runs of enough calls
to last ~0.2 s. The peaks come from a loop of independent instructions on every thread (compiled
here with torch's C++ extension builder, as the kernels are): `vpdpbusd` (int8 x int8 into int32,
AVX512-VNNI), `vdpbf16ps` (bfloat16 pairs, AVX512-BF16) and `vfmadd` (float32, AVX-512), each as
multiply-adds per second. A kernel's figure over its instruction's peak says how much of the machine
it uses. One row (decode) reads every weight byte for one multiply-add each, so its weight bytes per
second are reported too (the default shapes' 0.7-1.3 MB stay in L2: a model's layers together come
from DRAM).

    python bench/cpu_kernels.py                      # results/kernels.json
    python bench/cpu_kernels.py --shapes 3072x576,576x1536 --rows 1,64
"""

from __future__ import annotations

# kvserve first: importing it sets its GOMP_SPINCOUNT default, which only counts before torch loads libgomp.
import kvserve  # isort: skip  # noqa: F401
import argparse
import datetime
import json
import platform
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from kvserve.kernels import build, ops
from kvserve.layers.quantized import (
    Int4Groups,
    Int4Linear,
    Int4QuadsLinear,
    Int6Linear,
    Int8GroupLinear,
    int4_block_rows,
    int8_groups_from_float,
)

RESULTS = Path(__file__).parent / "results"


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


PEAK_SOURCE = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <ATen/Parallel.h>
#include <chrono>

// 12 independent accumulators (more than the instruction's latency x throughput) on every thread,
// `iters` rounds of `step`; returns multiply-adds per second over all threads.
template <typename Init, typename Step>
static double peak(int64_t iters, int macs_per_op, Init init, Step step) {
  const int threads = at::get_num_threads();
  const auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      decltype(init(0)) acc[12];
#pragma GCC unroll 12
      for (int j = 0; j < 12; ++j) acc[j] = init(j);  // each its own value: equal chains would be computed once
      for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 12
        for (int j = 0; j < 12; ++j) acc[j] = step(acc[j]);
      }
#pragma GCC unroll 12
      for (int j = 0; j < 12; ++j) asm volatile("" : : "v"(acc[j]));  // the sums are used
    }
  });
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return double(threads) * iters * 12 * macs_per_op / s;
}

double vnni(int64_t iters) {
  __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-2);
  asm volatile("" : "+v"(a), "+v"(b));  // unknown to the compiler: nothing is folded
  return peak(iters, 64, [](int j) { return _mm512_set1_epi32(j); }, [&](__m512i c) { return _mm512_dpbusd_epi32(c, a, b); });
}

double bf16(int64_t iters) {
  __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80);
  asm volatile("" : "+v"(a));
  return peak(iters, 32, [](int j) { return _mm512_set1_ps(float(j)); }, [&](__m512 c) { return _mm512_dpbf16_ps(c, a, a); });
}

double fma32(int64_t iters) {
  __m512 a = _mm512_set1_ps(1.0f), b = _mm512_set1_ps(1e-9f);
  asm volatile("" : "+v"(a), "+v"(b));
  return peak(iters, 16, [](int j) { return _mm512_set1_ps(float(j)); }, [&](__m512 c) { return _mm512_fmadd_ps(c, a, b); });
}
"""


# Without AVX-512 (AVX2 and FMA): the int8 dot as the kernels take it there, vpmaddubsw (32 byte products
# summed in pairs) then vpmaddwd and vpaddd into int32 lanes; and the 8-lane FMA.
PEAK_SOURCE_AVX2 = (
    PEAK_SOURCE.split("double vnni")[0]
    + r"""
double int8(int64_t iters) {
  __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(-2), ones = _mm256_set1_epi16(1);
  asm volatile("" : "+v"(a), "+v"(b), "+v"(ones));
  return peak(iters, 32, [](int j) { return _mm256_set1_epi32(j); },
              [&](__m256i c) { return _mm256_add_epi32(c, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), ones)); });
}

double fma32(int64_t iters) {
  __m256 a = _mm256_set1_ps(1.0f), b = _mm256_set1_ps(1e-9f);
  asm volatile("" : "+v"(a), "+v"(b));
  return peak(iters, 8, [](int j) { return _mm256_set1_ps(float(j)); }, [&](__m256 c) { return _mm256_fmadd_ps(c, a, b); });
}
"""
)


def avx512_cpu() -> bool:
    """Whether this CPU has the AVX-512 instructions PEAK_SOURCE times (else PEAK_SOURCE_AVX2's)."""
    flags = next((line for line in _cpuinfo().splitlines() if line.startswith("flags")), "").split()
    return {"avx512_vnni", "avx512_bf16", "avx512bw"} <= set(flags)


INT8_DOT = "vnni" if avx512_cpu() else "int8"  # the peak an int8-input kernel is held against


def peaks() -> dict[str, float | str]:
    """GMAC/s of each instruction on every thread, best of 5 (or why they could not be measured)."""
    wide = avx512_cpu()
    names = ["vnni", "bf16", "fma32"] if wide else ["int8", "fma32"]
    try:
        from torch.utils.cpp_extension import load_inline

        module = load_inline(
            "kvserve_bench_peaks" if wide else "kvserve_bench_peaks_avx2",
            PEAK_SOURCE if wide else PEAK_SOURCE_AVX2,
            functions=names,
            extra_cflags=["-O3", "-fopenmp"]
            + (["-mavx512f", "-mavx512bw", "-mavx512vnni", "-mavx512bf16"] if wide else ["-mavx2", "-mfma"]),
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # no compiler, or an old one without the intrinsics
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    out: dict[str, float | str] = {}
    for name in names:
        fn = getattr(module, name)
        fn(5_000_000)  # ~0.1 s: the cores' clocks settle
        out[name] = round(max(fn(2_000_000) for _ in range(5)) / 1e9, 1)
    return out


def timed(fn: Callable[[], object], repeats: int) -> float:
    """Seconds per call, best of `repeats` runs of enough calls to last ~0.2 s."""
    fn()
    start = time.perf_counter()
    fn()
    calls = max(1, int(0.2 / max(time.perf_counter() - start, 1e-6)))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def kernels(n: int, k: int) -> dict[str, tuple[str, int, Callable[[torch.Tensor], object], torch.dtype]]:
    """name -> (the instruction it is bound by, weight bytes, call on x, x's dtype)."""
    torch.manual_seed(0)
    weight = torch.randn(n, k)
    int4 = Int4Linear(Int4Groups.from_float(weight), torch.bfloat16)
    block = int4_block_rows()
    codes, scales = int8_groups_from_float(weight)
    layer = Int8GroupLinear(codes, scales, torch.bfloat16)
    int4_bytes = sum(t.numel() * t.element_size() for t in int4.buffers())
    int8_bytes = codes.numel() + scales.numel() * 4
    found: dict[str, tuple[str, int, Callable[[torch.Tensor], object], torch.dtype]] = {}
    if block is not None:
        args = (int4.weight_packed, int4.scales_mins, n, 32, block)
        found["int4_mm, bfloat16 inputs"] = ("bf16", int4_bytes, lambda x: ops.int4_mm(x, *args, False), torch.bfloat16)
        if ops.int8_activations():
            found["int4_mm, int8 inputs"] = (INT8_DOT, int4_bytes, lambda x: ops.int4_mm(x, *args, True), torch.float32)
    if ops.int8_activations():
        found["int8 groups (row-major), int8 inputs"] = (
            INT8_DOT,
            int8_bytes,
            lambda x: ops.int8_group_matmul_int8(x, codes, scales),
            torch.float32,
        )
    if ops.int8_quads_usable():
        quads = Int8GroupLinear(codes, scales, torch.bfloat16)
        quads.arrange_quads()
        found["int8 quads, int8 inputs"] = (
            INT8_DOT,
            int8_bytes,
            lambda x: ops.int8_quads_matmul(x, quads.quads, quads.quad_scales, n),
            torch.float32,
        )
        # Q5_0's codes (-16..15) and float16 scales: held at 5 bits (layers/quads.py), the same products
        five = Int8GroupLinear(codes.clamp(-16, 15), scales.half().float(), torch.bfloat16)
        five.arrange_quads()
        found["5-bit quads (Q5_0), int8 inputs"] = (
            INT8_DOT,
            sum(t.numel() * t.element_size() for t in (five.quads, five.quad_scales)),
            lambda x: ops.int8_quads_matmul(x, five.quads, five.quad_scales, n),
            torch.float32,
        )
        if n % 16 == 0:  # Q4_0 / Q4_1: the int4 codes with float16 scales and mins, arranged once (Int4QuadsLinear)
            groups = Int4Groups.from_float(weight)
            four = Int4QuadsLinear(
                Int4Groups(groups.codes, groups.scales.half().float(), groups.mins.half().float()), torch.bfloat16
            )
            found["4-bit quads (Q4_0, Q4_1), int8 inputs"] = (
                INT8_DOT,
                sum(t.numel() * t.element_size() for t in (four.quads, four.q4_scales)),
                lambda x: ops.int8_quads_matmul(x, four.quads, four.q4_scales, n),
                torch.float32,
            )
        if k % 256 == 0 and n % 16 == 0:  # Q6_K's codes and scales (random), held as stored at 6 bits
            g = torch.Generator().manual_seed(1)
            six = Int6Linear(
                torch.randint(0, 64, (n, k), dtype=torch.uint8, generator=g),
                torch.randint(-127, 128, (n, k // 16), dtype=torch.int8, generator=g),
                (torch.rand(n, k // 256, generator=g) / 1000).half(),
                torch.bfloat16,
            )
            found["6-bit quads (Q6_K), int8 inputs"] = (
                INT8_DOT,
                sum(t.numel() * t.element_size() for t in (six.quads, six.k_scales)),
                lambda x: ops.int8_quads_matmul(x, six.quads, six.k_scales, n),
                torch.float32,
            )
    if ops.int8_pairs_usable():
        pairs = layer._pairs()
        found["int8 pairs, bfloat16 inputs"] = (
            "bf16",
            int8_bytes,
            lambda x: ops.int8_pairs_matmul(x, *pairs, n),
            torch.bfloat16,
        )
    found["int8 groups, float inputs"] = (
        "fma32",
        int8_bytes,
        lambda x: ops.int8_group_matmul(x, codes, scales, 1 << 30),
        torch.float32,
    )
    bf16_weight = weight.bfloat16()
    found["bfloat16 weight, float32 sums (float32_matmul)"] = (
        "bf16",
        n * k * 2,
        lambda x: ops.float32_matmul(x, bf16_weight),
        torch.bfloat16,
    )
    found["PyTorch bfloat16 GEMM (oneDNN), for reference"] = (
        "amx" if ops.amx() else "bf16",  # oneDNN takes AMX tiles where there are (no peak measured for them)
        n * k * 2,
        lambda x: F.linear(x, bf16_weight),
        torch.bfloat16,
    )
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="2048x640,640x2048", help="N x K (outputs x inputs), comma-separated")
    parser.add_argument("--rows", default="1,16,64,512")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", type=Path, default=RESULTS / "kernels.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if build.load() is None:
        raise SystemExit("the C++ kernels did not build; they are what this measures")
    peak = peaks()
    print("peaks (GMAC/s, all threads):", peak)
    records = []
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        for name, (unit, nbytes, call, dtype) in kernels(n, k).items():
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
                seconds = timed(lambda call=call, x=x: call(x), args.repeats)
                gmac = rows * n * k / seconds / 1e9
                bound = peak.get(unit) if isinstance(peak.get(unit), float) else None
                records.append(
                    {
                        "kernel": name,
                        "n": n,
                        "k": k,
                        "rows": rows,
                        "us": round(seconds * 1e6, 1),
                        "gmac_s": round(gmac, 1),
                        "bound_by": unit,
                        "of_peak": round(gmac / bound, 3) if bound else None,
                        "weight_gb_s": round(nbytes / seconds / 1e9, 1),
                    }
                )
                print(f"{name:48s} {n}x{k} rows {rows:4d}: {gmac:7.1f} GMAC/s", flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    report = {
        "date": datetime.date.today().isoformat(),
        "commit": commit,
        "machine": {"processor": _cpu_name(), "platform": platform.platform(), "threads": args.threads},
        "torch": torch.__version__,
        "amx": ops.amx(),
        "peaks_gmac_s": peak,
        "records": records,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


def _cpu_name() -> str:
    for line in _cpuinfo().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


if __name__ == "__main__":
    main()
