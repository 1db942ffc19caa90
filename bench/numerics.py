"""How far each arithmetic moves the bundled model's logits from transformers' float32, with llama.cpp
on the same GGUF in the same run: perplexity, the share of positions whose argmax (the greedy token)
agrees with transformers', and the largest and mean |logit difference|, over the first --tokens
tokens of three texts from Python's standard library (its LICENSE.txt and the sources of json and
textwrap: prose and code, the same bytes for a given Python). Each kvserve configuration is
`load_model` with a dtype and an `activations` choice ("auto" resolved as `LLM()` resolves it), one
forward over the whole text; llama.cpp (llama-cpp-python, if installed) evaluates the same token ids
with every position's logits kept. Not a timing: it runs one configuration after another.

    python bench/numerics.py                          # results/numerics.json
    python bench/numerics.py --tokens 256 --out /tmp/numerics.json
"""

from __future__ import annotations

import kvserve  # isort: skip  # noqa: F401
import argparse
import datetime
import json
import math
import sys
import sysconfig
import textwrap
from pathlib import Path

import torch
from throughput import machine_info

from kvserve.kernels import build
from kvserve.llm import default_dtype
from kvserve.text.tokenizer import Tokenizer
from kvserve.weights.loader import load_model
from kvserve.weights.plan import resolve_activations
from kvserve.weights.registry import DEFAULT_MODEL, pull

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.simple_generate import prompt_logits  # one forward over a whole text

CONFIGS = {  # name -> (compute dtype, activations)
    "f32 float": (torch.float32, "float"),
    "bf16 float": (torch.bfloat16, "float"),
    "f32 int8": (torch.float32, "int8"),
    "bf16 int8": (torch.bfloat16, "int8"),
}


def texts() -> dict[str, str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    found = {"LICENSE.txt": stdlib / "LICENSE.txt", "json": Path(json.__file__), "textwrap": Path(textwrap.__file__)}
    return {name: path.read_text() for name, path in found.items() if path.exists()}


def compare(logits: torch.Tensor, reference: torch.Tensor, ids: list[int]) -> dict:
    logits, reference = logits.float(), reference.float()
    logprobs = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])
    gap = (logits - reference).abs()
    return {
        "perplexity": math.exp(-logprobs.mean().item()),
        "argmax_agrees": (logits.argmax(-1) == reference.argmax(-1)).float().mean().item(),
        "max_abs_logit_diff": gap.max().item(),
        "mean_abs_logit_diff": gap.mean().item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "numerics.json")
    args = parser.parse_args()
    import transformers

    if build.load() is None:
        raise SystemExit("the C++ kernels did not build; int8 activations need them")
    path = pull(DEFAULT_MODEL, progress=False)
    tokenizer = Tokenizer.from_gguf(path)
    inputs = {name: tokenizer.encode(text)[: args.tokens] for name, text in texts().items()}
    reference_model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        reference = {name: reference_model(torch.tensor([ids])).logits[0] for name, ids in inputs.items()}
    del reference_model
    cpu = torch.device("cpu")
    configs = dict(CONFIGS)
    configs[f"default (auto: {resolve_activations('auto', cpu, 'auto')})"] = (default_dtype(cpu), "auto")
    results: dict[str, dict] = {
        "transformers f32": {n: compare(reference[n], reference[n], ids) for n, ids in inputs.items()}
    }
    for name, (dtype, activations) in configs.items():
        model = load_model(
            path, dtype, progress=False, weights="auto", activations=resolve_activations(activations, cpu, "auto")
        )
        results[name] = {n: compare(prompt_logits(model, ids), reference[n], ids) for n, ids in inputs.items()}
        print(name, {n: round(r["argmax_agrees"], 4) for n, r in results[name].items()}, flush=True)
    try:
        import numpy as np
        from llama_cpp import Llama

        llama = Llama(
            str(path), n_threads=torch.get_num_threads(), n_ctx=args.tokens + 8, logits_all=True, verbose=False
        )
        results["llama.cpp"] = {}
        for n, ids in inputs.items():
            llama.reset()
            llama.eval(ids)
            results["llama.cpp"][n] = compare(torch.from_numpy(np.array(llama.scores[: len(ids)])), reference[n], ids)
    except ImportError as exc:
        results["llama.cpp"] = {"skipped": str(exc)}
    report = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(torch.get_num_threads()),
        "model": str(path),
        "tokens": {n: len(ids) for n, ids in inputs.items()},
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print("| configuration | " + " | ".join(f"{n}: ppl / argmax agrees / max diff" for n in inputs) + " |")
    print("|---|" + "---:|" * len(inputs))
    for name, per_text in results.items():
        if "skipped" in per_text:
            continue
        cells = (
            f"{r['perplexity']:.2f} / {100 * r['argmax_agrees']:.1f}% / {r['max_abs_logit_diff']:.2f}"
            for r in per_text.values()
        )
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
