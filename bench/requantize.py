"""Write a GGUF at another llama.cpp file type with llama.cpp's own quantizer (through llama-cpp-python).

Issue 36 compares kvserve and llama.cpp on the files people download, which llama.cpp's quantizer makes:
a Q4_K_M file mixes Q4_K, Q5_0 (where a row's length is not a multiple of 256), Q6_K and Q8_0. The
second family there is the bundled SmolLM2-135M (llama) requantized so, from its Q4_1 weights:

    PYTHONPATH=/path/to/llama-cpp-python python bench/requantize.py \
        --model smollm2-135m-instruct --ftype Q4_K_M --out /tmp/smollm2-135m-q4_k_m.gguf
    python bench/decode_ab.py --model /tmp/smollm2-135m-q4_k_m.gguf --out results/decode_ab_smollm2_q4_k_m.json

The file's tensor types are printed (kvserve's GGUF reader), as bench/compare.py reports them.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
from pathlib import Path

from kvserve.weights.gguf_file import GGUFFile
from kvserve.weights.registry import resolve_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a registered name or a GGUF path")
    parser.add_argument("--ftype", default="Q4_K_M", help="llama.cpp's file type, as LLAMA_FTYPE_MOSTLY_<ftype>")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{args.ftype}")
    params.allow_requantize = True  # the source is itself quantized: llama.cpp dequantizes it first
    params.nthread = args.threads
    source = resolve_model(args.model)
    if llama_cpp.llama_model_quantize(str(source).encode(), str(args.out).encode(), ctypes.byref(params)) != 0:
        raise SystemExit(f"llama.cpp could not quantize {source}")
    kinds = collections.Counter(kind for _, kind, _, _ in GGUFFile(args.out).stored())
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.1f} MB):", dict(kinds.most_common()))


if __name__ == "__main__":
    main()
