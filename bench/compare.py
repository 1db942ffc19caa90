"""Engine comparison: kvserve against transformers, llama.cpp and (optionally) vLLM on the bundled GGUF.

Every engine loads the same GGUF file (--model: the bundled SmolLM2 unless told), in one run, one engine's model in
memory at a time, each in a thread of its own (see `in_own_thread` in throughput.py). Per engine:
  1. prefill tokens/s: --prompt-len tokens / the time of a one-token generate; median of --repeats;
  2. single-stream decode tokens/s: (tokens - 1) / (first token -> last token) of a --max-tokens
     generate from a 16-32 token prompt; median of --repeats;
  3. per --concurrency level n: n requests of --max-tokens each, EOS ignored, released together;
     aggregate tokens/s = all generated tokens / (release -> last token), and time to first token
     (release -> a request's first token) p50/p99;
  4. ready after start: seconds from constructing the engine to its first generated token (the
     load, plus the first forward pass of a short prompt);
  5. resident memory: growth of the process's VmRSS from before construction to that first token,
     minus the engine's KV pool ("weights RSS"), against the GGUF file's size. kvserve's pool is
     sized for the workload (largest level x (32 + --max-tokens) tokens, or the prefill prompt,
     rounded up to a power of two: 16384 by default); llama.cpp's is n_ctx f16 cells.
Before those runs a throwaway kvserve engine starts in the fresh process and is closed: it takes the
process's one-time costs (torch's lazily loaded libraries and kernels, some 300 MB of RSS here), which
would otherwise be charged to whichever engine came first. Its figures are reported as the cold start.
kvserve runs once per --kvserve-weights value (LLM's `weights` keyword; "+int8" adds
activations="int8", "+float" activations="float" (the default, "auto", is int8 on an AVX2 CPU), "+f16kv" kv_cache_dtype="float16", "+bioff" batch_invariant=False, e.g.
auto+int8+f16kv) with one thread per
streaming request; its per-step timings (ModelRunner) and `llm.stats()` are recorded too.

How each peer is measured:
  transformers: AutoModelForCausalLM.from_pretrained(gguf_file=..., dtype=--dtype), greedy generate;
    the concurrent columns are one left-padded batch, and its TTFT is the time of a one-token
    generate of that whole batch (the same for every request);
  llama.cpp (llama-cpp-python, in-process): the low-level loop, reset(); eval(prompt); then
    sample(temp=0) and eval([token]) per token, so EOS is never looked at; prefill is eval(prompt)
    plus the first sample. There is no batching in-process: concurrency 1 is one stream, higher
    levels are not measured (llama.cpp's server with slots is that peer);
  vLLM (only where `vllm` imports, the CPU build): offline LLM.generate on token ids, prefix caching
    off; without streaming, decode is (tokens - 1) / (T(max-tokens) - T(1 token)) on the same prompt,
    and TTFT is the time of a one-token generate of the whole batch, as for transformers.
An engine whose package does not import is recorded as {"skipped": reason}; one that fails as
{"error": ...} (the script then exits 1, after writing its outputs).

Prompts are random token ids from a fixed seed, every engine drawing the same prompts in the same
order, distinct per request, so no prefix cache hits. Writes JSON (--out), a PNG (--plot) and prints
Markdown tables with kvserve / peer ratios (above 1 is better for tok/s; below 1 for TTFT, ready
and memory). Smoke test: `python bench/compare.py --quick`.

`--device cuda` runs kvserve and transformers on the GPU (kvserve's `auto` weights are bf16 there) and
skips llama.cpp and vLLM, whose installed builds are CPU peers; the memory columns stay host RSS, and
each engine's record adds the GPU memory it holds after its first token (`cuda_allocated_bytes`).
"""

from __future__ import annotations

# kvserve first: importing it sets its GOMP_SPINCOUNT default, which only counts before torch loads libgomp.
import kvserve  # isort: skip  # noqa: F401
import argparse
import contextlib
import ctypes
import ctypes.util
import datetime
import gc
import importlib
import inspect
import json
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import throughput
import torch
from throughput import (
    SHORT_PROMPT,
    TORCH_DTYPES,
    WARMUP_TOKENS,
    Prompts,
    _TokenClock,
    add_workload_flags,
    batch_result,
    decode_rate,
    hf_concurrent,
    hf_generate,
    in_own_thread,
    kvserve_workloads,
    machine_info,
    stream_times,
    usable_cpus,
    workload_levels,
)

from kvserve import LLM, SamplingParams
from kvserve.engine.kv_cache import kv_cache_bytes_per_token
from kvserve.kernels import build
from kvserve.llm import default_dtype
from kvserve.weights.loader import load_config
from kvserve.weights.registry import DEFAULT_MODEL, REGISTRY, resolve_model

RESULTS = Path(__file__).parent / "results"
DEFAULT_OUT = RESULTS / "compare.json"
DEFAULT_PLOT = RESULTS / "compare.png"
MB = 1e6
LLAMACPP_CONCURRENT_NOTE = "not measured in-process (llama.cpp's server with slots is the peer; see issue table)"
FLOAT_WEIGHTS = {"bf16": "bfloat16", "f32": "float32"}  # LLM(weights=...) values that fix the compute dtype
VLLM_KV_SPACE_GIB = "1"  # VLLM_CPU_KVCACHE_SPACE unless set
# Options after a --kvserve-weights value, each "+tag": LLM keywords
KVSERVE_TAGS = {
    "int8": {"activations": "int8"},
    "float": {"activations": "float"},
    "f16kv": {"kv_cache_dtype": "float16"},
    "bioff": {"batch_invariant": False},
}


@dataclass(frozen=True)
class Settings:
    concurrency: tuple[int, ...]
    max_tokens: int
    prompt_len: int
    repeats: int
    seed: int
    threads: int
    dtype: str  # kvserve's activations and KV pool, transformers' weights
    kvserve_weights: tuple[str, ...]
    kv_cache_tokens: int
    skip_hf: bool
    skip_llamacpp: bool
    skip_vllm: bool
    device: str = "cpu"  # kvserve's and transformers'; llama.cpp and vLLM (CPU builds) run on CPU runs only
    model: str = DEFAULT_MODEL  # a registered name or a .gguf path, loaded by every engine

    def for_throughput(self) -> throughput.Settings:
        """The same workload in throughput.py's settings, for its kvserve helpers."""
        return throughput.Settings(
            dtypes=(self.dtype,),
            concurrency=self.concurrency,
            max_tokens=self.max_tokens,
            prompt_len=self.prompt_len,
            repeats=self.repeats,
            seed=self.seed,
            skip_hf=self.skip_hf,
            threads=self.threads,
        )


# ----- resident memory --------------------------------------------------------------------------
def rss() -> dict[str, int]:
    """This process's resident set from /proc/self/status, in bytes (VmRSS = RssAnon + RssFile + RssShmem)."""
    status = Path("/proc/self/status")
    out: dict[str, int] = {}
    if status.is_file():
        for line in status.read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(value.split()[0]) * 1024  # reported in kB
    return out


def release_freed_memory() -> None:
    """Collect garbage and hand glibc's free heap back to the OS, so the next engine's RSS growth starts clean."""
    gc.collect()
    libc = ctypes.util.find_library("c")
    if libc:
        with contextlib.suppress(OSError, AttributeError):  # AttributeError: not glibc
            ctypes.CDLL(libc).malloc_trim(0)


def memory_report(
    before: dict[str, int], after: dict[str, int], gguf_bytes: int, kv_bytes: int | None
) -> dict[str, Any]:
    """RSS growth over an engine's start, and that growth less its KV pool ("weights RSS"), against the GGUF size.

    `kv_bytes` is the engine's preallocated KV pool (None where it has none: transformers allocates
    its cache per generate). The weights figure still holds whatever else the engine keeps
    resident: activation buffers, a tokenizer, and for llama.cpp the mmapped file's touched pages.
    """
    if "VmRSS" not in before or "VmRSS" not in after:
        return {"unavailable": "no /proc/self/status on this platform"}
    growth = after["VmRSS"] - before["VmRSS"]
    weights = growth - (kv_bytes or 0)
    return {
        "rss_before_bytes": before["VmRSS"],
        "rss_after_bytes": after["VmRSS"],
        "rss_growth_bytes": growth,
        "rss_anon_growth_bytes": after.get("RssAnon", 0) - before.get("RssAnon", 0),
        "rss_file_growth_bytes": after.get("RssFile", 0) - before.get("RssFile", 0),
        "kv_pool_bytes": kv_bytes,
        "weights_rss_bytes": weights,
        "gguf_bytes": gguf_bytes,
        "rss_growth_over_gguf": growth / gguf_bytes,
        "weights_rss_over_gguf": weights / gguf_bytes,
    }


def start_engine(
    construct: Callable[[], Any],
    first_token: Callable[[Any], float],
    kv_bytes: Callable[[Any], int | None],
    s: Settings,
) -> tuple[Any, dict[str, Any]]:
    """Build an engine and wait for its first generated token; time both and measure the RSS it added.

    `first_token(engine)` generates one token and returns its arrival time (time.perf_counter()).
    Returns the engine and {"load_s", "ready_s", "memory"}.
    """
    release_freed_memory()
    before = rss()
    start = time.perf_counter()
    engine = construct()
    loaded = time.perf_counter()
    first = first_token(engine)
    after = rss()
    gguf_bytes = resolve_model(s.model).stat().st_size
    record = {
        "load_s": loaded - start,
        "ready_s": first - start,
        "memory": memory_report(before, after, gguf_bytes, kv_bytes(engine)),
    }
    if torch.cuda.is_initialized():
        record["cuda_allocated_bytes"] = torch.cuda.memory_allocated()
    return engine, record


# ----- shared measuring loops -------------------------------------------------------------------
def timed_prefill(run_one: Callable[[list[int]], Any], prompts: Prompts, s: Settings) -> dict[str, Any]:
    """`run_one(prompt)` generates one token; the median over --repeats fresh prompts."""
    runs = []
    for _ in range(s.repeats):
        prompt = prompts.make(s.prompt_len)
        start = time.perf_counter()
        run_one(prompt)
        runs.append(time.perf_counter() - start)
    return {"prompt_tokens": s.prompt_len, "runs_s": runs, "tokens_per_s": s.prompt_len / statistics.median(runs)}


def timed_decode(token_times: Callable[[list[int]], list[float]], prompts: Prompts, s: Settings) -> dict[str, Any]:
    """`token_times(prompt)` generates --max-tokens and returns each token's arrival time."""
    rates = []
    for _ in range(s.repeats):
        times = token_times(prompts.short())
        assert len(times) == s.max_tokens, f"expected {s.max_tokens} tokens, got {len(times)}"
        rates.append(decode_rate(times))
    return {"new_tokens": s.max_tokens, "runs_tokens_per_s": rates, "tokens_per_s": statistics.median(rates)}


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


# ----- kvserve ----------------------------------------------------------------------------------
def accepts_weights() -> bool:
    return "weights" in inspect.signature(LLM.__init__).parameters


def start_kvserve(weights: str | None, s: Settings, prompts: Prompts) -> tuple[LLM, dict[str, Any]]:
    """A kvserve engine sized for the workload, up to its first token; `weights` is LLM's `weights`
    keyword, None where the installed LLM lacks it, with KVSERVE_TAGS' options after it (e.g.
    "auto+int8+f16kv"). Returns the engine and start_engine's record."""
    weights, *tags = (weights or "").split("+")
    unknown = set(tags) - set(KVSERVE_TAGS)
    if unknown:
        raise SystemExit(
            f"--kvserve-weights: unknown option(s) {', '.join(sorted(unknown))}; known: {', '.join(KVSERVE_TAGS)}"
        )
    kwargs: dict[str, Any] = {
        "model": s.model,
        # Float weights are kept in the compute dtype, and LLM refuses a dtype that disagrees.
        "dtype": FLOAT_WEIGHTS.get(weights, s.dtype),
        "max_num_seqs": max(s.concurrency),
        "kv_cache_tokens": s.kv_cache_tokens,
        "progress": False,
        "session_db": False,
        "device": s.device,
    }
    if weights:
        kwargs["weights"] = weights
    for tag in tags:
        kwargs.update(KVSERVE_TAGS[tag])

    def first_token(llm: LLM) -> float:
        return stream_times(llm, prompts.short(), greedy(1))[1][0]

    def kv_bytes(llm: LLM) -> int:
        kv_dtype = getattr(llm, "kv_cache_dtype", llm.dtype)
        return kv_cache_bytes_per_token(llm.model.config, kv_dtype) * llm.config.kv_cache_tokens

    return start_engine(lambda: LLM(**kwargs), first_token, kv_bytes, s)


def kvserve_cold_start(weights: str | None, s: Settings) -> dict[str, Any]:
    """A throwaway kvserve engine, the first of the process: its ready time and RSS growth include the
    process's one-time costs (torch's lazily loaded libraries and kernels, thread pools), which would
    otherwise be charged to whichever engine comes first. The engines measured after it share a warm process."""
    llm, out = start_kvserve(weights, s, Prompts(s.seed))
    llm.close()
    return out


def weights_by_type(llm: LLM, s: Settings) -> dict[str, Any] | None:
    """Per GGUF tensor type: its bytes in the file and in kvserve's memory once loaded (kvserve/weights/footprint.py)."""
    path = resolve_model(s.model)
    if path.suffix != ".gguf":
        return None
    from kvserve.weights.footprint import footprint
    from kvserve.weights.gguf_file import GGUFFile

    return footprint(llm.model, GGUFFile(path).stored())


def bench_kvserve(weights: str | None, s: Settings) -> dict[str, Any]:
    """One kvserve engine: start, then every workload."""
    prompts = Prompts(s.seed)
    llm, out = start_kvserve(weights, s, prompts)
    try:
        # The fused decode step loads in the background (built on first use, then cached); measure with
        # it in place, as a server is a few seconds after its start.
        out["fused_decode_loaded"] = build.load() is not None
        out["config"] = {
            "weights": weights,
            "dtype": str(llm.dtype),
            "kv_cache_tokens": llm.config.kv_cache_tokens,
            "max_num_seqs": llm.config.max_num_seqs,
            "max_model_len": llm.config.max_model_len,
        }
        out.update(kvserve_workloads(llm, prompts, s.for_throughput()))
        # after the workloads: a layout a layer arranges on its first call (a second copy) counts too
        out["weights_by_type"] = weights_by_type(llm, s)
        out["runner_timings"] = llm.runner_timings()
    finally:
        llm.close()
    return out


# ----- transformers -----------------------------------------------------------------------------
def bench_transformers(s: Settings) -> dict[str, Any]:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    prompts = Prompts(s.seed)
    gguf = resolve_model(s.model)

    def construct() -> Any:
        return (
            transformers.AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=TORCH_DTYPES[s.dtype]
            )
            .eval()
            .to(s.device)
        )

    def first_token(model: Any) -> float:
        clock = _TokenClock()
        hf_generate(model, [prompts.short()], 1, clock)
        return clock.times[0]

    model, out = start_engine(construct, first_token, lambda _: None, s)
    out["config"] = {"transformers": transformers.__version__, "dtype": s.dtype, "device": s.device}
    hf_generate(model, [prompts.short()], WARMUP_TOKENS)
    out["prefill"] = timed_prefill(lambda p: hf_generate(model, [p], 1), prompts, s)

    def token_times(prompt: list[int]) -> list[float]:
        clock = _TokenClock()
        hf_generate(model, [prompt], s.max_tokens, clock)
        return clock.times

    out["decode"] = timed_decode(token_times, prompts, s)
    out["concurrency"] = {}
    for n in s.concurrency:
        batch, tokens, wall_s, ttft = hf_concurrent(model, prompts, n, s.max_tokens)
        out["concurrency"][str(n)] = batch_result(batch, tokens, wall_s, [ttft] * n)
    return out


# ----- llama.cpp --------------------------------------------------------------------------------
def llamacpp_n_ctx(s: Settings) -> int:
    """Context for the longest request (the prefill prompt or a short prompt + max-tokens), in 256s."""
    need = max(s.prompt_len + 1, SHORT_PROMPT[1] + s.max_tokens)
    return 256 * math.ceil(need / 256)


def llamacpp_stream(llm: Any, prompt: list[int], new_tokens: int) -> tuple[float, list[float]]:
    """Greedy decode of exactly `new_tokens` (EOS is never checked); the submit time and each token's arrival.

    reset() drops the previous request's KV (eval() clears the cache past n_tokens), so no prefix is reused.
    """
    llm.reset()
    submitted = time.perf_counter()
    llm.eval(prompt)
    times = []
    for i in range(new_tokens):
        token = llm.sample(temp=0.0, repeat_penalty=1.0)  # temp 0: llama.cpp's greedy sampler
        times.append(time.perf_counter())
        if i + 1 < new_tokens:
            llm.eval([token])
    return submitted, times


def llamacpp_model(s: Settings) -> Any:
    """llama.cpp (llama-cpp-python) on the --model GGUF with --threads threads, sized for the workload."""
    import llama_cpp

    return llama_cpp.Llama(
        model_path=str(resolve_model(s.model)),
        n_threads=s.threads,
        n_threads_batch=s.threads,
        n_ctx=llamacpp_n_ctx(s),
        verbose=False,
    )


def bench_llamacpp(s: Settings) -> dict[str, Any]:
    import llama_cpp

    prompts = Prompts(s.seed)
    gguf = resolve_model(s.model)

    def kv_bytes(llm: Any) -> int:  # llama.cpp's default KV type is f16, one cell per context position
        return kv_cache_bytes_per_token(load_config(gguf), torch.float16) * llm.n_ctx()

    llm, out = start_engine(
        lambda: llamacpp_model(s), lambda llm: llamacpp_stream(llm, prompts.short(), 1)[1][0], kv_bytes, s
    )
    try:
        out["config"] = {
            "llama_cpp": llama_cpp.__version__,
            "n_ctx": llm.n_ctx(),
            "n_threads": s.threads,
            "system_info": llama_cpp.llama_print_system_info().decode().strip(),  # its SIMD kernels, OpenMP
        }
        llamacpp_stream(llm, prompts.short(), WARMUP_TOKENS)
        out["prefill"] = timed_prefill(lambda p: llamacpp_stream(llm, p, 1), prompts, s)
        out["decode"] = timed_decode(lambda p: llamacpp_stream(llm, p, s.max_tokens)[1], prompts, s)
        out["concurrency"] = {}
        for n in s.concurrency:
            batch = [prompts.short() for _ in range(n)]  # drawn either way: later engines see the same prompts
            if n > 1:
                out["concurrency"][str(n)] = {"not_measured": LLAMACPP_CONCURRENT_NOTE}
                continue
            submitted, times = llamacpp_stream(llm, batch[0], s.max_tokens)
            out["concurrency"][str(n)] = batch_result(batch, len(times), times[-1] - submitted, [times[0] - submitted])
    finally:
        llm.close()  # frees the model and context now, not at garbage collection
    return out


# ----- vLLM -------------------------------------------------------------------------------------
def vllm_environment() -> None:
    """Before vllm is imported: the engine core in this process (so its memory is this process's RSS),
    and a KV pool sized for a benchmark rather than vLLM's CPU default of 4 GiB. Set values are kept."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", VLLM_KV_SPACE_GIB)


def bench_vllm(s: Settings) -> dict[str, Any]:
    import vllm
    from vllm.inputs import TokensPrompt

    prompts = Prompts(s.seed)
    gguf = resolve_model(s.model)

    def params(n: int) -> Any:
        return vllm.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, detokenize=False)

    def generate(llm: Any, batch: list[list[int]], n: int) -> int:
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params(n), use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outputs)

    def construct() -> Any:
        return vllm.LLM(
            model=str(gguf),
            dtype=s.dtype,
            skip_tokenizer_init=True,
            enable_prefix_caching=False,
            max_num_seqs=max(s.concurrency),
            max_model_len=llamacpp_n_ctx(s),
            seed=s.seed,
        )

    def first_token(llm: Any) -> float:
        generate(llm, [prompts.short()], 1)
        return time.perf_counter()

    kv_bytes = int(float(os.environ["VLLM_CPU_KVCACHE_SPACE"]) * 2**30)
    engine, out = start_engine(construct, first_token, lambda _: kv_bytes, s)
    out["config"] = {
        "vllm": vllm.__version__,
        "VLLM_CPU_KVCACHE_SPACE": os.environ["VLLM_CPU_KVCACHE_SPACE"],
        "decode_method": "(tokens - 1) / (T(max_tokens) - T(1)) on the same prompt, offline generate",
        "ttft_method": "time of a one-token generate of the whole batch",
    }
    generate(engine, [prompts.short()], WARMUP_TOKENS)
    out["prefill"] = timed_prefill(lambda p: generate(engine, [p], 1), prompts, s)
    rates = []
    for _ in range(s.repeats):
        prompt = prompts.short()
        start = time.perf_counter()
        generate(engine, [prompt], 1)
        one = time.perf_counter() - start
        start = time.perf_counter()
        generate(engine, [prompt], s.max_tokens)
        rates.append((s.max_tokens - 1) / (time.perf_counter() - start - one))
    out["decode"] = {"new_tokens": s.max_tokens, "runs_tokens_per_s": rates, "tokens_per_s": statistics.median(rates)}
    out["concurrency"] = {}
    for n in s.concurrency:
        batch = [prompts.short() for _ in range(n)]
        start = time.perf_counter()
        generate(engine, batch, 1)
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        tokens = generate(engine, batch, s.max_tokens)
        out["concurrency"][str(n)] = batch_result(batch, tokens, time.perf_counter() - start, [ttft] * n)
    return out


# ----- running the engines ----------------------------------------------------------------------
def importable(module: str) -> str | None:
    """None where `module` imports, else why not (the skip note)."""
    try:
        importlib.import_module(module)
    except Exception as exc:  # ImportError, or a native library that fails to load
        return f"{module} is not importable: {type(exc).__name__}: {exc}"
    return None


def run_engine(name: str, fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """`fn(*args)` in a thread of its own; a failure is recorded as {"error": ...} rather than raised."""
    print(f"... {name}", file=sys.stderr, flush=True)
    try:
        result = in_own_thread(fn, *args)
    except Exception as exc:
        print(f"{name} failed:\n{traceback.format_exc()}", file=sys.stderr)
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    release_freed_memory()  # one engine's model in memory at a time
    return result


def kvserve_variants(s: Settings) -> tuple[list[str | None], str | None]:
    """The `weights` values to run and a note where the installed LLM has no `weights` keyword."""
    if accepts_weights():
        return list(s.kvserve_weights), None
    note = f"kvserve's LLM has no `weights` keyword yet; ran once without it (asked for {','.join(s.kvserve_weights)})"
    return [None], note


def kvserve_name(weights: str | None) -> str:
    return "kvserve" if weights is None else f"kvserve (weights={weights})"


# ----- figures, ratios and report ---------------------------------------------------------------
def figures(result: dict[str, Any], s: Settings) -> dict[str, float]:
    """The compared figures of one engine (those it has), flat: key -> value."""
    out: dict[str, float] = {}
    if "prefill" in result:
        out["prefill_tokens_per_s"] = result["prefill"]["tokens_per_s"]
    if "decode" in result:
        out["decode_tokens_per_s"] = result["decode"]["tokens_per_s"]
    for n in s.concurrency:
        c = result.get("concurrency", {}).get(str(n), {})
        if "aggregate_tokens_per_s" in c:
            out[f"aggregate_tokens_per_s@{n}"] = c["aggregate_tokens_per_s"]
            out[f"ttft_p50_ms@{n}"] = c["ttft_p50_s"] * 1e3
            out[f"ttft_p99_ms@{n}"] = c["ttft_p99_s"] * 1e3
    if "ready_s" in result:
        out["ready_s"] = result["ready_s"]
    memory = result.get("memory", {})
    if "rss_growth_bytes" in memory:
        out["rss_growth_mb"] = memory["rss_growth_bytes"] / MB
        out["weights_rss_mb"] = memory["weights_rss_bytes"] / MB
    return out


def ratios(engines: dict[str, dict[str, Any]], s: Settings) -> dict[str, dict[str, dict[str, float]]]:
    """kvserve engine -> peer -> figure -> kvserve / peer, for the figures both have."""
    flat = {name: figures(result, s) for name, result in engines.items()}
    out: dict[str, dict[str, dict[str, float]]] = {}
    for ours in (n for n in flat if n.startswith("kvserve")):
        out[ours] = {}
        for peer in (n for n in flat if not n.startswith("kvserve") and flat[n]):
            out[ours][peer] = {key: value / flat[peer][key] for key, value in flat[ours].items() if flat[peer].get(key)}
    return out


def cell(value: float | None, fmt: str = ".1f") -> str:
    return "–" if value is None else format(value, fmt)


def table_levels(s: Settings) -> list[int]:
    """The concurrency levels that get a column of the main table: all above 1 (or 1 alone)."""
    return [n for n in s.concurrency if n > 1] or list(s.concurrency)


def markdown(report: dict[str, Any], s: Settings) -> str:
    engines, levels = report["engines"], table_levels(s)
    header = ["engine", f"prefill tok/s ({s.prompt_len})", "decode tok/s"]
    header += [f"aggregate tok/s @{n} (TTFT p50 / p99 ms)" for n in levels]
    header += ["ready s", "weights RSS MB / GGUF MB"]
    lines = ["| " + " | ".join(header) + " |", "|---" + "|---:" * (len(header) - 1) + "|"]
    gguf_mb = report["model"]["gguf_bytes"] / MB
    notes = []
    for name, result in engines.items():
        if "skipped" in result or "error" in result:
            why = "skipped" if "skipped" in result else "error"
            lines.append(f"| {name} | {why} |" + " |" * (len(header) - 2))
            notes.append(f"- {name}: {result.get('skipped') or result.get('error')}")
            continue
        f = figures(result, s)
        row = [name, cell(f.get("prefill_tokens_per_s")), cell(f.get("decode_tokens_per_s"))]
        for n in levels:
            if f"aggregate_tokens_per_s@{n}" in f:
                p50, p99 = f[f"ttft_p50_ms@{n}"], f[f"ttft_p99_ms@{n}"]
                row.append(f"{f[f'aggregate_tokens_per_s@{n}']:.1f} ({p50:.0f} / {p99:.0f})")
            else:
                row.append("not measured")
        weights = f.get("weights_rss_mb")
        ready = cell(f.get("ready_s"), ".2f")
        if "ready_s" in report.get("cold_start", {}).get(name, {}):
            ready += f" (cold {report['cold_start'][name]['ready_s']:.2f})"
        row += [ready, f"{cell(weights, '.0f')} / {gguf_mb:.0f}"]
        lines.append("| " + " | ".join(row) + " |")
    if notes:
        lines += ["", *notes]

    keys = ["prefill_tokens_per_s", "decode_tokens_per_s"]
    keys += [f"{k}@{n}" for n in levels for k in ("aggregate_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms")]
    keys += ["ready_s", "weights_rss_mb"]
    lines += ["", "kvserve / peer (above 1 is better for tok/s; below 1 for TTFT, ready s and memory):", ""]
    lines += ["| kvserve / peer | " + " | ".join(keys) + " |", "|---" + "|---:" * len(keys) + "|"]
    for ours, peers in report["ratio"].items():
        for peer, r in peers.items():
            lines.append(f"| {ours} / {peer} | " + " | ".join(cell(r.get(k), ".2f") for k in keys) + " |")

    lines += [
        "",
        "Resident memory over start (MB; weights = RSS growth - KV pool):",
        "",
        "| engine | RSS growth | anon | file | KV pool | weights | GGUF | growth / GGUF | weights / GGUF |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, result in engines.items():
        m = result.get("memory", {})
        if "rss_growth_bytes" in m:
            kv = cell(m["kv_pool_bytes"] / MB, ".0f") if m["kv_pool_bytes"] is not None else "none (per generate)"
            lines.append(
                f"| {name} | {m['rss_growth_bytes'] / MB:.0f} | {m['rss_anon_growth_bytes'] / MB:.0f} | "
                f"{m['rss_file_growth_bytes'] / MB:.0f} | {kv} | {m['weights_rss_bytes'] / MB:.0f} | "
                f"{m['gguf_bytes'] / MB:.0f} | {m['rss_growth_over_gguf']:.2f} | {m['weights_rss_over_gguf']:.2f} |"
            )

    for name, result in engines.items():
        if result.get("weights_by_type"):
            lines += ["", f"{name}: weights in memory per GGUF tensor type (kvserve/weights/footprint.py):", ""]
            lines += ["| type | tensors | file MB | memory MB | memory / file |", "|---|---:|---:|---:|---:|"]
            for kind, row in result["weights_by_type"].items():
                lines.append(
                    f"| {kind} | {row['tensors']} | {row['file_bytes'] / MB:.1f} | {row['memory_bytes'] / MB:.1f} | "
                    f"{cell(row['memory_per_file'], '.2f')} |"
                )

    for name, cold in report.get("cold_start", {}).items():
        m, warm = cold.get("memory", {}), engines.get(name, {}).get("memory", {})
        if "rss_growth_bytes" not in m:
            lines += ["", f"Cold start of {name}: {cold.get('error', 'no memory figures')}"]
            continue
        extra = ""
        if "rss_growth_bytes" in warm:
            extra = f", {(m['rss_growth_bytes'] - warm['rss_growth_bytes']) / MB:.0f} MB more than its start above"
        lines += [
            "",
            f"Cold start: {name} as the process's first engine (thrown away before the runs above; its "
            f"figures hold the process's one-time costs): ready {cold['ready_s']:.2f} s, "
            f"RSS growth {m['rss_growth_bytes'] / MB:.0f} MB{extra}.",
        ]

    lines += [
        "",
        "kvserve per-step timings (ms/step):",
        "",
        "| engine | workload | steps | wall | prepare | forward | sample | overhead (wall - forward - sample) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, result in engines.items():
        for workload, b in result.get("overhead", {}).items():
            lines.append(
                f"| {name} | {workload} | {b['steps']} | {b['wall_ms_per_step']:.2f} | "
                f"{b['prepare_ms_per_step']:.2f} | {b['forward_ms_per_step']:.2f} | {b['sample_ms_per_step']:.2f} | "
                f"{b['overhead_ms_per_step']:.2f} |"
            )
    if report["notes"]:
        lines += ["", *(f"- {note}" for note in report["notes"])]
    return "\n".join(lines)


def plot(report: dict[str, Any], s: Settings, path: Path) -> str:
    """Aggregate tok/s and TTFT p50 against concurrency, one line per engine; returns what it did."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib): no plot"
    fig, (agg, ttft) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, result in report["engines"].items():
        f = figures(result, s)
        levels = [n for n in s.concurrency if f"aggregate_tokens_per_s@{n}" in f]
        if not levels:
            continue
        label = name if len(levels) == len(s.concurrency) else f"{name} (only @{','.join(map(str, levels))})"
        agg.plot(levels, [f[f"aggregate_tokens_per_s@{n}"] for n in levels], marker="o", label=label)
        ttft.plot(levels, [f[f"ttft_p50_ms@{n}"] for n in levels], marker="o", label=label)
    machine = report["machine"]
    for ax, title, ylabel in (
        (agg, "aggregate decode throughput", "tokens/s"),
        (ttft, "time to first token, p50", "ms"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(s.concurrency), [str(n) for n in s.concurrency])
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    agg.legend(fontsize="small")
    fig.suptitle(
        f"{Path(report['model']['path']).name}, {s.dtype}, {s.max_tokens} new tokens/request, "
        f"{machine.get('gpu', machine['processor'])} x{machine['torch_num_threads']} threads",
        fontsize="medium",
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"Wrote {path}"


# ----- CLI --------------------------------------------------------------------------------------
def kv_tokens_for(concurrency: tuple[int, ...], max_tokens: int, prompt_len: int) -> int:
    """kvserve's KV pool for the workload: every stream of the largest level at its longest, or the
    prefill prompt, rounded up to a power of two (64 x (32 + 128) -> 16384)."""
    need = max(max(concurrency) * (SHORT_PROMPT[1] + max_tokens), prompt_len + max_tokens)
    return 1 << (need - 1).bit_length()


def parse_args(argv: list[str] | None = None) -> tuple[Settings, Path, Path]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_flags(parser, "1,16,64")
    parser.add_argument(
        "--dtype",
        choices=["auto", *TORCH_DTYPES],
        default="auto",
        help="kvserve's compute/KV dtype and transformers' weights (auto: bfloat16 where the CPU has native bf16)",
    )
    parser.add_argument(
        "--kvserve-weights",
        default="auto",
        help="comma-separated values of LLM(weights=...): auto, q4, q8, bf16, f32, each optionally followed by "
        "+int8 for LLM(activations='int8'), +float for LLM(activations='float'), +f16kv for LLM(kv_cache_dtype='float16') and +bioff for "
        "LLM(batch_invariant=False), e.g. "
        "auto,auto+int8+f16kv; one kvserve run each (default auto)",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="kvserve's and transformers' device, e.g. cuda (default cpu); llama.cpp and vLLM run on cpu runs only",
    )
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"the GGUF every engine loads: a registered name ({', '.join(REGISTRY)}) or a .gguf path "
        f"(default {DEFAULT_MODEL})",
    )
    parser.add_argument("--skip-hf", action="store_true", help="leave out transformers")
    parser.add_argument("--skip-llamacpp", action="store_true", help="leave out llama.cpp")
    parser.add_argument("--skip-vllm", action="store_true", help="leave out vLLM even where it is installed")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON results (default {DEFAULT_OUT})")
    parser.add_argument("--plot", type=Path, default=DEFAULT_PLOT, help=f"PNG plot (default {DEFAULT_PLOT})")
    args = parser.parse_args(argv)
    concurrency = tuple(sorted(set(workload_levels(parser, args))))
    weights = tuple(dict.fromkeys(w.strip() for w in args.kvserve_weights.split(",") if w.strip()))
    if not weights:
        parser.error("--kvserve-weights needs at least one value")
    dtype = args.dtype
    if dtype == "auto":
        dtype = {v: k for k, v in TORCH_DTYPES.items()}[default_dtype(torch.device(args.device))]
    settings = Settings(
        concurrency=concurrency,
        max_tokens=args.max_tokens,
        prompt_len=args.prompt_len,
        repeats=args.repeats,
        seed=args.seed,
        threads=usable_cpus(),
        dtype=dtype,
        kvserve_weights=weights,
        kv_cache_tokens=kv_tokens_for(concurrency, args.max_tokens, args.prompt_len),
        skip_hf=args.skip_hf,
        skip_llamacpp=args.skip_llamacpp,
        skip_vllm=args.skip_vllm,
        device=args.device,
        model=args.model,
    )
    return settings, args.out, args.plot


def main(argv: list[str] | None = None) -> int:
    settings, out_path, plot_path = parse_args(argv)
    torch.set_num_threads(settings.threads)
    gguf = resolve_model(settings.model)
    report: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(torch.get_num_threads(), settings.device),
        "model": {"path": str(gguf), "gguf_bytes": gguf.stat().st_size},
        "settings": asdict(settings),
        "notes": [],
        "engines": {},
    }
    engines = report["engines"]

    variants, note = kvserve_variants(settings)
    if note:
        report["notes"].append(note)
    report["kvserve_weights_keyword"] = note is None
    report["cold_start"] = {
        kvserve_name(variants[0]): run_engine("kvserve cold start", kvserve_cold_start, variants[0], settings)
    }
    for weights in variants:
        engines[kvserve_name(weights)] = run_engine(kvserve_name(weights), bench_kvserve, weights, settings)

    peers = [
        ("transformers", "transformers", bench_transformers, settings.skip_hf, "--skip-hf"),
        ("llama.cpp", "llama_cpp", bench_llamacpp, settings.skip_llamacpp, "--skip-llamacpp"),
        ("vllm", "vllm", bench_vllm, settings.skip_vllm, "--skip-vllm"),
    ]
    if not settings.skip_vllm:
        vllm_environment()
    for name, module, bench, skip, flag in peers:
        if settings.device != "cpu" and name != "transformers":
            engines[name] = {"skipped": f"--device {settings.device}: the installed build is a CPU peer"}
        elif skip:
            engines[name] = {"skipped": f"{flag} given"}
        elif reason := importable(module):
            engines[name] = {"skipped": reason}
        else:
            engines[name] = run_engine(name, bench, settings)

    report["ratio"] = ratios(engines, settings)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    machine = report["machine"]
    print(
        f"## Engines on {gguf.name}, {machine.get('gpu', machine['processor'])}, {machine['torch_num_threads']} threads, "
        f"{settings.dtype}, torch {machine['torch']}\n"
    )
    print(markdown(report, settings))
    print(f"\nWrote {out_path}")
    print(plot(report, settings, plot_path))
    failed = [*engines.values(), *report["cold_start"].values()]
    return 1 if any("error" in r for r in failed) else 0


if __name__ == "__main__":
    sys.exit(main())
