"""Where a GPU decode step's time goes (issue 32): kvserve on bench/gpu.py's random-weight models,
profiled with torch.profiler over a few decode steps at 1 and 64 streams. Prints, per case, the wall
time per step, the GPU's busy time per step (the sum of its kernels), the kernels per step, and the
kernels that take the most time; writes the same as JSON. Busy time well under the wall time means
the step waits on the host (Python, the scheduler, the sampler's copy back), not on the GPU.

    python bench/gpu.py --prepare          # here, once: the tokenizer the models are built with
    PYTHONPATH=. python bench/gpu_profile.py --out $OUT/profile.json      # on the GPU machine
    # the plumbing on a CPU (no kernels to see there):
    KVSERVE_KERNELS=triton TRITON_INTERPRET=1 python bench/gpu_profile.py --device cpu --shapes tiny --tokens 2
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="llama1b,smol135m")
    parser.add_argument("--tokens", type=int, default=24, help="decode steps profiled per case")
    parser.add_argument("--device", default="cuda", help="cpu: the plumbing, with KVSERVE_KERNELS=triton")
    parser.add_argument("--out", type=Path, default=Path("bench/results/gpu_profile.json"))
    args = parser.parse_args()
    os.environ.setdefault("KVSERVE_HOME", tempfile.mkdtemp(prefix="kvserve-home-"))
    os.environ.setdefault("KVSERVE_FUSED_DECODE", "0")
    from bench.gpu import build_models
    from kvserve import LLM

    work = Path(tempfile.mkdtemp(prefix="kvserve-profile-"))
    models = build_models(args.shapes.split(","), args.device, work, with_q4=False)
    cases = []
    for shape in args.shapes.split(","):
        for graphs in (True, False):
            with LLM(
                str(models[shape]["bf16"]),
                device=args.device,
                max_num_seqs=64,
                progress=False,
                session_db=False,
                cuda_graphs=graphs,
            ) as llm:
                for streams in (1, 64) if graphs else (1,):
                    name = f"{shape}-{streams}-{'graphs' if graphs else 'eager'}"
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
            args.out.write_text(json.dumps({"cases": cases}, indent=1) + "\n")


if __name__ == "__main__":
    main()
