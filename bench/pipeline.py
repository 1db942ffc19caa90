"""Pipeline parallelism on one host: the bundled model in one process on every core against two
pipeline stages of one core each (LLM(pipeline_parallel=2): rank 0 on the first CPU, rank 1 on the
second), in alternating rounds, the same greedy load for each (N streams of --max-tokens tokens,
distinct prompts, all released together). Reported per layout and level: aggregate tokens/s and
wall time per engine step; for the pipeline also the first stage's compute time per step (its
forward over its layers) and the bytes sent down the pipeline per step (plan and activations).

From these it estimates what two stages on two such hosts would give: there each stage has all of
its host's cores, so a stage's step takes about the one-process step's time at the micro-batch's
rows times the stage's share of the layers (half), plus the transfer of its bytes at --link-gbps.
The estimate is labelled as one in the JSON; the measured figures are beside it.

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

from common import WORDS

from kvserve import LLM, SamplingParams

OUT = Path(__file__).resolve().parent / "results" / "pipeline.json"


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
    timings_before = llm.runner_timings()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    steps = llm.stats()["steps_total"] - steps_before
    timings = llm.runner_timings()
    return {
        "streams": streams,
        "tokens_per_s": sum(counts) / wall,
        "wall_s": wall,
        "steps": steps,
        "ms_per_step": wall / max(1, steps) * 1e3,
        "first_stage_forward_ms_per_step": (timings["forward_s"] - timings_before["forward_s"])
        / max(1, timings["steps"] - timings_before["steps"])
        * 1e3,
    }


def measure(layout: str, levels: list[int], max_tokens: int, rounds: int) -> list[dict[str, Any]]:
    stages = 2 if layout == "pipeline" else 1
    started = time.perf_counter()
    with LLM(session_db=False, progress=False, pipeline_parallel=stages) as llm:
        ready = time.perf_counter() - started
        load(llm, 2, 8, seed=99)  # warm-up
        results = []
        for level in levels:
            sent_before = getattr(llm.engine.runner, "bytes_sent", 0)
            runs = [load(llm, level, max_tokens, seed=r) for r in range(rounds)]
            steps = sum(r["steps"] for r in runs)
            sent = getattr(llm.engine.runner, "bytes_sent", 0) - sent_before
            results.append(
                {
                    "layout": layout,
                    "streams": level,
                    "ready_s": ready,
                    "rounds": runs,
                    **{key: statistics.median(r[key] for r in runs) for key in runs[0] if key != "streams"},
                    "bytes_per_step": sent / max(1, steps) if stages > 1 else 0,
                }
            )
            print(f"{layout} {level} streams: {results[-1]['tokens_per_s']:.1f} tok/s", flush=True)
        return results


def estimate(single: dict[str, Any], pipeline: dict[str, Any], link_gbps: float) -> dict[str, Any]:
    """Two hosts, a stage each with all of its host's cores: each stage's step takes about the
    one-process step at half the rows (one micro-batch) times half the layers, the transfer on top;
    two micro-batches in flight keep both busy."""
    streams = single["streams"]
    micro_rows = -(-streams // 2)
    # the one-process step time scaled to a micro-batch's rows (linear in rows: an upper bound for few)
    one_process_step_s = single["ms_per_step"] / 1e3
    stage_s = one_process_step_s * (micro_rows / streams) / 2
    transfer_s = pipeline["bytes_per_step"] * 8 / (link_gbps * 1e9)
    step_s = stage_s + transfer_s
    return {
        "streams": streams,
        "note": "estimate, not a measurement: two hosts like this one, a stage each",
        "stage_step_ms": stage_s * 1e3,
        "transfer_ms": transfer_s * 1e3,
        "tokens_per_s": micro_rows / step_s,
        "vs_one_host": (micro_rows / step_s) / single["tokens_per_s"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of both layouts; medians")
    parser.add_argument("--link-gbps", type=float, default=10.0, help="the link between hosts, for the estimate")
    parser.add_argument("--quick", action="store_true", help="smoke test: 1 and 4 streams, 16 tokens, one round")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    if args.quick:
        args.concurrency, args.max_tokens, args.rounds = "1,4", 16, 1
    levels = [int(c) for c in args.concurrency.split(",")]
    measured: dict[str, list[dict[str, Any]]] = {"single": [], "pipeline": []}
    for _ in range(args.rounds):  # alternating layouts: the machine's speed drifts between minutes
        for layout in ("single", "pipeline"):
            measured[layout].append(measure(layout, levels, args.max_tokens, 1))
    rows = {}
    for layout, rounds in measured.items():
        rows[layout] = []
        for i, level in enumerate(levels):
            per_level = [r[i] for r in rounds]
            rows[layout].append(
                {
                    "layout": layout,
                    "streams": level,
                    "rounds": per_level,
                    **{
                        key: statistics.median(r[key] for r in per_level)
                        for key in (
                            "tokens_per_s",
                            "ms_per_step",
                            "first_stage_forward_ms_per_step",
                            "bytes_per_step",
                            "ready_s",
                        )
                    },
                }
            )
    estimates = [estimate(s, p, args.link_gbps) for s, p in zip(rows["single"], rows["pipeline"], strict=True)]
    report = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "python": platform.python_version()},
        "settings": {
            "concurrency": levels,
            "max_tokens": args.max_tokens,
            "rounds": args.rounds,
            "link_gbps": args.link_gbps,
        },
        "single_process_all_cores": rows["single"],
        "two_stages_one_core_each": rows["pipeline"],
        "estimate_two_hosts": estimates,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(
        "\n| streams | one process, 2 cores: tok/s (ms/step) | 2 stages, 1 core each: tok/s (ms/step) | bytes/step | estimate, 2 hosts: tok/s |"
    )
    print("|---:|---:|---:|---:|---:|")
    for s, p, e in zip(rows["single"], rows["pipeline"], estimates, strict=True):
        print(
            f"| {s['streams']} | {s['tokens_per_s']:.1f} ({s['ms_per_step']:.1f}) | {p['tokens_per_s']:.1f} "
            f"({p['ms_per_step']:.1f}) | {p['bytes_per_step']:.0f} | {e['tokens_per_s']:.0f} ({e['vs_one_host']:.2f}x) |"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
