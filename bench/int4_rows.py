"""int4_mm by row count: microseconds per call and GMAC/s of Int4Linear on random int4 weights, for
the bundled model's shapes (gate/up 3072 x 576, down 576 x 1536, q/k/v 960 x 576), best of 5 runs of
60 calls each. Each row of a batch is also checked to be the same bits as that row alone (batch
invariance). To compare two kernels, run it on two commits: the C++ is rebuilt per source hash.

    python bench/int4_rows.py --threads 2 --dtype bfloat16 --out /tmp/int4.json
"""

from __future__ import annotations

# kvserve first: importing it sets its GOMP_SPINCOUNT default, which only counts before torch loads libgomp.
import kvserve  # isort: skip  # noqa: F401
import argparse
import json
import time
from pathlib import Path

import torch

from kvserve.kernels import build
from kvserve.layers.quantized import Int4Groups, Int4Linear

SHAPES = ((3072, 576), (576, 1536), (960, 576))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--rows", default="1,2,16,64,256")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if build.load() is None:
        raise SystemExit("the C++ kernels did not build; int4_mm is what this measures")
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    results = []
    for n, k in SHAPES:
        layer = Int4Linear(Int4Groups.from_float(torch.randn(n, k)), dtype)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k).to(dtype)
            full = layer(x)
            invariant = all(torch.equal(layer(x[i : i + 1]), full[i : i + 1]) for i in range(rows))
            best = float("inf")
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(60):
                    layer(x)
                best = min(best, (time.perf_counter() - start) / 60)
            results.append(
                {
                    "n": n,
                    "k": k,
                    "rows": rows,
                    "us": best * 1e6,
                    "gmac_s": rows * n * k / best / 1e9,
                    "invariant": invariant,
                }
            )
            print(
                f"{n} x {k}, {rows} rows: {best * 1e6:.0f} us, {rows * n * k / best / 1e9:.0f} GMAC/s, "
                f"rows alone equal: {invariant}"
            )
    if args.out:
        report = {"threads": args.threads, "dtype": args.dtype, "torch": torch.__version__, "results": results}
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
