"""A long fuzz of the HTTP API: the property of tests/test_fuzz.py over many generated bodies.

    python bench/fuzz.py --examples 5000 --seed 1

Starts a real server (API keys k1, k2; 200,000-byte body limit) over an LLM, runs a greedy
stream beside the fuzz that must equal its solo run, and writes bench/results/fuzz.json: the
examples run, statuses by route, and every distinct failure with the request that caused it
(long strings abbreviated; `all_failures` counts every occurrence). The strategies and the
property are in tests/fuzz_strategies.py. Exits 1 when anything failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def tiny_model(path: Path) -> Path:
    """The tests' tiny random Llama with a byte-level tokenizer (as the tiny_model_dir fixture)."""
    from tests.conftest import make_tiny_llama, write_byte_tokenizer

    make_tiny_llama(path, seed=42, max_position_embeddings=1024, initializer_range=0.2)
    write_byte_tokenizer(path)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=2000, help="generated requests to send (default 2000)")
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="hypothesis seed: the same seed, model and code send the same requests (default 0)",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="model to serve (a name, .gguf file or Hugging Face folder); default: the tests' tiny random Llama, "
        "built in a temporary folder",
    )
    parser.add_argument(
        "--dtype", default=None, help="compute dtype (default: float32 for the tiny model, else kvserve's default)"
    )
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench" / "results" / "fuzz.json", help="where to write the JSON summary"
    )
    args = parser.parse_args()

    from kvserve import LLM
    from kvserve.kernels import build
    from kvserve.server.app import ServerSettings
    from tests.conftest import wait_idle_and_check
    from tests.fuzz_strategies import BODY_LIMIT, KEYS, MODEL, fuzz
    from tests.server_harness import running_server

    build.load()  # as the tests do: decode steps through the fused step from the start
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(tiny_model(Path(tmp) / "tiny-llama"))
        dtype = args.dtype or ("float32" if args.model is None else None)
        started = time.monotonic()
        with LLM(model, dtype=dtype, kv_cache_tokens=8192, session_db=Path(tmp) / "sessions.db", progress=False) as llm:
            settings = ServerSettings(served_model_name=MODEL, api_keys=KEYS, max_queue=64, max_body_bytes=BODY_LIMIT)
            with running_server(settings, llm) as base:
                fuzzer, background = fuzz(base, llm, args.examples, seed=args.seed, derandomize=False)
            leak = None
            try:
                wait_idle_and_check(llm)
            except AssertionError as exc:
                leak = str(exc)
        elapsed = time.monotonic() - started

    distinct = fuzzer.distinct_failures()
    summary = {
        "examples": fuzzer.examples,
        "seed": args.seed,
        "model": args.model or "tiny random Llama (tests.conftest)",
        "seconds": round(elapsed, 1),
        "statuses_by_route": {
            route: {str(s): n for s, n in sorted(counts.items())} for route, counts in sorted(fuzzer.statuses.items())
        },
        "errors_by_route": {  # the 4xx answers by error.param (or message), most frequent first
            route: dict(counts.most_common(25)) for route, counts in sorted(fuzzer.error_params.items())
        },
        "all_failures": len(fuzzer.failures),
        "failures": [{**f.as_dict(), "occurrences": n} for f, n in distinct],
        "background": {"runs": background.runs, "problems": background.problems[:20]},
        "kv_leak": leak,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2, ensure_ascii=True) + "\n")
    print(f"{fuzzer.examples} examples in {elapsed:.0f} s; {len(fuzzer.failures)} failures ({len(distinct)} distinct)")
    for route, counts in summary["statuses_by_route"].items():
        print(f"  {route}: {counts}")
    if distinct:
        print(fuzzer.report())
    for problem in background.problems[:5]:
        print("background:", problem[:300])
    if leak:
        print("leak:", leak)
    print(f"wrote {args.out}")
    return 1 if (fuzzer.failures or background.problems or leak) else 0


if __name__ == "__main__":
    sys.exit(main())
