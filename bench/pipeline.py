"""Pipeline parallelism on one host: the bundled model in one process on every core against two
pipeline stages of one core each (LLM(pipeline_parallel=2): rank 0 on the first CPU, rank 1 on the
second), and one process on one core, in alternating rounds, the same greedy load for each (N
streams of --max-tokens tokens, distinct prompts, all released together). Reported per layout and
level: aggregate tokens/s and wall time per engine step; for the pipeline also each stage's compute
time per step (rank 0's forward over its layers; the last stage's layers, lm_head and sampler, as it
reports them with each result) and the bytes sent down the pipeline per step (plan and activations).

From these it estimates two stages on two hosts like this one, a stage each: a stage's step then takes
its measured one-core time divided by the speed-up of this machine's second core (one process: one
core against all of them), plus the transfer of its bytes at --link-gbps with --link-latency-ms per
message; with two micro-batches in flight the slower stage sets the pace, with one stream (one
micro-batch) the stages take turns. The estimate is labelled as one in the JSON, beside the
measurements it comes from.

    python bench/pipeline.py --rounds 3            # results/pipeline.json
    python bench/pipeline.py --quick               # smoke test
"""

from __future__ import annotations

# kvserve first: importing it sets its GOMP_SPINCOUNT default, which only counts before torch loads libgomp.
import kvserve  # isort: skip  # noqa: F401
import argparse
import datetime
import json
import os
import platform
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch
from common import WORDS

from kvserve import LLM, SamplingParams

OUT = Path(__file__).resolve().parent / "results" / "pipeline.json"
ALL_CPUS = len(os.sched_getaffinity(0))


def load(llm: LLM, streams: int, max_tokens: int, seed: int) -> dict[str, float]:
    """`streams` greedy requests at once; aggregate tokens/s and the engine's steps over the load."""
    prompts = [
        f"{seed}-{i}: " + " ".join(WORDS[(i * 7 + j + seed) % len(WORDS)] for j in range(24)) for i in range(streams)
    ]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    barrier = threading.Barrier(streams + 1)
    counts = [0] * streams

    def run(i: int) -> None:
        barrier.wait()
        counts[i] = len(llm.generate(prompts[i], params).token_ids)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    steps_before = llm.stats()["steps_total"]
    stages_before = list(getattr(llm.engine.runner, "stage_seconds", []))
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    steps = llm.stats()["steps_total"] - steps_before
    stage_seconds = getattr(llm.engine.runner, "stage_seconds", None)
    return {
        "streams": streams,
        "tokens_per_s": sum(counts) / wall,
        "wall_s": wall,
        "steps": steps,
        "ms_per_step": wall / max(1, steps) * 1e3,
        "stage_ms_per_step": [(b - a) / max(1, steps) * 1e3 for a, b in zip(stages_before, stage_seconds, strict=True)]
        if stage_seconds is not None
        else [],
    }


LAYOUTS = {
    "single": "one process, all cores",
    "pipeline": "two stages, one core each",
    "one-core": "one process, one core",
}


def measure(layout: str, levels: list[int], max_tokens: int) -> list[dict[str, Any]]:
    """One round of every level on a fresh engine of `layout`."""
    # The engine thread starts with torch's thread count, which a pipeline's rank 0 sets to its share
    # of the CPUs for the whole process: every layout sets its own first.
    torch.set_num_threads(1 if layout == "one-core" else ALL_CPUS)
    started = time.perf_counter()
    with LLM(session_db=False, progress=False, pipeline_parallel=2 if layout == "pipeline" else 1) as llm:
        ready = time.perf_counter() - started
        load(llm, 2, 8, seed=99)  # warm-up
        results = []
        for level in levels:
            sent_before = getattr(llm.engine.runner, "bytes_sent", 0)
            result = load(llm, level, max_tokens, seed=level)
            sent = getattr(llm.engine.runner, "bytes_sent", 0) - sent_before
            result["bytes_per_step"] = sent / max(1, result["steps"])
            result["ready_s"] = ready
            results.append(result)
            print(f"{layout} {level} streams: {result['tokens_per_s']:.1f} tok/s", flush=True)
        return results


def estimate(
    single: dict[str, Any], one_core: dict[str, Any], pipeline: dict[str, Any], gbps: float, latency_ms: float
) -> dict[str, Any]:
    """Two hosts like this one, a stage each (see the module's docstring)."""
    streams = single["streams"]
    speedup = one_core["ms_per_step"] / single["ms_per_step"]  # what all of a host's cores give over one
    stage_ms = [ms / speedup for ms in pipeline["stage_ms_per_step"]]
    transfer_ms = pipeline["bytes_per_step"] * 8 / (gbps * 1e9) * 1e3 + 3 * latency_ms  # 3 messages per hop
    micro_batches = min(2, streams)
    rows = -(-streams // micro_batches)
    step_ms = max(stage_ms) + transfer_ms if micro_batches > 1 else sum(stage_ms) + 2 * transfer_ms
    tokens_per_s = rows / step_ms * 1e3
    return {
        "streams": streams,
        "note": "an estimate, not a measurement: two hosts like this one, a stage each",
        "second_core_speedup": speedup,
        "stage_ms": stage_ms,
        "transfer_ms": transfer_ms,
        "tokens_per_s": tokens_per_s,
        "vs_one_host": tokens_per_s / single["tokens_per_s"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of both layouts; medians")
    parser.add_argument("--link-gbps", type=float, default=10.0, help="the link between hosts, for the estimate")
    parser.add_argument("--link-latency-ms", type=float, default=0.05, help="per message on that link")
    parser.add_argument("--quick", action="store_true", help="smoke test: 1 and 4 streams, 16 tokens, one round")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    if args.quick:
        args.concurrency, args.max_tokens, args.rounds = "1,4", 16, 1
    levels = [int(c) for c in args.concurrency.split(",")]
    measured: dict[str, list[list[dict[str, Any]]]] = {layout: [] for layout in LAYOUTS}
    for _ in range(args.rounds):  # alternating layouts: the machine's speed drifts between minutes
        for layout in LAYOUTS:
            measured[layout].append(measure(layout, levels, args.max_tokens))
    keys = ("tokens_per_s", "ms_per_step", "bytes_per_step", "ready_s")
    rows: dict[str, list[dict[str, Any]]] = {}
    for layout, rounds in measured.items():
        rows[layout] = []
        for i, level in enumerate(levels):
            per_level = [r[i] for r in rounds]
            row = {"layout": LAYOUTS[layout], "streams": level, "rounds": per_level}
            row.update({key: statistics.median(r[key] for r in per_level) for key in keys})
            row["stage_ms_per_step"] = [
                statistics.median(s) for s in zip(*(r["stage_ms_per_step"] for r in per_level), strict=True)
            ]
            rows[layout].append(row)
    estimates = [
        estimate(s, o, p, args.link_gbps, args.link_latency_ms)
        for s, o, p in zip(rows["single"], rows["one-core"], rows["pipeline"], strict=True)
    ]
    report = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "python": platform.python_version()},
        "settings": {
            "concurrency": levels,
            "max_tokens": args.max_tokens,
            "rounds": args.rounds,
            "link_gbps": args.link_gbps,
            "link_latency_ms": args.link_latency_ms,
        },
        **{layout: rows[layout] for layout in LAYOUTS},
        "estimate_two_hosts": estimates,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(
        "\n| streams | one process, all cores: tok/s (ms/step) | one process, one core | two stages, one core each: "
        "tok/s (ms/step) | stage ms/step | bytes/step | estimate, two hosts: tok/s |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for s, o, p, e in zip(rows["single"], rows["one-core"], rows["pipeline"], estimates, strict=True):
        stages = " / ".join(f"{ms:.1f}" for ms in p["stage_ms_per_step"])
        print(
            f"| {s['streams']} | {s['tokens_per_s']:.1f} ({s['ms_per_step']:.1f}) | {o['tokens_per_s']:.1f} | "
            f"{p['tokens_per_s']:.1f} ({p['ms_per_step']:.1f}) | {stages} | {p['bytes_per_step']:.0f} | "
            f"{e['tokens_per_s']:.0f} ({e['vs_one_host']:.2f}x) |"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
