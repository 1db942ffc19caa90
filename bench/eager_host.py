"""The host's share of an eager GPU step, measured on a CPU: one decoder layer of the GPU path (the
Triton kernels' launch code, the layers' Python, torch's allocations and views) run with every kernel
launch a no-op, in Triton's interpreter. What is left is the Python a GPU's host runs before Triton's
own launcher (not measured here: it needs a driver). Eager steps are the prefills and chunks (a
request's time to first token) and every step no decode graph covers; a decode graph replays without
any of it.

A random model in the 1B shapes of bench/gpu.py, two layers of it; a 60-token prefill and a one-token
decode step behind it, each layer call timed alone (rounds of 300 calls, the median round and the
fastest, which the machine's noise touches least), with the launches a layer makes.

    python bench/eager_host.py --out bench/results/eager_host.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ["KVSERVE_KERNELS"] = "triton"
os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPT_TOKENS = 60


def build(folder: Path, shape: str, layers: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from bench.gpu import COMMON, SHAPES
    from tests.conftest import write_byte_tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(**{**COMMON, **SHAPES[shape], "num_hidden_layers": layers})
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
    write_byte_tokenizer(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="llama1b", help="one of bench/gpu.py's SHAPES")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=300, help="layer calls per round")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "eager_host.json")
    args = parser.parse_args()

    import torch
    import triton.runtime.interpreter as interpreter

    launches: collections.Counter = collections.Counter()
    real_run = interpreter.InterpretedFunction.run
    noop = False

    def run(self, *a, **k):
        if not noop:
            return real_run(self, *a, **k)
        launches[self.fn.__name__] += 1
        return None

    interpreter.InterpretedFunction.run = run
    from kvserve import LLM, SamplingParams

    folder = Path(tempfile.mkdtemp(prefix="kvserve-eager-host-"))
    build(folder, args.shapes, layers=2)
    llm = LLM(str(folder), device="cpu", cuda_graphs=False, max_num_seqs=8, progress=False, session_db=False)
    noop = True
    model = llm.engine.runner.model
    steps = []
    run_layers = model.run_layers

    def keep(x, positions, metadata):
        steps.append((x, positions, metadata))
        return run_layers(x, positions, metadata)

    model.run_layers = keep
    llm.generate(list(range(1000, 1000 + PROMPT_TOKENS)), SamplingParams(max_tokens=2, temperature=0))
    model.run_layers = run_layers
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": os.popen(f"git -C {ROOT} describe --always --dirty").read().strip(),
        "shapes": args.shapes,
        "cases": [],
    }
    layer = model.layers[0]
    for name, (x, positions, metadata) in zip(("prefill-60", "decode-1"), steps, strict=True):
        ropes = model.rotary.tables(positions, x.dtype)
        with torch.inference_mode():
            launches.clear()
            layer(ropes, x, metadata, None)
            per_layer = dict(launches)
            for _ in range(50):
                layer(ropes, x, metadata, None)
            rounds = []
            for _ in range(args.rounds):
                start = time.perf_counter()
                for _ in range(args.calls):
                    layer(ropes, x, metadata, None)
                rounds.append((time.perf_counter() - start) / args.calls * 1e6)
        count = sum(per_layer.values())
        case = {
            "case": name,
            "tokens": x.shape[0],
            "us_per_layer_median": round(statistics.median(rounds), 1),
            "us_per_layer_min": round(min(rounds), 1),
            "launches_per_layer": count,
            "us_per_launch_min": round(min(rounds) / count, 1),
            "kernels": per_layer,
        }
        result["cases"].append(case)
        print(json.dumps(case), flush=True)
    llm.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
