"""Two checkouts of kvserve on one model, measured in alternation: what a change does to speed.

compare.py and decode_ab.py set kvserve beside its peers; this sets a change beside the code before it.
Each round starts a fresh process per checkout (one model in memory at a time), in the order A, B,
then B, A in the next round (ABBA, so that drift in the machine's speed falls on both). Each
process imports kvserve from its checkout (PYTHONPATH; its C++ kernels are built for its own sources,
kvserve/kernels/build.py), loads --model in the default configuration, warms up, then measures, with
compare.py's definitions: single-stream decode tok/s of --max-tokens greedy tokens (median of
--repeats), prefill tok/s of a --prompt-len prompt (median of --repeats), and aggregate tok/s of 16
and of 64 requests of --max-tokens at once (median of 2 each). A round's ratio is B over A from its
two adjacent processes. Writes JSON (--out) with every process's figures, the medians and the ratios.

    python bench/checkouts_ab.py --a /tmp/before --b . --model gemma3-270m --out results/quads_ab.json

Make the "before" checkout with `git worktree add /tmp/before HEAD~1` (or `git archive`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ONE_PROCESS = r"""
import kvserve  # first: its GOMP_SPINCOUNT default
import json, statistics, sys, time
sys.path.insert(0, "bench")
from throughput import Prompts, decode_rate, stream_times
from kvserve import LLM, SamplingParams
from kvserve.kernels import build

model, max_tokens, prompt_len, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
llm = LLM(model, progress=False, session_db=False, kv_cache_tokens=16384, max_num_seqs=64)
build.load()
prompts = Prompts(0)
greedy = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
stream_times(llm, prompts.short(), SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))  # warm-up
decode = []
for _ in range(repeats):
    _, times = stream_times(llm, prompts.short(), greedy)
    decode.append(decode_rate(times))
prefill = []
for _ in range(repeats):
    prompt = prompts.make(prompt_len)
    start = time.perf_counter()
    llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0))
    prefill.append(prompt_len / (time.perf_counter() - start))
aggregate = {16: [], 64: []}
for streams, rates in aggregate.items():
    for _ in range(2):
        batch = [prompts.short() for _ in range(streams)]
        start = time.perf_counter()
        results = llm.generate(batch, greedy)
        rates.append(sum(len(r.token_ids) for r in results) / (time.perf_counter() - start))
print(json.dumps({
    "decode_tokens_per_s": statistics.median(decode),
    "prefill_tokens_per_s": statistics.median(prefill),
    **{f"aggregate_tokens_per_s@{streams}": statistics.median(rates) for streams, rates in aggregate.items()},
    "weights": llm.weights,
}))
llm.close()
"""
KEYS = ("decode_tokens_per_s", "prefill_tokens_per_s", "aggregate_tokens_per_s@16", "aggregate_tokens_per_s@64")


def run(checkout: Path, args: argparse.Namespace) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    command = [sys.executable, "-c", ONE_PROCESS, args.model, str(args.max_tokens), str(args.prompt_len)]
    out = subprocess.run(
        [*command, str(args.repeats)], cwd=checkout, env=env, capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        raise SystemExit(f"{checkout}: exit {out.returncode}\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def commit(checkout: Path) -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=checkout, capture_output=True, text=True)
    return out.stdout.strip() or "(not a git checkout)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", type=Path, required=True, help="the checkout before (A)")
    parser.add_argument("--b", type=Path, required=True, help="the checkout after (B)")
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rounds = []
    for i in range(args.rounds):
        order = ("a", "b") if i % 2 == 0 else ("b", "a")
        figures = {}
        for side in order:
            figures[side] = run(getattr(args, side).resolve(), args)
            print(f"round {i + 1} {side}: " + ", ".join(f"{k} {figures[side][k]:.1f}" for k in KEYS), flush=True)
        rounds.append(
            {"order": "".join(order), **figures, "b_over_a": {k: figures["b"][k] / figures["a"][k] for k in KEYS}}
        )
    summary = {side: {k: statistics.median(r[side][k] for r in rounds) for k in KEYS} for side in ("a", "b")}
    ratios = {k: sorted(r["b_over_a"][k] for r in rounds) for k in KEYS}
    report = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "model": args.model,
        "a": {"path": str(args.a), "commit": commit(args.a)},
        "b": {"path": str(args.b), "commit": commit(args.b)},
        "settings": {k: getattr(args, k) for k in ("rounds", "max_tokens", "prompt_len", "repeats")},
        "median": summary,
        "b_over_a_per_round": ratios,
        "rounds": rounds,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    for k in KEYS:
        print(
            f"{k}: A {summary['a'][k]:.1f}, B {summary['b'][k]:.1f}, B / A per round {', '.join(f'{r:.2f}' for r in ratios[k])}"
        )


if __name__ == "__main__":
    main()
