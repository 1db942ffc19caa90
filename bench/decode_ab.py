"""Single-stream decode and prefill, kvserve against llama.cpp, measured in alternation.

compare.py measures one engine after the other. On a shared machine whose speed drifts by tens of
percent over minutes, the single-stream decode ratio then says as much about when each engine ran
as about the engines. Here the two engines take turns: each round starts a fresh process per engine
(one engine in memory at a time, as in compare.py), in the order kvserve, llama.cpp, then llama.cpp,
kvserve in the next round, and so on (ABBA, so neither always goes first). Each process loads the
GGUF (--model, the bundled one unless told), warms up, and decodes --max-tokens greedy tokens from a short random prompt --repeats
times; tokens/s is (tokens - 1) / (first token -> last token), as in compare.py. It then prefills a
random --prompt-len prompt (one generated token) --repeats times: tokens/s is the prompt's length over
the median time, as in compare.py. A round's ratio is kvserve's median over llama.cpp's median from
the two adjacent processes, for each workload; the report gives every round's figures, the median of
the rates and the median, min and max of the round ratios.

Both engines run on 2 threads (--threads) on the same GGUF: kvserve with `LLM(weights=--kvserve-weights)`
(compare.py's values: auto+int8 adds activations="int8", +f16kv a float16 KV cache), llama.cpp
in-process through llama-cpp-python's low-level loop (compare.llamacpp_stream). Writes JSON (--out,
default results/decode_ab.json) and prints a Markdown table.

    python bench/decode_ab.py                     # 6 rounds, 128 tokens, 3 decodes per process
    python bench/decode_ab.py --rounds 2 --max-tokens 32 --prompt-len 64 --out /tmp/ab.json   # smoke test
"""

from __future__ import annotations

import kvserve  # isort: skip  # noqa: F401
import argparse
import dataclasses
import datetime
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import compare
import torch
from throughput import WARMUP_TOKENS, Prompts, kvserve_decode, kvserve_prefill, machine_info, stream_times

from kvserve.kernels import build
from kvserve.weights.registry import DEFAULT_MODEL, resolve_model

DEFAULT_OUT = compare.RESULTS / "decode_ab.json"
ENGINES = ("kvserve", "llama.cpp")


def worker_settings(args: argparse.Namespace, seed: int) -> compare.Settings:
    """compare.py's settings for one stream of --max-tokens, --repeats times, on --threads threads."""
    flags = {
        "--concurrency": 1,
        "--max-tokens": args.max_tokens,
        "--prompt-len": max(args.prompt_len, 1),
        "--repeats": args.repeats,
        "--seed": seed,
        "--model": args.model,
    }
    argv = [str(part) for flag in flags.items() for part in flag]
    settings, _, _ = compare.parse_args([*argv, "--kvserve-weights", args.kvserve_weights])
    return dataclasses.replace(settings, threads=args.threads)


def measure(engine: str, s: compare.Settings, prefill: bool) -> dict[str, Any]:
    """In this process: start `engine`, warm up, decode --repeats times, then (with `prefill`) prefill
    --repeats prompts (compare.py's loops). Returns {"decode": ..., "prefill": ...}."""
    torch.set_num_threads(s.threads)
    prompts = Prompts(s.seed)
    out: dict[str, Any] = {}
    if engine == "kvserve":
        llm, _ = compare.start_kvserve(s.kvserve_weights[0], s, prompts)
        try:
            build.load()  # measured with the fused step in place, as compare.py does
            stream_times(llm, prompts.short(), compare.greedy(WARMUP_TOKENS))
            out["decode"], _ = kvserve_decode(llm, prompts, s.for_throughput())
            if prefill:
                out["prefill"] = kvserve_prefill(llm, prompts, s.for_throughput())
        finally:
            llm.close()
        return out
    llm = compare.llamacpp_model(s)
    try:
        compare.llamacpp_stream(llm, prompts.short(), WARMUP_TOKENS)
        out["decode"] = compare.timed_decode(lambda p: compare.llamacpp_stream(llm, p, s.max_tokens)[1], prompts, s)
        if prefill:
            out["prefill"] = compare.timed_prefill(lambda p: compare.llamacpp_stream(llm, p, 1), prompts, s)
    finally:
        llm.close()
    return out


def run_worker(engine: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """`measure` in a fresh process (this script with --worker); its JSON from the last stdout line."""
    command = [sys.executable, __file__, "--worker", engine, "--seed", str(seed)]
    command += ["--max-tokens", str(args.max_tokens), "--repeats", str(args.repeats), "--threads", str(args.threads)]
    command += ["--prompt-len", str(args.prompt_len), "--kvserve-weights", args.kvserve_weights, "--model", args.model]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{engine} worker failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6, help="rounds of one process per engine (default 6)")
    parser.add_argument("--max-tokens", type=int, default=128, help="new tokens per decode (default 128)")
    parser.add_argument(
        "--prompt-len", type=int, default=512, help="prefill prompt length, 0 for no prefill (default 512)"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="decodes (and prefills) per process; its median counts (default 3)"
    )
    parser.add_argument("--threads", type=int, default=2, help="threads for both engines (default 2)")
    parser.add_argument("--kvserve-weights", default="auto", help="LLM's weights for kvserve (default auto)")
    parser.add_argument("--seed", type=int, default=0, help="prompt seed (default 0)")
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, help=f"a registered name or a .gguf path (default {DEFAULT_MODEL})"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON output (default {DEFAULT_OUT})")
    parser.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)  # internal: one measuring process
    args = parser.parse_args(argv)
    if min(args.rounds, args.max_tokens - 1, args.repeats, args.threads) < 1 or args.prompt_len < 0:
        parser.error("--rounds, --repeats and --threads must be at least 1, --max-tokens at least 2, --prompt-len >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(measure(args.worker, worker_settings(args, args.seed), args.prompt_len > 0)))
        return 0
    missing = compare.importable("llama_cpp")
    if missing:
        print(f"llama.cpp is the peer here and {missing}; pip install llama-cpp-python", file=sys.stderr)
        return 1
    workloads = ("decode", "prefill") if args.prompt_len else ("decode",)
    rounds = []
    for i in range(args.rounds):
        order = ENGINES if i % 2 == 0 else ENGINES[::-1]
        # the same prompts for both engines within a round, fresh ones each round
        figures = {engine: run_worker(engine, args, args.seed + i) for engine in order}
        ratios = {w: figures["kvserve"][w]["tokens_per_s"] / figures["llama.cpp"][w]["tokens_per_s"] for w in workloads}
        rounds.append({"order": list(order), **figures, "ratio": ratios})
        print(
            f"round {i + 1}: "
            + "; ".join(
                f"{w} kvserve {figures['kvserve'][w]['tokens_per_s']:.1f}, "
                f"llama.cpp {figures['llama.cpp'][w]['tokens_per_s']:.1f} tok/s, ratio {ratios[w]:.2f}"
                for w in workloads
            ),
            flush=True,
        )
    summary = {}
    for w in workloads:
        ratios = [r["ratio"][w] for r in rounds]
        summary[w] = {
            "kvserve_tokens_per_s": statistics.median(r["kvserve"][w]["tokens_per_s"] for r in rounds),
            "llamacpp_tokens_per_s": statistics.median(r["llama.cpp"][w]["tokens_per_s"] for r in rounds),
            "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
        }
    report = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(args.threads),
        "model": str(resolve_model(args.model)),
        "settings": {k: v for k, v in vars(args).items() if k not in ("worker", "out")},
        "rounds": rounds,
        "summary": summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    table = [
        f"| workload | kvserve ({args.kvserve_weights}) tok/s | llama.cpp tok/s | kvserve / llama.cpp, median of "
        f"{args.rounds} rounds (min - max) |",
        "|---|---:|---:|---:|",
    ]
    for w, f in summary.items():
        table.append(
            f"| {w} | {f['kvserve_tokens_per_s']:.1f} | {f['llamacpp_tokens_per_s']:.1f} | "
            f"{f['ratio_median']:.2f} ({f['ratio_min']:.2f} - {f['ratio_max']:.2f}) |"
        )
    print("\n" + "\n".join(table) + f"\n\nWrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
