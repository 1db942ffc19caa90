"""Does watching the engine slow it? Tokens/s at 16 streams with ten viewers of the engine view
attached (GET /v1/engine/events, as ten open pages) against none, on one `kvserve serve`.

The server runs as bench/serve.py starts it (the bundled GGUF, the engine in its own process unless
--kvserve-args says otherwise). Each round streams 16 completions of --max-tokens tokens (ignore_eos,
distinct prompts, all released together) and reports aggregate tokens/s; rounds alternate between
no viewers and ten viewers (none, ten, ten, none, ...), so that drift in the machine's speed falls on
both alike; the medians are compared, and each block of four rounds gives a ratio of its own. The
viewers run in a process of their own (as browsers would), each reading and parsing every message.
Also reported: the messages each viewer got per second and their size, the engine thread's time in
the status monitor (EngineMonitor's own count), and the CPU seconds per second of the front end, the
engine process and the viewers. Writes JSON (default bench/results/viewers.json).

    python bench/viewers.py                      # 8 rounds of each
    python bench/viewers.py --quick              # a smoke run: 2 rounds of 4 streams
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import multiprocessing
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

# The viewers' process imports this module too: the server's helpers (and kvserve, torch) load in main only.

BENCH = Path(__file__).resolve().parent
DEFAULT_OUT = BENCH / "results" / "viewers.json"


async def _view(base: str, stop: Any, counts: Any, index: int) -> None:
    async with (
        httpx.AsyncClient(timeout=None) as client,
        client.stream("GET", f"{base}/v1/engine/events") as response,
    ):
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                json.loads(line[6:])  # as a page would
                with counts.get_lock():
                    counts[2 * index] += 1
                    counts[2 * index + 1] += len(line)
            if stop.is_set():
                return


def viewers_main(base: str, num_viewers: int, stop: Any, ready: Any, counts: Any) -> None:
    """A process of viewers: each holds GET /v1/engine/events open and parses every message."""

    async def run() -> None:
        tasks = [asyncio.create_task(_view(base, stop, counts, i)) for i in range(num_viewers)]
        while min(counts[0::2]) == 0:  # every viewer has its first view
            await asyncio.sleep(0.05)
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.05)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(run())


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def monitor_counters(base: str) -> dict[str, Any]:
    with httpx.stream("GET", f"{base}/v1/engine/events") as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                return json.loads(line[6:])["counters"]
    raise RuntimeError("no engine view")


def one_round(
    base: str, args: argparse.Namespace, rng: random.Random, viewers: int, server_pids: list[int]
) -> dict[str, Any]:
    from serve import MODEL_NAME, load

    from kvserve.server.routes.status import STATUS_INTERVAL_S

    process = None
    if viewers:
        context = multiprocessing.get_context("spawn")
        stop, ready = context.Event(), context.Event()
        counts = context.Array("q", 2 * viewers)
        process = context.Process(target=viewers_main, args=(base, viewers, stop, ready, counts))
        process.start()
        if not ready.wait(60):
            raise RuntimeError("the viewers did not get their first view")
    try:
        before = monitor_counters(base)
        # That read has the engine copying its state for a while (the feed's watch_s): let it lapse, so
        # that rounds without viewers run unwatched.
        time.sleep(8 * STATUS_INTERVAL_S + 0.5)
        seen = list(counts) if viewers else []
        pids = [*server_pids, *([process.pid] if process is not None else [])]
        cpu = [cpu_seconds(pid) for pid in pids]
        started = time.perf_counter()
        result = asyncio.run(load(base, MODEL_NAME, args.streams, args.max_tokens, rng))
        elapsed = time.perf_counter() - started
        cpu = [(cpu_seconds(pid) - spent) / elapsed for pid, spent in zip(pids, cpu, strict=True)]
        seen = [b - a for a, b in zip(seen, list(counts), strict=True)] if viewers else []
        after = monitor_counters(base)
    finally:
        if process is not None:
            stop.set()
            process.join(30)
    result["viewers"] = viewers
    # CPU seconds per second of load: the front end (HTTP, SSE, the status feed), the engine process,
    # and the viewers (as browsers would be, here on the same machine)
    result["cpu_front_end"], result["cpu_engine"] = cpu[0], cpu[1]
    result["cpu_viewers"] = cpu[2] if viewers else 0.0
    result["monitor_s_per_s"] = (after["monitor_seconds_total"] - before["monitor_seconds_total"]) / elapsed
    if process is not None:
        messages, sizes = seen[0::2], seen[1::2]
        result["viewer_messages_per_s"] = statistics.mean(messages) / elapsed
        result["viewer_bytes_per_message"] = sum(sizes) / max(1, sum(messages))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model argument (default: the bundled GGUF)")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--viewers", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=8, help="rounds of each configuration")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kvserve-args", default="", help="more arguments for kvserve serve")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--quick", action="store_true", help="2 rounds of 4 streams of 32 tokens")
    args = parser.parse_args()
    from common import free_port
    from serve import MODEL_NAME, Server, kvserve_cmd, load, process_tree

    from kvserve.weights.registry import resolve_model

    if args.quick:
        args.rounds, args.streams, args.max_tokens = 2, 4, 32
    args.concurrency = [args.streams]
    gguf = resolve_model(args.model)
    port = free_port()
    cmd = kvserve_cmd(gguf, port, args, args.kvserve_args.split())
    print(f"starting {' '.join(cmd)}", file=sys.stderr, flush=True)
    server = Server(cmd, port)
    rng = random.Random(args.seed)
    rounds: list[dict[str, Any]] = []
    try:
        ready_s = server.wait_ready()
        # the engine process: the front end's spawned child (not multiprocessing's resource tracker)
        engine_pids = [
            pid
            for pid in process_tree(server.proc.pid)[1:]
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
        ]
        server_pids = [server.proc.pid, engine_pids[0] if engine_pids else server.proc.pid]
        asyncio.run(load(server.base, MODEL_NAME, args.streams, 16, rng))  # warm-up
        order = [0, args.viewers, args.viewers, 0] * ((args.rounds + 1) // 2)
        for viewers in order[: 2 * args.rounds]:
            result = one_round(server.base, args, rng, viewers, server_pids)
            rounds.append(result)
            print(
                f"{viewers:2d} viewers: {result['tokens_per_s']:.1f} tok/s, monitor "
                f"{1000 * result['monitor_s_per_s']:.2f} ms/s; CPU s/s: front end {result['cpu_front_end']:.2f}, "
                f"engine {result['cpu_engine']:.2f}, viewers {result['cpu_viewers']:.2f}",
                file=sys.stderr,
                flush=True,
            )
    finally:
        server.stop()
    none = [r["tokens_per_s"] for r in rounds if r["viewers"] == 0]
    watched = [r["tokens_per_s"] for r in rounds if r["viewers"]]
    ratio = statistics.median(watched) / statistics.median(none)
    # Each block of four rounds (none, ten, ten, none) gives a ratio of its own: the machine's drift
    # over the run falls on both sides of each one.
    blocks = [rounds[i : i + 4] for i in range(0, len(rounds) - 3, 4)]
    block_ratios = [
        statistics.mean(r["tokens_per_s"] for r in block if r["viewers"])
        / statistics.mean(r["tokens_per_s"] for r in block if not r["viewers"])
        for block in blocks
    ]
    summary = {
        "streams": args.streams,
        "viewers": args.viewers,
        "max_tokens": args.max_tokens,
        "rounds_each": args.rounds,
        "tokens_per_s_none_median": statistics.median(none),
        "tokens_per_s_viewers_median": statistics.median(watched),
        "ratio_viewers_to_none": ratio,
        "ratio_per_block": block_ratios,
        "ratio_per_block_median": statistics.median(block_ratios) if block_ratios else None,
        "within_3_percent": ratio >= 0.97,
        "viewer_messages_per_s": statistics.median(r["viewer_messages_per_s"] for r in rounds if r["viewers"]),
        "viewer_bytes_per_message": statistics.median(r["viewer_bytes_per_message"] for r in rounds if r["viewers"]),
        "monitor_ms_per_s_none": 1000 * statistics.median(r["monitor_s_per_s"] for r in rounds if not r["viewers"]),
        "monitor_ms_per_s_viewers": 1000 * statistics.median(r["monitor_s_per_s"] for r in rounds if r["viewers"]),
        **{
            f"cpu_{part}_{label}": statistics.median(r[f"cpu_{part}"] for r in rounds if bool(r["viewers"]) == watched_)
            for part in ("front_end", "engine", "viewers")
            for label, watched_ in (("none", False), ("viewers", True))
        },
    }
    out = {
        "date": datetime.date.today().isoformat(),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "cmd": cmd,
        "ready_s": ready_s,
        "summary": summary,
        "rounds": rounds,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
