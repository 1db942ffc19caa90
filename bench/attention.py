"""The layer loop's attention kernel (`ops.decode_attention`) on its own: milliseconds per call for a
512-token prompt's rows (one block table, each row over its own 1..512 keys: what a batch-invariant
prefill runs per layer) and for 16 decode rows over 2,048 keys each (16 sequences, their own tables),
in the shapes of the registered models, float32, the median of 7 calls after a warm-up. Each row of
the prompt is also checked to be the same bits as that row alone. To compare two kernels, run it on
two commits (the C++ is rebuilt per source hash), alternating:

    python bench/attention.py --out /tmp/attention.json
"""

from __future__ import annotations

# kvserve first: importing it sets its GOMP_SPINCOUNT default, which only counts before torch loads libgomp.
import kvserve  # isort: skip  # noqa: F401
import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

import torch

from kvserve.kernels import build, ops

BLOCK_SIZE = 16
# (query heads, KV heads, head dim) of the registered models
SHAPES = {"gemma3-270m": (4, 1, 256), "smollm2-135m": (9, 3, 64)}


def layer_shape(heads: int, kv_heads: int, dim: int) -> ops.LayerShape:
    return ops.LayerShape(
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=dim,
        intermediate_size=4 * dim,
        rms_norm_eps=1e-5,
        scale=dim**-0.5,
        rotary_dim=dim,
        activation=ops.activations().SiLU,
    )


def prompt_rows(heads: int, kv_heads: int, dim: int, n: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """A prompt's n rows: one block table (blocks scattered over a pool twice as large), row i over i + 1 keys."""
    blocks = -(-n // BLOCK_SIZE)
    k_cache = torch.randn(2 * blocks, BLOCK_SIZE, kv_heads, dim, generator=gen)
    v_cache = torch.randn(2 * blocks, BLOCK_SIZE, kv_heads, dim, generator=gen)
    table = torch.randperm(2 * blocks, generator=gen)[:blocks]
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=gen)
    return qkv, k_cache, v_cache, table.repeat(n, 1).contiguous(), torch.arange(1, n + 1)


def decode_rows(
    heads: int, kv_heads: int, dim: int, rows: int, keys: int, gen: torch.Generator
) -> tuple[torch.Tensor, ...]:
    """rows sequences' decode rows, each over its own `keys` keys in its own blocks."""
    blocks = -(-keys // BLOCK_SIZE)
    k_cache = torch.randn(rows * blocks, BLOCK_SIZE, kv_heads, dim, generator=gen)
    v_cache = torch.randn(rows * blocks, BLOCK_SIZE, kv_heads, dim, generator=gen)
    tables = torch.randperm(rows * blocks, generator=gen).view(rows, blocks).contiguous()
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=gen)
    return qkv, k_cache, v_cache, tables, torch.full((rows,), keys)


def median_ms(case: tuple[torch.Tensor, ...], shape: ops.LayerShape) -> float:
    ops.decode_attention(*case, shape)
    times = []
    for _ in range(7):
        start = time.perf_counter()
        ops.decode_attention(*case, shape)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if build.load() is None:
        raise SystemExit("the C++ kernels did not build; decode_attention is what this measures")
    gen = torch.Generator().manual_seed(0)
    results = []
    for model, (heads, kv_heads, dim) in SHAPES.items():
        shape = layer_shape(heads, kv_heads, dim)
        prompt = prompt_rows(heads, kv_heads, dim, 512, gen)
        together = ops.decode_attention(*prompt, shape)
        qkv, k_cache, v_cache, tables, lens = prompt
        invariant = all(
            torch.equal(
                ops.decode_attention(qkv[i : i + 1], k_cache, v_cache, tables[i : i + 1], lens[i : i + 1], shape),
                together[i : i + 1],
            )
            for i in range(0, 512, 37)
        )
        results.append(
            {"model": model, "case": "prompt of 512 rows", "ms": median_ms(prompt, shape), "invariant": invariant}
        )
        decode = decode_rows(heads, kv_heads, dim, 16, 2048, gen)
        results.append({"model": model, "case": "16 decode rows x 2048 keys", "ms": median_ms(decode, shape)})
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    report = {"commit": commit, "threads": args.threads, "dtype": "float32", "results": results}
    for r in results:
        print(
            f"{r['model']:14} {r['case']:28} {r['ms']:7.2f} ms"
            + ("" if r.get("invariant", True) else "  NOT batch-invariant")
        )
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
