"""Where a GPU decode step's time goes (issue 32): kvserve on bench/gpu.py's random-weight models,
profiled with torch.profiler over a few decode steps at 1 and 64 streams (bf16; the first shape's 4-bit
GGUF too, with float and with int8 inputs, `--profiled`). Prints, per case, the wall
time per step, the GPU's busy time per step (the sum of its kernels), the kernels per step, and the
kernels that take the most time; writes the same as JSON. Busy time well under the wall time means
the step waits on the host (Python, the scheduler, the sampler's copy back), not on the GPU.

Then, without the profiler (whose tracing slows the host), `host` cases: 1 and 64 streams of each
shape in bfloat16 (and 4 bits), each engine phase timed by the wall clock per decode step (schedule, the
runner's sampling rows, the graph's fill, copy and replay call, the sampler's launch, its wait for the
GPU and copy back, the scheduler's and the outputs' update), beside the decode graph's own GPU time
(replayed alone between CUDA events: its kernels and the gaps between them). Wall minus graph is the
host's share. They run with async scheduling (the default on a GPU: the host's work of step n under
the GPU's step n+1), and the first shape's bfloat16 also without it, with 64 streams of seeded
draws at temperature 1 (the sampler's pick kernel), and with 64 conversations of 2,000 tokens (the
host's work per step should not grow with them; bench/host_context.py times it without a model),
and the first shape's weights (and 4 bits with int8 inputs) with programmatic dependent launch
(KVSERVE_PDL=1, on a Hopper GPU) and with the matmuls' weights prefetched into L2 before its wait too
(KVSERVE_PDL=prefetch): the graph's own time against without them.
(At 64 streams a 1B step took 3.3 ms in gpu.py's run against 1.4 ms of kernels under the profiler.)

    python bench/gpu.py --prepare          # here, once: the tokenizer the models are built with
    PYTHONPATH=. python bench/gpu_profile.py --out $OUT/profile.json      # on the GPU machine
    # the plumbing on a CPU (no kernels to see there):
    KVSERVE_KERNELS=triton TRITON_INTERPRET=1 python bench/gpu_profile.py --device cpu --shapes tiny --tokens 2
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


LONG_PROMPT = 2000  # the host cases' long conversations, in tokens


def profile_case(llm, streams: int, tokens: int, trace_dir: Path, name: str) -> dict:
    import torch

    from bench.gpu import prompts
    from kvserve import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    batch = prompts(streams, seed=11)
    llm.generate(batch, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm
    before = llm.runner_timings()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        llm.generate(batch, params)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    after = llm.runner_timings()
    trace = trace_dir / f"{name}.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    steps = after["steps"] - before["steps"]
    per_name: dict[str, list[float]] = collections.defaultdict(list)
    for e in kernels:
        per_name[e["name"][:90]].append(e["dur"])
    busy = sum(e["dur"] for e in kernels)
    top = sorted(per_name.items(), key=lambda kv: -sum(kv[1]))[:25]
    return {
        "case": name,
        "streams": streams,
        "steps": steps,
        "graph_steps": after["graph_steps"] - before["graph_steps"],
        "wall_ms_per_step": round(wall * 1000 / steps, 3),
        "gpu_busy_ms_per_step": round(busy / 1000 / steps, 3),
        "kernels_per_step": round(len(kernels) / steps, 1),
        "runner_s": {k: round(after[k] - before[k], 4) for k in ("prepare_s", "forward_s", "sample_s")},
        "top_kernels": [
            {"name": k, "us_per_step": round(sum(v) / steps, 2), "calls_per_step": round(len(v) / steps, 2)}
            for k, v in top
        ],
    }


def host_case(
    llm, streams: int, tokens: int, name: str, temperature: float = 0.0, prompt_tokens: int | None = None
) -> dict:
    """Per decode step, ms: the wall time, each phase's wall time on the engine thread, and the graph of
    the streams' bucket replayed alone on the GPU. Greedy, or seeded draws at `temperature`; prompts of
    `prompt_tokens` (default gpu.py's), the measured run's served from the prefix cache but its last
    block."""

    from bench.gpu import PROMPT_TOKENS, graph_gpu_ms, prompts
    from kvserve import SamplingParams

    spent: dict[str, float] = getattr(llm.engine, "_spent", collections.defaultdict(float))  # one per engine

    def wrap(owner, attribute, key: str) -> None:
        inner = owner[attribute] if isinstance(owner, dict) else getattr(owner, attribute)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - start

        if isinstance(owner, dict):
            owner[attribute] = timed
        else:
            setattr(owner, attribute, timed)

    def install() -> None:
        engine = llm.engine
        if getattr(engine, "_spent", None) is spent:  # a second case on the same engine: wrapped once
            return
        engine._spent = spent
        runner = engine.runner
        wrap(engine.scheduler, "schedule", "schedule")
        wrap(engine.scheduler, "update_from_output", "update_from_output")
        wrap(engine, "_step_done", "step_done (update, detokenize, deliver)")
        wrap(runner, "execute", "execute")
        wrap(runner, "_sampling_rows", "execute: sampling rows")
        wrap(runner, "_launch_sample", "execute: sampler launch")
        wrap(runner, "_output", "sampler: wait for the GPU, copy back")
        if runner.graphs is not None:
            wrap(runner.graphs, "run", "execute: graph run (fill, copy, replay call)")
            for batch in list(runner.graphs._replays):
                wrap(runner.graphs._replays, batch, "execute: graph replay call")

    params = SamplingParams(max_tokens=tokens, temperature=temperature, seed=7, ignore_eos=True)
    batch = prompts(streams, seed=12 + streams, length=prompt_tokens or PROMPT_TOKENS)
    llm.generate(batch, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm
    llm.engine.call(install)
    spent.clear()
    before = llm.runner_timings()
    start = time.perf_counter()
    llm.generate(batch, params)
    wall = time.perf_counter() - start
    steps = llm.runner_timings()["steps"] - before["steps"]
    result = {"case": name, "streams": streams, "steps": steps, "wall_ms_per_step": round(wall * 1000 / steps, 4)}
    result["prompt_tokens"] = len(batch[0])
    result["phases_ms_per_step"] = {k: round(v * 1000 / steps, 4) for k, v in sorted(spent.items())}
    graph_ms = graph_gpu_ms(llm, [streams], replays=50)  # the bucket's graph alone, on whatever its buffers hold
    if streams in graph_ms:
        result["graph_gpu_ms"] = graph_ms[streams]
    return result


@contextlib.contextmanager
def recorded(errors: list, name: str):
    """One engine's failure is a finding: recorded with its traceback, and the other cases still run."""
    try:
        yield
    except Exception as e:
        errors.append({"case": name, "error": repr(e), "traceback": traceback.format_exc()[-3000:]})
        print(f"{name} failed: {e!r}", file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="llama1b,smol135m")
    parser.add_argument("--tokens", type=int, default=24, help="decode steps profiled per case")
    parser.add_argument("--device", default="cuda", help="cpu: the plumbing, with KVSERVE_KERNELS=triton")
    parser.add_argument("--out", type=Path, default=Path("bench/results/gpu_profile.json"))
    parser.add_argument("--no-host", dest="host", action="store_false", help="skip the host-phase cases")
    parser.add_argument("--host-only", action="store_true", help="only the host-phase cases")
    parser.add_argument(
        "--profiled",
        default="q4,q4-int8",
        help="the first shape's profiled cases besides bf16 (which every shape gets): q4, the 4-bit GGUF;"
        " q4-int8, the same with int8 inputs",
    )
    args = parser.parse_args()
    os.environ.setdefault("KVSERVE_HOME", tempfile.mkdtemp(prefix="kvserve-home-"))
    os.environ.setdefault("KVSERVE_FUSED_DECODE", "0")
    import torch

    import kvserve.kernels.gpu
    from bench.gpu import build_models
    from kvserve import LLM
    from kvserve.kernels.gpu import supports_pdl, uses_pdl

    work = Path(tempfile.mkdtemp(prefix="kvserve-profile-"))
    profiled = [w for w in args.profiled.split(",") if w]  # "" for bf16 alone
    if not set(profiled) <= {"q4", "q4-int8"}:
        parser.error(f"--profiled takes q4 and q4-int8, got {args.profiled!r}")
    with_q4 = args.host or (not args.host_only and any(w.startswith("q4") for w in profiled))
    models = build_models(args.shapes.split(","), args.device, work, with_q4=with_q4)
    cases = []
    host = []
    errors: list[dict] = []
    for shape in args.shapes.split(",") if args.host else []:
        # async scheduling (the default on a GPU), and the first shape's bf16 without it: what it hides;
        # then its weights (and 4 bits with int8 inputs) with programmatic dependent launch (KVSERVE_PDL=1),
        # and with the weights prefetched before its wait (=prefetch): what they take off the graph
        first = shape == args.shapes.split(",")[0]
        weights_of = [(w, "auto") for w in models[shape]] + (
            [("q4", "int8")] if first and "q4" in models[shape] else []
        )
        runs = [(weights, activations, None, "") for weights, activations in weights_of]
        runs += [("bf16", "auto", False, "")] if first else []
        if first and supports_pdl(torch.device(args.device)):
            runs += [(w, a, None, pdl) for pdl in ("pdl", "pdl-prefetch") for w, a in weights_of]
        for weights, activations, ahead, pdl in runs:
            long_case = weights == "bf16" and ahead is None and first and not pdl
            kvserve.kernels.gpu.PDL = bool(pdl)  # read at each launch: the graphs captured at start keep it
            kvserve.kernels.gpu.PREFETCH = pdl == "pdl-prefetch"
            named = weights + ("-int8" if activations == "int8" else "")
            with (
                recorded(errors, f"{shape}-{named}" + ("-sync" if ahead is False else "") + (f"-{pdl}" if pdl else "")),
                LLM(
                    str(models[shape][weights]),
                    device=args.device,
                    activations=activations,
                    max_num_seqs=64,
                    progress=False,
                    session_db=False,
                    async_scheduling=ahead,
                    # room for 64 long conversations at once (no preemption), where the long case runs
                    kv_cache_tokens=64 * (LONG_PROMPT + args.tokens * 4 + 64) if long_case else None,
                ) as llm,
            ):
                suffix = ("" if llm.weights["async_scheduling"] else "-sync") + (
                    f"-{pdl}" if uses_pdl(llm.device) else ""
                )
                for streams in (1, 64):
                    host.append(host_case(llm, streams, args.tokens * 4, f"{shape}-{named}{suffix}-{streams}"))
                    print(json.dumps(host[-1]), flush=True)
                if long_case:
                    # seeded draws at temperature 1 (the OpenAI API's default): the sampler's pick kernel
                    name = f"{shape}-{named}{suffix}-64-sampled"
                    host.append(host_case(llm, 64, args.tokens * 4, name, temperature=1.0))
                    print(json.dumps(host[-1]), flush=True)
                    # conversations of 2,000 tokens: the host's work per step should not grow with them
                    name = f"{shape}-{named}{suffix}-64-long{LONG_PROMPT}"
                    host.append(host_case(llm, 64, args.tokens * 4, name, prompt_tokens=LONG_PROMPT))
                    print(json.dumps(host[-1]), flush=True)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"cases": cases, "host": host, "errors": errors}, indent=1) + "\n")
    kvserve.kernels.gpu.PDL = kvserve.kernels.gpu.PREFETCH = False  # the profiled cases without them
    for shape in [] if args.host_only else args.shapes.split(","):
        # the first shape's 4-bit steps kernel by kernel too (graphs only): where its time goes
        first = shape == args.shapes.split(",")[0]
        forms = [(w, True) for w in profiled if first]
        if forms and "q4" not in models[shape]:  # bench/gpu.py writes no 4-bit GGUF of SmolLM2's shapes
            errors.append({"case": f"{shape}-q4", "error": f"no 4-bit model of the {shape} shapes"})
            forms = []
        for weights, graphs in [("bf16", True), ("bf16", False), *forms]:  # bf16 always
            named = "" if weights == "bf16" else f"-{weights}"
            with (
                recorded(errors, f"{shape}{named}-{'graphs' if graphs else 'eager'}"),
                LLM(
                    str(models[shape][weights.partition("-")[0]]),
                    device=args.device,
                    activations="int8" if weights.endswith("-int8") else "auto",
                    max_num_seqs=64,
                    progress=False,
                    session_db=False,
                    cuda_graphs=graphs,
                ) as llm,
            ):
                for streams in (1, 64) if graphs else (1,):
                    name = f"{shape}{named}-{streams}-{'graphs' if graphs else 'eager'}"
                    cases.append(profile_case(llm, streams, args.tokens, work, name))
                    c = cases[-1]
                    print(
                        f"{name:28} wall {c['wall_ms_per_step']:7.3f} ms/step, GPU busy {c['gpu_busy_ms_per_step']:7.3f},"
                        f" {c['kernels_per_step']:6.1f} kernels/step, runner {c['runner_s']}",
                        flush=True,
                    )
                    for k in c["top_kernels"][:12]:
                        print(f"    {k['us_per_step']:9.2f} us x{k['calls_per_step']:6.2f}  {k['name']}", flush=True)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"cases": cases, "host": host, "errors": errors}, indent=1) + "\n")


if __name__ == "__main__":
    main()
