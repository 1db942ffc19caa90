"""How many of the bundled model's outputs change with what they are batched with (issue 19).

For each configuration (--configs, e.g. `bf16`, `bf16+int8`, `f32`, `bf16+f16kv`): greedy outputs of
--num-prompts prompts run one at a time (solo), then
- 16 requests at once from threads (the prompts repeated), each compared with its solo run;
- the same prompts through a KV pool so small that the scheduler preempts and recomputes;
- each prompt behind a shared 256-token prefix, with the prefix cached and without prefix caching;
- each prompt prefilled in chunks of 7 tokens (max_num_batched_tokens) and whole;
- a two-turn session against the same history sent statelessly;
- seeded samples (temperature 0.8) at once against solo.
Prints and writes JSON (bench/results/batch_invariance.json): per configuration, how many differ.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import threading
from pathlib import Path

from kvserve import LLM, SamplingParams
from kvserve.weights.registry import DEFAULT_MODEL, pull

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "List three uses of copper:",
    "Once upon a time, in a small village,",
    "Explain why the sky is blue in one sentence.",
    "1, 1, 2, 3, 5, 8,",
    "The recipe for pancakes needs",
]
PREFIX = " ".join(["In this report we study the behaviour of large language models under load."] * 20)
CONFIGS = {
    "bf16": dict(dtype="bfloat16", activations="float"),
    "bf16+int8": dict(dtype="bfloat16", activations="int8"),
    "f32": dict(dtype="float32", activations="float"),
    "f32+int8": dict(dtype="float32", activations="int8"),
    "bf16+f16kv": dict(dtype="bfloat16", activations="float", kv_cache_dtype="float16"),
}


def concurrent(llm: LLM, prompts: list[str], params: SamplingParams) -> list[list[int]]:
    out: list[list[int] | None] = [None] * len(prompts)
    barrier = threading.Barrier(len(prompts))

    def run(i: int) -> None:
        barrier.wait()
        out[i] = llm.generate(prompts[i], params).token_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out  # type: ignore[return-value]


def _find(stats: dict, key: str):
    """stats[key], looked up in nested dicts too."""
    for name, value in stats.items():
        if name == key:
            return value
        if isinstance(value, dict) and (found := _find(value, key)) is not None:
            return found
    return None


def differing(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x != y for x, y in zip(a, b, strict=True))


def measure(model: str, options: dict, num_prompts: int, max_tokens: int) -> dict:
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    prompts = PROMPTS[:num_prompts]
    many = [prompts[i % len(prompts)] for i in range(16)]
    result: dict = {}
    with LLM(model, progress=False, **options) as llm:
        solo = [llm.generate(p, greedy).token_ids for p in prompts]
        solo_many = [solo[i % len(prompts)] for i in range(16)]
        result["concurrent_16"] = differing(concurrent(llm, many, greedy), solo_many)
        seeded = [SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=i, ignore_eos=True) for i in range(16)]
        seeded_solo = [llm.generate(p, s).token_ids for p, s in zip(many, seeded, strict=True)]
        out: list = [None] * 16
        threads = [
            threading.Thread(target=lambda i=i: out.__setitem__(i, llm.generate(many[i], seeded[i]).token_ids))
            for i in range(16)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        result["seeded_concurrent_16"] = differing(out, seeded_solo)
        with_prefix = [PREFIX + " " + p for p in prompts]
        llm.generate(with_prefix[0], greedy)  # caches the prefix
        hits = [llm.generate(p, greedy).token_ids for p in with_prefix]
        turn = llm.chat([{"role": "user", "content": prompts[0]}], greedy)
        history = [
            {"role": "user", "content": prompts[0]},
            {"role": "assistant", "content": turn.text},
            {"role": "user", "content": prompts[1]},
        ]
        stateless = llm.chat(history, greedy).token_ids
        with llm.session() as session:
            session.add_message("user", prompts[0])
            session.generate(greedy)
            session.add_message("user", prompts[1])
            in_session = session.generate(greedy).token_ids
        result["session_vs_stateless"] = int(in_session != stateless)
    with LLM(model, progress=False, enable_prefix_caching=False, **options) as llm:
        result["prefix_hit_vs_none"] = differing([llm.generate(p, greedy).token_ids for p in with_prefix], hits)
    with LLM(model, progress=False, max_num_batched_tokens=7, **options) as llm:
        result["chunked_7"] = differing([llm.generate(p, greedy).token_ids for p in prompts], solo)
    with LLM(model, progress=False, kv_cache_tokens=256, **options) as llm:
        many_small = [prompts[i % len(prompts)] for i in range(8)]
        tight = concurrent(llm, many_small, SamplingParams(max_tokens=48, temperature=0, ignore_eos=True))
        result["tight_pool_preemptions"] = _find(llm.stats(), "num_preemptions_total")
        result["tight_pool"] = sum(t[:max_tokens] != solo[i % len(prompts)] for i, t in enumerate(tight))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF or folder (default: the bundled model)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    parser.add_argument("--num-prompts", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "batch_invariance.json"))
    args = parser.parse_args()
    model = args.model or str(pull(DEFAULT_MODEL))
    report = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "processor": platform.processor()},
        "model": model,
        "max_tokens": args.max_tokens,
        "num_prompts": args.num_prompts,
        "results": {},
    }
    for name in args.configs.split(","):
        report["results"][name] = measure(model, CONFIGS[name], args.num_prompts, args.max_tokens)
        print(name, report["results"][name], flush=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
