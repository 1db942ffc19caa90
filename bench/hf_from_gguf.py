"""Write a Hugging Face model folder (config, bfloat16 safetensors, tokenizer with its chat template) made
from a GGUF file, so that servers that do not read GGUF (vLLM's CPU build, bench/vllm_cpu.sh) serve the
same weights kvserve and llama.cpp do. The quantized blocks are dequantized by transformers'
GGUF loader (`GgufConfig(dequantize=True)`) and stored in bfloat16.

    .venv/bin/python bench/hf_from_gguf.py [GGUF] [--out DIR]

GGUF defaults to the bundled SmolLM2-135M-Instruct; DIR to ~/.cache/kvserve/hf/<gguf stem>/. Skips the
work when DIR already holds a model. Prints DIR.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

DEFAULT_ROOT = Path.home() / ".cache" / "kvserve" / "hf"
DEFAULT_MODEL = "smollm2-135m-instruct"


def default_out(gguf: Path) -> Path:
    return DEFAULT_ROOT / gguf.stem


def is_complete(out: Path) -> bool:
    return (
        (out / "config.json").is_file() and any(out.glob("*.safetensors")) and (out / "tokenizer_config.json").is_file()
    )


def convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        from transformers import GgufConfig
    except ImportError:  # older transformers: gguf_file alone dequantizes
        quant = {}
    else:
        quant = {"quantization_config": GgufConfig(dequantize=True)}
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16, **quant)
    model = model.to(torch.bfloat16)
    # Once dequantized the weights are plain tensors: the folder must not claim a GGUF quantization.
    model.config.quantization_config = None
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    model.config.dtype = torch.bfloat16
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    config = json.loads((tmp / "config.json").read_text())
    config.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("gguf", nargs="?", type=Path, help=f"GGUF file (default: the bundled {DEFAULT_MODEL})")
    parser.add_argument("--out", type=Path, help="output folder (default ~/.cache/kvserve/hf/<gguf stem>/)")
    parser.add_argument("--force", action="store_true", help="rewrite the folder even if it is there")
    args = parser.parse_args()
    gguf = args.gguf
    if gguf is None:
        from kvserve.weights.registry import resolve_model

        gguf = resolve_model(DEFAULT_MODEL)
    gguf = Path(gguf).expanduser().resolve()
    out = (args.out or default_out(gguf)).expanduser()
    if args.force or not is_complete(out):
        out.parent.mkdir(parents=True, exist_ok=True)
        convert(gguf, out)
    print(out)


if __name__ == "__main__":
    main()
