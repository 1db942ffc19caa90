"""Where a one-row GPU matmul's microseconds go (issue 32): each program's stamps, in a decode step's matmuls.

A one-row 4-bit layer of the 1B shapes took 6-7 us on the H200 for 2.4-3.5 MB of weights that memory
reads in under 1 us, and cuBLAS's bf16 layers 6 us for 8 MB (docs/performance.md, third session): the
4-bit step is held by something each kernel pays beyond its bytes, and a kernel's duration cannot say
what. This replays a CUDA graph of a 1B decode step's matmuls in the engine's order and kernels (per
layer: q/k/v with RoPE and the cache write in its epilogue, o, gate and up with the activation in
its epilogue, down; then the lm_head) while a `timeline.Timeline` records (kvserve/kernels/gpu/
timeline.py), so that every program stamps the GPU's global timer at its entry, after the wait for
the kernel before, after its K loop and at its end. Per launch, in microseconds:

- `gap_before`: from the launch before's last program's end to this one's first program's start;
- `starts_spread`: first to last program start (a grid's programs dispatched in waves, or late);
- `program_p50` / `program_max`: a program's entry to end; `loop_p50` its wait to its K loop's end
  (the weights' loads and their arithmetic), `tail_p50` from there to its end (the stores; a K split's
  count and, for the tile's last, the other splits' sums), `tail_max` the longest;
- `span`: first start to last end.

With programmatic dependent launch (`KVSERVE_PDL=1`, the JSON's `pdl`) a kernel's programs enter while
the one before still runs: then read `waits_spread` and `work_p50` (from the wait) for `starts_spread`
and `program_p50`. Where the global timer ticks coarsely (`timer_step_ns`), `cycles_p50`,
`loop_cycles_p50` and `tail_cycles_p50` time the same in the multiprocessor's cycles.

Kinds: `float` (bf16 weights, kvserve's kernels), `int4-bf16x2` (the 4-bit default: bf16 inputs, the
Q8_0 lm_head with float inputs), `int4-int8` (`--activations int8`; the inputs' int8 form made before
the graph, as the kernel before makes it in the engine), `int4-int8-words` (the same with
`matmul.WORDS_IN_THREADS`, a candidate), `int4-bf16x2-waited` (the 4-bit kernel with each K step's scales and
mins loaded in the step, `matmul.ALIGNED_GROUPS` False: the kernel before 2026-12-05), `float-normed` and `int4-bf16x2-normed` (the norms before q/k/v and
gate/up in those matmuls' prologues, `NormedRows`: their `loop_p50` holds the prologue). `graph_us` is the graph's replay time without the stamps and
`graph_us_recorded` with them (the stamps' own cost: a reduction a program after its loop).

    PYTHONPATH=. python bench/gpu_timeline.py --out $OUT/timeline.json
    # the plumbing on a CPU (Triton's interpreter, tiny shapes, no graph, every stamp 0):
    PYTHONPATH=. TRITON_INTERPRET=1 python bench/gpu_timeline.py --device cpu --shapes tiny --layers 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from functools import partial
from pathlib import Path

import torch

from bench import gpu_kernels

# (N, K) of each matmul of a decoder layer and the lm_head's (gpu_kernels.py's), and its q/k/v heads
SHAPES = {
    "llama1b": gpu_kernels.SHAPES["llama1b"],
    # K of whole splits, for every kernel of the 1B shapes (the interpreter's plumbing run)
    "tiny": {"qkv": (128, 256), "o": (256, 256), "gate_up": (256, 256), "down": (256, 512), "lm_head": (96, 256)},
}
HEADS = gpu_kernels.HEADS
# `-normed`: the norms before q/k/v and gate/up in those matmuls' prologues (`NormedRows`, layers/gpu.FUSE_NORMS)
KINDS = (
    "float", "int4-bf16x2", "int4-bf16x2-waited", "int4-int8", "int4-int8-words", "float-normed", "int4-bf16x2-normed"
)  # fmt: skip
WORDS_IN_THREADS = 1024  # int4-int8-words: matmul.WORDS_IN_THREADS, a candidate (as bench/gpu.py's q4-int8-words)


def step_calls(kind: str, shape: str, layers: int, rows: int, device: str, gen: torch.Generator):
    """The matmul calls of one decode step of `rows` rows, in order, each labelled with its layer."""
    from kvserve.kernels.gpu import matmul as mm
    from kvserve.kernels.gpu import norm

    normed, kind = kind.endswith("-normed"), kind.removesuffix("-normed").removesuffix("-waited")
    heads, kv_heads, head_dim = HEADS[shape]
    cos, sin = torch.randn(2, rows, 1, head_dim, device=device, generator=gen).to(torch.bfloat16)
    caches = torch.zeros(2, (rows + 15) // 16, 16, kv_heads, head_dim, dtype=torch.bfloat16, device=device)
    rope = mm.RopeStore(cos, sin, caches[0], caches[1], torch.arange(rows, dtype=torch.int32, device=device), heads)
    calls = []
    for layer in range(layers + 1):
        for name, (n, k) in SHAPES[shape].items():
            if (name == "lm_head") != (layer == layers):
                continue
            x = torch.randn(rows, k, device=device, generator=gen).to(torch.bfloat16)
            if normed and name in ("qkv", "gate_up"):  # x + delta, normalized in the matmul's prologue
                delta = torch.randn(rows, k, device=device, generator=gen).to(torch.bfloat16)
                weight = (torch.rand(k, device=device, generator=gen) + 0.5).to(torch.bfloat16)
                x = norm.normed_rows(x, delta, weight, 1e-5)[1]
            counters = mm.split_counters(device)
            out_dtype = torch.float32 if name == "lm_head" else None
            int8_inputs = kind.startswith("int4-int8")
            act = "silu" if name == "gate_up" and not int8_inputs else None  # int8 inputs: the activation's kernel
            epilogue = {"rope": rope} if name == "qkv" else {}
            if int8_inputs:  # made by the kernel before, as in the engine (not a launch of the matmul's own)
                epilogue["quantized"] = mm.quantize_int8(x)
            if kind == "float":
                w = torch.randn(n, k, device=device, generator=gen).to(torch.bfloat16)
                call = partial(mm.matmul, x, w, None, out_dtype, counters, act, **epilogue)
            elif name == "lm_head":  # the 4-bit GGUF's Q8_0 embedding
                codes = torch.randint(-128, 128, (n, k), device=device, generator=gen, dtype=torch.int8)
                scales = torch.rand(n, k // 32, device=device, generator=gen) * 0.01
                if int8_inputs:
                    call = partial(mm.int8_int8_matmul, x, codes, scales, torch.float32, counters=counters, **epilogue)
                else:
                    call = partial(mm.int8_group_matmul, x, codes, scales, torch.float32, counters=counters)
            else:
                packed = mm.pack_int4(torch.randint(0, 16, (n, k), device=device, generator=gen))
                scales = torch.rand(n, k // 32, device=device, generator=gen).to(torch.bfloat16)
                mins = -8 * scales
                if int8_inputs:  # scales as stored (float16)
                    call = partial(
                        mm.int4_int8_matmul, x, packed, scales.half(), mins.half(), counters=counters, **epilogue
                    )
                else:
                    call = partial(mm.int4_matmul, x, packed, scales, mins, None, None, True, counters, act, **epilogue)
            calls.append((f"{name}" if name == "lm_head" else f"{name}.{layer}", call))
    return calls


def run_all(calls, recorder=None) -> None:
    """Each call once, in order; with a recording `recorder`, each labelled with its layer."""
    for label, call in calls:
        if recorder is not None:
            recorder.label = label
        call()


def us(ns: float) -> float:
    return round(ns / 1000, 3)


def summarize(recorder) -> list[dict]:
    """Per launch, its programs' times in microseconds (see the module's docstring)."""
    from kvserve.kernels.gpu import timeline

    records, previous_end = [], None
    for launch in recorder.launches:
        stamps = recorder.stamps(launch)
        entry, waited, looped, done = (stamps[:, slot].double() for slot in range(4))
        clock = [stamps[:, timeline.CLOCKS.value + slot].double() for slot in range(4)]
        program = done - entry
        tail = done - looped
        record = {
            "label": launch.label,
            "kernel": launch.kernel,
            "grid": list(launch.grid),
            "programs": launch.programs,
            "sms": int(stamps[:, timeline.SM.value].unique().numel()),
            "gap_before": None if previous_end is None else us(entry.min().item() - previous_end),
            "starts_spread": us(entry.max().item() - entry.min().item()),
            "waits_spread": us(waited.max().item() - waited.min().item()),  # with PDL: after the kernel before
            "program_p50": us(program.median().item()),
            "program_max": us(program.max().item()),
            "work_p50": us((done - waited).median().item()),  # without the wait (PDL)
            "loop_p50": us((looped - waited).median().item()),
            "tail_p50": us(tail.median().item()),
            "tail_max": us(tail.max().item()),
            "span": us(done.max().item() - entry.min().item()),
            # the same in the multiprocessor's cycles (where the global timer ticks coarsely)
            "cycles_p50": int((clock[3] - clock[0]).median().item()),
            "loop_cycles_p50": int((clock[2] - clock[1]).median().item()),
            "tail_cycles_p50": int((clock[3] - clock[2]).median().item()),
        }
        previous_end = done.max().item()
        records.append(record)
    return records


def per_layer(launches: list[dict]) -> dict:
    """Each decoder layer's matmul (its name before the dot) and the lm_head: the medians over layers."""
    names: dict[str, list[dict]] = {}
    for launch in launches:
        names.setdefault(f"{launch['label'].split('.')[0]} {launch['kernel']}", []).append(launch)
    fields = (
        "gap_before", "starts_spread", "waits_spread", "program_p50", "program_max", "work_p50", "loop_p50",
        "tail_p50", "tail_max", "span", "cycles_p50", "loop_cycles_p50", "tail_cycles_p50",
    )  # fmt: skip
    return {
        name: {
            "launches": len(group),
            "programs": group[0]["programs"],
            "sms": group[0]["sms"],
            **{
                f: round(statistics.median(x[f] for x in group if x[f] is not None), 3)
                for f in fields
                if any(x[f] is not None for x in group)
            },
        }
        for name, group in names.items()
    }


def timer_step_ns(stamps: torch.Tensor) -> int | None:
    """The global timer's smallest step seen in `stamps` (its resolution, where it is coarser than the
    programs)."""
    times = stamps[:, :4].flatten().unique()
    steps = times[1:] - times[:-1]
    steps = steps[steps > 0]
    return int(steps.min().item()) if steps.numel() else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shapes", default="llama1b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=16, help="decoder layers in the step")
    parser.add_argument("--rows", default="1,16", help="comma-separated rows (decode streams) per step")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    parser.add_argument("--out", type=Path, default=Path("bench/results/gpu_timeline.json"))
    args = parser.parse_args()

    import kvserve.kernels.gpu as gpu
    from kvserve.kernels.gpu import matmul, timeline

    started = time.perf_counter()
    gen = torch.Generator(device=args.device).manual_seed(0)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu (Triton's interpreter)",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "commit": commit,
        "shapes": args.shapes,
        "layers": args.layers,
        # programmatic dependent launch (KVSERVE_PDL): programs then enter before the kernel before ends
        "pdl": gpu.uses_pdl(torch.device(args.device)),
        "weight_prefetch": gpu.uses_pdl(torch.device(args.device)) and gpu.PREFETCH,
        "runs": [],
        "errors": [],
    }
    for kind in args.kinds.split(","):
        for rows in (int(r) for r in args.rows.split(",")):
            matmul.WORDS_IN_THREADS = WORDS_IN_THREADS if kind.endswith("-words") else 0
            matmul.ALIGNED_GROUPS = not kind.endswith("-waited")
            try:
                calls = step_calls(kind, args.shapes, args.layers, rows, args.device, gen)
                with timeline.recording(timeline.Timeline(args.device)) as warm:  # compiles the stamped kernels
                    run_all(calls, warm)
                run = {"kind": kind, "rows": rows}
                recorder = timeline.Timeline(args.device)
                if args.device == "cuda":
                    run["graph_us"] = round(gpu_kernels.timed(partial(run_all, calls), args.device) * 1e6, 2)
                    with timeline.recording(recorder):
                        recorded = partial(run_all, calls, recorder)  # its slices taken once, by the capture
                        run["graph_us_recorded"] = round(gpu_kernels.timed(recorded, args.device, warm=False) * 1e6, 2)
                else:
                    with timeline.recording(recorder):
                        run_all(calls, recorder)
                launches = summarize(recorder)
                stamps = recorder.buffer[: sum(launch.programs for launch in recorder.launches)].cpu()
                # the first program's start to the last one's end
                run["recorded_step_us"] = us(stamps[:, 3].max().item() - stamps[:, 0].min().item())
                run["timer_step_ns"] = timer_step_ns(stamps)
                run["gaps_us"] = round(sum(x["gap_before"] or 0 for x in launches), 2)
                run["spans_us"] = round(sum(x["span"] for x in launches), 2)
                run["layers"] = per_layer(launches)
                run["launches"] = launches
                result["runs"].append(run)
                print(json.dumps({k: v for k, v in run.items() if k != "launches"}), flush=True)
            except Exception as e:  # a kind that fails is a finding; the others still run
                result["errors"].append(f"{kind} rows={rows}: {e!r}"[:500])
                print(result["errors"][-1], flush=True)
    result["seconds"] = round(time.perf_counter() - started, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out} in {result['seconds']} s")


if __name__ == "__main__":
    main()
