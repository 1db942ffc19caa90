"""The sampler's cost per decode step with repetition, frequency and presence penalties, by the length
of the conversations: 64 rows of SmolLM2's vocabulary, greedy, each row one token longer every step
(as in decode). No model: the sampler alone. Two figures per length:

- `ms`: the whole sampler, with the penalties and without (the same rows);
- `apply_ms`: the penalties alone (without the sampler's copy of the logits and its argmax). Before,
  a row at a time, it was host work (sets, a sort, lists made tensors) growing with the context;
  after, the host's part is what it takes at the shortest context (a lookup per new token, a few
  operations for every row at once), and the rest, one gather and one scatter over each row's
  distinct tokens, is the device's: on a GPU, microseconds.

Run it on the code before a change with that checkout first on PYTHONPATH.

    python bench/penalties.py --out bench/results/penalties.json
    PYTHONPATH=/tmp/before python bench/penalties.py --out bench/results/penalties_before.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parent.parent))  # last: a "before" checkout on PYTHONPATH wins

VOCAB = 49152


def rows_of(rows: int, context: int, penalized: bool) -> list:
    from kvserve import SamplingParams
    from kvserve.engine.sampler import SamplingRow

    rng = random.Random(context)
    params = (
        SamplingParams(temperature=0, repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.3)
        if penalized
        else SamplingParams(temperature=0)
    )
    keyed = "key" in {f.name for f in dataclasses.fields(SamplingRow)}
    return [
        SamplingRow(
            params,
            [rng.randrange(VOCAB) for _ in range(context * 2 // 3)],
            [rng.randrange(VOCAB) for _ in range(context // 3)],
            None,
            (0,),
            **({"key": f"r{i}"} if keyed else {}),
        )
        for i in range(rows)
    ]


def sampler_ms(device: str, rows: int, context: int, steps: int, penalized: bool) -> float:
    """Median ms per step of the sampler's launch and result over `steps` decode steps."""
    from kvserve.engine.sampler import Sampler

    batch = rows_of(rows, context, penalized)
    sampler = Sampler()
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(0)).to(device)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        tokens, _ = sampler(logits, batch)
        times.append(time.perf_counter() - start)
        for r, token in zip(batch, tokens, strict=True):
            r.output_token_ids.append(token)
    return statistics.median(times[2:]) * 1000


def apply_ms(device: str, rows: int, context: int, steps: int) -> float:
    """Median ms per step of the penalties alone."""
    from kvserve.engine import sampler

    batch = rows_of(rows, context, True)
    rng = random.Random(1)
    if hasattr(sampler, "Penalties"):
        penalties = sampler.Penalties()

        def apply(logits):
            penalties.apply(logits, batch, list(range(rows)))
    else:  # before: one row at a time

        def apply(logits):
            for i, r in enumerate(batch):
                sampler._apply_penalties(logits[i], r)

    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(0)).to(device)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        apply(logits)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        for r in batch:
            r.output_token_ids.append(rng.randrange(VOCAB))
    return statistics.median(times[2:]) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--contexts", default="60,2000,8000", help="tokens of each conversation (prompt 2/3)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("bench/results/penalties.json"))
    args = parser.parse_args()
    import kvserve

    root = Path(kvserve.__file__).resolve().parent.parent
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=root, capture_output=True, text=True)
    result = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
        "commit": commit.stdout.strip(),
        "kvserve": str(root),
        "rows": args.rows,
        "vocab": VOCAB,
        "steps": args.steps,
        "ms_per_step": [],
    }
    for context in [int(c) for c in args.contexts.split(",")]:
        record = {"context": context}
        for penalized in (False, True):
            ms = sampler_ms(args.device, args.rows, context, args.steps, penalized)
            record["ms" if penalized else "ms_without_penalties"] = round(ms, 3)
        record["apply_ms"] = round(apply_ms(args.device, args.rows, context, args.steps), 3)
        result["ms_per_step"].append(record)
        print(json.dumps(record), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
