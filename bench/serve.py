"""Serving benchmark: streaming load on `kvserve serve` (and llama.cpp's server when installed).

For each concurrency level, that many clients each stream one completion of --max-tokens tokens
(ignore_eos) with a distinct prompt, all released together. Reported per level: aggregate
tokens/s (all tokens / wall time), time to first token p50/p99, inter-token latency p50/p99.
The peer is llama-cpp-python's OpenAI server on the same GGUF, started the same way; without
`llama-cpp-python[server]` installed its columns are skipped with a note. Writes JSON and prints a
Markdown table. Smoke test: `python bench/serve.py --quick`.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib.util
import json
import os
import platform
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from common import WORDS, free_port, percentile

from kvserve.weights.registry import resolve_model

DEFAULT_OUT = Path(__file__).parent / "results" / "serve.json"


def start_server(cmd: list[str], port: int, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, float]:
    """Start a server process; return it and the seconds until /health (or /v1/models) answered 200."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    while time.perf_counter() - start < 300:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stderr.read()[-2000:]}")
        for path in ("/health", "/v1/models"):
            try:
                if httpx.get(base + path, timeout=1).status_code == 200:
                    return proc, time.perf_counter() - start
            except httpx.HTTPError:
                pass
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("server did not become ready in 300 s")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


async def one_stream(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    submitted = time.perf_counter()
    times: list[float] = []
    async with client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("choices") and (event["choices"][0].get("text") or event["choices"][0].get("finish_reason")):
                times.append(time.perf_counter())
    return {"submitted": submitted, "times": times}


async def load(base: str, model: str, concurrency: int, max_tokens: int, rng: random.Random) -> dict[str, Any]:
    prompts = [f"{i}: " + " ".join(rng.choice(WORDS) for _ in range(24)) for i in range(concurrency)]
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()
        results = await asyncio.gather(
            *(one_stream(client, f"{base}/v1/completions", model, p, max_tokens) for p in prompts)
        )
        wall = max(r["times"][-1] for r in results) - start
    tokens = sum(len(r["times"]) for r in results)
    ttft = [r["times"][0] - r["submitted"] for r in results]
    gaps = [b - a for r in results for a, b in zip(r["times"], r["times"][1:], strict=False)]
    return {
        "clients": concurrency,
        "events": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_s": percentile(gaps, 50),
        "itl_p99_s": percentile(gaps, 99),
    }


def run_peer(name: str, cmd: list[str], port: int, model: str, args, env=None) -> dict[str, Any]:
    proc, ready_s = start_server(cmd, port, env)
    base = f"http://127.0.0.1:{port}"
    rng = random.Random(args.seed)
    try:
        asyncio.run(load(base, model, 1, 8, rng))  # warm-up
        levels = {str(c): asyncio.run(load(base, model, c, args.max_tokens, rng)) for c in args.concurrency}
    finally:
        stop_server(proc)
    return {"name": name, "ready_s": ready_s, "levels": levels}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,4,16,64", help="comma-separated client counts")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per stream")
    parser.add_argument("--dtype", default="auto", help="kvserve --dtype")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="smoke test: 1,4 clients, 16 tokens")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    if args.quick:
        args.concurrency, args.max_tokens = "1,4", 16
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    gguf = resolve_model(None)
    threads = os.cpu_count() or 1

    peers = []
    port = free_port()
    kv_cmd = [
        sys.executable,
        "-m",
        "kvserve.cli",
        "serve",
        "--model",
        str(gguf),
        "--port",
        str(port),
        "--dtype",
        args.dtype,
        "--served-model-name",
        "bench",
        "--log-level",
        "warning",
        "--max-num-seqs",
        str(max(64, *args.concurrency)),
    ]
    peers.append(run_peer("kvserve", kv_cmd, port, "bench", args))
    note = None
    if importlib.util.find_spec("llama_cpp") is not None and importlib.util.find_spec("uvicorn") is not None:
        port = free_port()
        cpp_cmd = [
            sys.executable,
            "-m",
            "llama_cpp.server",
            "--model",
            str(gguf),
            "--port",
            str(port),
            "--n_threads",
            str(threads),
            "--model_alias",
            "bench",
            "--n_ctx",
            "8192",
        ]
        try:
            peers.append(run_peer("llama.cpp (llama-cpp-python server)", cpp_cmd, port, "bench", args))
        except (RuntimeError, httpx.HTTPError) as exc:
            note = f"llama.cpp server failed: {exc}"
    else:
        note = (
            "llama.cpp peer skipped: llama-cpp-python[server] is not installed (pip install 'llama-cpp-python[server]')"
        )

    report = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "python": platform.python_version()},
        "model": str(gguf),
        "settings": {"concurrency": args.concurrency, "max_tokens": args.max_tokens, "dtype": args.dtype},
        "peers": peers,
        "note": note,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(
        "| server | clients | tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |\n|---|---:|---:|---:|---:|---:|---:|"
    )
    for peer in peers:
        for level in peer["levels"].values():
            print(
                f"| {peer['name']} | {level['clients']} | {level['tokens_per_s']:.1f} | {level['ttft_p50_s'] * 1e3:.0f} | "
                f"{level['ttft_p99_s'] * 1e3:.0f} | {level['itl_p50_s'] * 1e3:.1f} | {level['itl_p99_s'] * 1e3:.1f} |"
            )
    for peer in peers:
        print(f"{peer['name']}: ready after {peer['ready_s']:.1f} s")
    if note:
        print(note)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
