"""Throughput benchmark: kvserve against Hugging Face transformers on the bundled SmolLM2-135M GGUF.

Measures, per dtype, for both engines in the same run:
  1. prefill tokens/s of a --prompt-len prompt (a generate of one token; median of --repeats runs);
  2. single-stream decode tokens/s: (tokens - 1) / (first token -> last token), median of --repeats runs;
  3. aggregate decode tokens/s and time to first token p50/p99 at each --concurrency level;
  4. kvserve's per-step Python overhead, from ModelRunner timings over each decode workload.
transformers serves the concurrent columns as one left-padded batch; its TTFT is the time of a
one-token generate of the whole batch, the same for every request. Ratios are kvserve / transformers.

Prompts are random token ids (fixed seed, a fresh prompt for every request) so the prefix cache
never hits. Writes JSON (--out) and prints a Markdown table. Smoke test: `python bench/throughput.py --quick`.
"""

from __future__ import annotations

# kvserve first: importing it sets its GOMP_SPINCOUNT default, which only counts before torch loads libgomp.
import kvserve  # isort: skip  # noqa: F401
import argparse
import datetime
import gc
import json
import os
import platform
import random
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from common import percentile

from kvserve import LLM, SamplingParams
from kvserve.weights.registry import resolve_model

DEFAULT_OUT = Path(__file__).parent / "results" / "throughput.json"
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TOKEN_RANGE = (100, 40_000)  # ordinary vocabulary ids: no special tokens
SHORT_PROMPT = (16, 32)  # lengths of the decode and concurrency prompts
WARMUP_TOKENS = 8


@dataclass(frozen=True)
class Settings:
    dtypes: tuple[str, ...]
    concurrency: tuple[int, ...]
    max_tokens: int
    prompt_len: int
    repeats: int
    seed: int
    skip_hf: bool
    threads: int


# ----- helpers ----------------------------------------------------------------------------------
class Prompts:
    """A fixed-seed source of distinct random prompts, so no two requests share a cached prefix."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def make(self, length: int) -> list[int]:
        return [self.rng.randint(*TOKEN_RANGE) for _ in range(length)]

    def short(self) -> list[int]:
        return self.make(self.rng.randint(*SHORT_PROMPT))


def decode_rate(token_times: list[float]) -> float:
    """Tokens per second between the first and the last token (the first token's latency excluded)."""
    return (len(token_times) - 1) / (token_times[-1] - token_times[0])


def cpu_model() -> str:
    """The CPU's marketing name where Linux tells it, else the architecture."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def machine_info(threads: int, device: str = "cpu") -> dict[str, Any]:
    gpu = {"gpu": torch.cuda.get_device_name(device), "cuda": torch.version.cuda} if device.startswith("cuda") else {}
    return {
        **gpu,
        "platform": platform.platform(),
        "processor": cpu_model(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_num_threads": threads,
        "mkldnn_bf16": bool(getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)()),
    }


# ----- kvserve ----------------------------------------------------------------------------------
def stream_times(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[float, list[float]]:
    """Submit one streaming request; return its submit time and the arrival time of every token."""
    submitted = time.perf_counter()
    times: list[float] = []
    for chunk in llm.stream(prompt, params):
        now = time.perf_counter()
        times.extend(now for _ in chunk.token_ids)
    return submitted, times


def step_breakdown(llm: LLM, run: Callable[[], float]) -> dict[str, float]:
    """Per-step timings of ModelRunner over `run` (which returns its wall time); the engine is idle around it."""
    before = llm.runner_timings()
    wall = run()
    after = llm.runner_timings()
    steps = after["steps"] - before["steps"]
    prepare, forward, sample = (after[k] - before[k] for k in ("prepare_s", "forward_s", "sample_s"))
    per_step = 1e3 / max(steps, 1)
    return {
        "steps": steps,
        "wall_s": wall,
        "wall_ms_per_step": wall * per_step,
        "prepare_ms_per_step": prepare * per_step,
        "forward_ms_per_step": forward * per_step,
        "sample_ms_per_step": sample * per_step,
        # Everything of the step loop outside the runner's forward and sampling: prepare, scheduling,
        # output processing, delivery to the caller's thread.
        "overhead_ms_per_step": (wall - forward - sample) * per_step,
    }


def kvserve_prefill(llm: LLM, prompts: Prompts, s: Settings) -> dict[str, Any]:
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    runs, cached = [], 0
    for _ in range(s.repeats):
        prompt = prompts.make(s.prompt_len)
        start = time.perf_counter()
        result = llm.generate(prompt, params)
        runs.append(time.perf_counter() - start)
        cached += result.usage.cached_tokens if result.usage else 0
    seconds = statistics.median(runs)
    return {
        "prompt_tokens": s.prompt_len,
        "runs_s": runs,
        "cached_tokens": cached,
        "tokens_per_s": s.prompt_len / seconds,
    }


def kvserve_decode(llm: LLM, prompts: Prompts, s: Settings) -> tuple[dict[str, Any], dict[str, float]]:
    params = SamplingParams(max_tokens=s.max_tokens, temperature=0, ignore_eos=True)
    rates: list[float] = []

    def run() -> float:
        wall = 0.0
        for _ in range(s.repeats):
            submitted, times = stream_times(llm, prompts.short(), params)
            assert len(times) == s.max_tokens, f"expected {s.max_tokens} tokens, got {len(times)}"
            rates.append(decode_rate(times))
            wall += times[-1] - submitted
        return wall

    overhead = step_breakdown(llm, run)  # summed over all repeats
    return {"new_tokens": s.max_tokens, "runs_tokens_per_s": rates, "tokens_per_s": statistics.median(rates)}, overhead


def kvserve_concurrent(llm: LLM, prompts: Prompts, s: Settings, n: int) -> tuple[dict[str, Any], dict[str, float]]:
    """n threads, one streaming request each, released together."""
    params = SamplingParams(max_tokens=s.max_tokens, temperature=0, ignore_eos=True)
    batch = [prompts.short() for _ in range(n)]
    barrier = threading.Barrier(n + 1)
    results: list[tuple[float, list[float]] | BaseException | None] = [None] * n

    def worker(i: int) -> None:
        barrier.wait()
        try:
            results[i] = stream_times(llm, batch[i], params)
        except BaseException as exc:
            results[i] = exc

    def run() -> float:
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        start = time.perf_counter()
        barrier.wait()
        for t in threads:
            t.join()
        for r in results:
            if not isinstance(r, tuple):
                raise r or RuntimeError("a request thread returned nothing")
        return max(times[-1] for _, times in results) - start

    breakdown = step_breakdown(llm, run)
    wall_s = breakdown["wall_s"]
    tokens = sum(len(times) for _, times in results)
    assert tokens == n * s.max_tokens, f"expected {n * s.max_tokens} tokens, got {tokens}"
    ttft = [times[0] - submitted for submitted, times in results]
    return batch_result(batch, tokens, wall_s, ttft), breakdown


def batch_result(batch: list[list[int]], tokens: int, wall_s: float, ttft: list[float]) -> dict[str, Any]:
    """The figures of one concurrency level: aggregate tokens/s and time to first token."""
    return {
        "requests": len(batch),
        "prompt_tokens": [len(p) for p in batch],
        "generated_tokens": tokens,
        "wall_s": wall_s,
        "aggregate_tokens_per_s": tokens / wall_s,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "ttft_s": ttft,
    }


def kvserve_workloads(llm: LLM, prompts: Prompts, s: Settings) -> dict[str, Any]:
    """A warm-up, then prefill, single-stream decode and every concurrency level (each with its
    per-step overhead), then `llm.stats()`."""
    llm.generate(prompts.short(), SamplingParams(max_tokens=WARMUP_TOKENS, temperature=0, ignore_eos=True))
    out: dict[str, Any] = {"prefill": kvserve_prefill(llm, prompts, s)}
    out["decode"], overhead = kvserve_decode(llm, prompts, s)
    out["overhead"] = {"single_stream": overhead}
    out["concurrency"] = {}
    for n in s.concurrency:
        out["concurrency"][str(n)], out["overhead"][f"concurrency_{n}"] = kvserve_concurrent(llm, prompts, s, n)
    out["stats"] = llm.stats()
    return out


def bench_kvserve(dtype: str, s: Settings) -> dict[str, Any]:
    prompts = Prompts(s.seed)
    start = time.perf_counter()
    llm = LLM(model=None, dtype=dtype, max_num_seqs=max(64, *s.concurrency), progress=False)
    out: dict[str, Any] = {"load_s": time.perf_counter() - start}
    try:
        out.update(kvserve_workloads(llm, prompts, s))
    finally:
        llm.close()
    return out


# ----- transformers -----------------------------------------------------------------------------
class _TokenClock:
    """A generate() streamer that records when each new token arrives (the first put is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if self.seen_prompt:
            self.times.append(time.perf_counter())
        self.seen_prompt = True

    def end(self) -> None:
        pass


def hf_generate(model: Any, batch: list[list[int]], new_tokens: int, streamer: _TokenClock | None = None) -> int:
    """Greedy generate of exactly `new_tokens` for a left-padded batch; returns the generated token count."""
    width = max(len(p) for p in batch)
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=model.device)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=model.device)
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=attention_mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            streamer=streamer,
        )
    if out.is_cuda:
        torch.cuda.synchronize(out.device)  # the caller times the call
    return (out.shape[1] - width) * len(batch)


def hf_concurrent(model: Any, prompts: Prompts, n: int, new_tokens: int) -> tuple[list[list[int]], int, float, float]:
    """n fresh prompts as one left-padded batch: (batch, generated tokens, wall seconds, TTFT), where
    TTFT is the time of a one-token generate of the whole batch, the same for every request."""
    batch = [prompts.short() for _ in range(n)]
    start = time.perf_counter()
    hf_generate(model, batch, 1)
    ttft = time.perf_counter() - start
    start = time.perf_counter()
    tokens = hf_generate(model, batch, new_tokens)
    wall_s = time.perf_counter() - start
    assert tokens == n * new_tokens, f"expected {n * new_tokens} tokens, got {tokens}"
    return batch, tokens, wall_s, ttft


def bench_transformers(dtype: str, s: Settings) -> dict[str, Any]:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    prompts = Prompts(s.seed)
    gguf = resolve_model(None)
    start = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=TORCH_DTYPES[dtype]
    ).eval()
    out: dict[str, Any] = {"load_s": time.perf_counter() - start}
    hf_generate(model, [prompts.short()], WARMUP_TOKENS)

    runs = []
    for _ in range(s.repeats):
        prompt = prompts.make(s.prompt_len)
        start = time.perf_counter()
        hf_generate(model, [prompt], 1)
        runs.append(time.perf_counter() - start)
    seconds = statistics.median(runs)
    out["prefill"] = {"prompt_tokens": s.prompt_len, "runs_s": runs, "tokens_per_s": s.prompt_len / seconds}

    rates = []
    for _ in range(s.repeats):
        clock = _TokenClock()
        hf_generate(model, [prompts.short()], s.max_tokens, clock)
        assert len(clock.times) == s.max_tokens, f"expected {s.max_tokens} tokens, got {len(clock.times)}"
        rates.append(decode_rate(clock.times))
    out["decode"] = {"new_tokens": s.max_tokens, "runs_tokens_per_s": rates, "tokens_per_s": statistics.median(rates)}

    out["concurrency"] = {}
    for n in s.concurrency:
        batch, tokens, wall_s, ttft = hf_concurrent(model, prompts, n, s.max_tokens)
        out["concurrency"][str(n)] = batch_result(batch, tokens, wall_s, [ttft] * n)
    return out


# ----- comparison and report --------------------------------------------------------------------
def figures(engine: dict[str, Any], s: Settings) -> Iterator[tuple[str, str, float]]:
    """(key, label, value) for every compared figure of one engine's results."""
    yield "prefill_tokens_per_s", f"prefill tok/s ({s.prompt_len}-token prompt)", engine["prefill"]["tokens_per_s"]
    yield "decode_tokens_per_s", "decode tok/s (single stream)", engine["decode"]["tokens_per_s"]
    for n in s.concurrency:
        c = engine["concurrency"][str(n)]
        yield f"aggregate_tokens_per_s@{n}", f"aggregate tok/s @ {n}", c["aggregate_tokens_per_s"]
        yield f"ttft_p50_ms@{n}", f"TTFT p50 ms @ {n}", c["ttft_p50_s"] * 1e3
        yield f"ttft_p99_ms@{n}", f"TTFT p99 ms @ {n}", c["ttft_p99_s"] * 1e3


def ratios(ours: dict[str, Any], theirs: dict[str, Any], s: Settings) -> dict[str, float]:
    """kvserve / transformers for each figure (above 1 is better for tok/s, below 1 for TTFT)."""
    reference = {key: value for key, _, value in figures(theirs, s)}
    return {key: value / reference[key] for key, _, value in figures(ours, s)}


def markdown(dtype: str, result: dict[str, Any], s: Settings) -> str:
    ours, theirs = result["kvserve"], result.get("transformers")
    lines = [
        f"### {dtype}",
        "",
        "| figure | kvserve | transformers | kvserve / transformers |",
        "|---|---:|---:|---:|",
    ]
    reference = {key: value for key, _, value in figures(theirs, s)} if theirs else {}
    for key, label, value in figures(ours, s):
        if key in reference:
            lines.append(f"| {label} | {value:.1f} | {reference[key]:.1f} | {result['ratio'][key]:.2f} |")
        else:
            lines.append(f"| {label} | {value:.1f} | – | – |")
    lines += [
        "",
        "kvserve per-step timings (ms/step):",
        "",
        "| workload | steps | wall | prepare | forward | sample | overhead (wall - forward - sample) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for workload, b in ours["overhead"].items():
        lines.append(
            f"| {workload} | {b['steps']} | {b['wall_ms_per_step']:.2f} | {b['prepare_ms_per_step']:.2f} | "
            f"{b['forward_ms_per_step']:.2f} | {b['sample_ms_per_step']:.2f} | {b['overhead_ms_per_step']:.2f} |"
        )
    return "\n".join(lines)


# ----- CLI --------------------------------------------------------------------------------------
def add_workload_flags(parser: argparse.ArgumentParser, concurrency: str) -> None:
    """The workload flags of this script and compare.py; `concurrency` is the default levels."""
    parser.add_argument(
        "--concurrency", default=concurrency, help=f"comma-separated request counts (default {concurrency})"
    )
    parser.add_argument("--max-tokens", type=int, default=128, help="new tokens per decode request (default 128)")
    parser.add_argument("--prompt-len", type=int, default=512, help="prefill prompt length (default 512)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of the prefill and single-stream figures")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument(
        "--quick", action="store_true", help="smoke test: concurrency 1,4, max-tokens 16, prompt-len 64, one repeat"
    )


def workload_levels(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[int, ...]:
    """Apply --quick to `args` and check the workload flags; the concurrency levels as given."""
    if args.quick:
        args.concurrency, args.max_tokens, args.prompt_len, args.repeats = "1,4", 16, 64, 1
    concurrency = tuple(int(n) for n in args.concurrency.split(","))
    if args.max_tokens < 2 or args.prompt_len < 1 or args.repeats < 1 or min(concurrency) < 1:
        parser.error("--max-tokens must be >= 2; --prompt-len, --repeats and --concurrency >= 1")
    return concurrency


def usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def parse_args(argv: list[str] | None = None) -> tuple[Settings, Path]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "both"], default="both")
    add_workload_flags(parser, "1,4,16,64")
    parser.add_argument("--skip-hf", action="store_true", help="benchmark kvserve only")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON results (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    concurrency = workload_levels(parser, args)
    settings = Settings(
        dtypes=("float32", "bfloat16") if args.dtype == "both" else (args.dtype,),
        concurrency=concurrency,
        max_tokens=args.max_tokens,
        prompt_len=args.prompt_len,
        repeats=args.repeats,
        seed=args.seed,
        skip_hf=args.skip_hf,
        threads=usable_cpus(),
    )
    return settings, args.out


def in_own_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """Run `fn` in a thread that exits afterwards.

    With OpenMP (libgomp), every thread that runs parallel torch code keeps a team of worker
    threads; while more such threads exist than cores, all teams stop spinning between kernels and
    pay a wake-up per kernel. transformers runs in the caller's thread and kvserve in its engine
    thread, so each engine gets its own short-lived thread here and neither slows the other down.
    """
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = fn(*args)
        except BaseException as exc:
            result["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def main(argv: list[str] | None = None) -> None:
    settings, out_path = parse_args(argv)
    torch.set_num_threads(settings.threads)
    report: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(torch.get_num_threads()),
        "model": str(resolve_model(None)),
        "settings": asdict(settings),
        "results": {},
    }
    tables = []
    for dtype in settings.dtypes:
        result: dict[str, Any] = {"kvserve": bench_kvserve(dtype, settings)}
        gc.collect()  # one model in memory at a time
        if not settings.skip_hf:
            result["transformers"] = in_own_thread(bench_transformers, dtype, settings)
            result["ratio"] = ratios(result["kvserve"], result["transformers"], settings)
        report["results"][dtype] = result
        gc.collect()
        tables.append(markdown(dtype, result, settings))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=2) + "\n")
    machine = report["machine"]
    print(f"## Throughput, {machine['processor']}, {machine['torch_num_threads']} threads, torch {machine['torch']}\n")
    print("\n\n".join(tables))
    print(f"\nWrote {out_path}")


if __name__ == "__main__":
    main()
