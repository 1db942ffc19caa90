"""The `kvserve` command line. Every flag can also be set by a KVSERVE_* environment variable."""

from __future__ import annotations

import argparse
import os
import sys

from kvserve.errors import KVServeError
from kvserve.model_files import DEFAULT_MODEL, REGISTRY, is_pulled, kvserve_home, pull


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"KVSERVE_{name}", default)


def _cmd_pull(args: argparse.Namespace) -> int:
    path = pull(args.name, progress=not args.quiet, force=args.force)
    print(path)
    return 0


def _cmd_models(args: argparse.Namespace) -> int:
    print(f"KVSERVE_HOME={kvserve_home()}")
    for model in REGISTRY.values():
        mark = "pulled " if is_pulled(model) else "       "
        print(f"{mark} {model.name:24} {model.description}")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from kvserve.llm import LLM
    from kvserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    with LLM(args.model, dtype=args.dtype, max_num_seqs=1) as llm:
        if args.raw or llm.tokenizer.chat_template is None:
            chunks = llm.stream(args.prompt, params)
        else:
            chunks = llm.stream_chat([{"role": "user", "content": args.prompt}], params)
        for chunk in chunks:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvserve",
        description="kvserve: LLM inference where every request owns its KV cache. "
        "Models are cached in $KVSERVE_HOME (default ~/.cache/kvserve).",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("pull", help="fetch a registered model into $KVSERVE_HOME")
    p.add_argument("name", nargs="?", default=DEFAULT_MODEL, choices=sorted(REGISTRY), help="registered model name")
    p.add_argument("--force", action="store_true", help="fetch again even if the file is already there")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=_cmd_pull)

    p = sub.add_parser("models", help="list the registered models and whether they are pulled")
    p.set_defaults(func=_cmd_models)

    p = sub.add_parser("generate", help="generate a reply to one prompt, streamed to the terminal")
    p.add_argument("prompt", help="the prompt (sent as one user message when the model has a chat template)")
    p.add_argument(
        "--model",
        default=_env("MODEL", DEFAULT_MODEL),
        help="registered model name, .gguf file or Hugging Face folder (env KVSERVE_MODEL; default %(default)s)",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=int(_env("MAX_TOKENS", "256")),
        help="most tokens to generate (env KVSERVE_MAX_TOKENS; default %(default)s)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=float(_env("TEMPERATURE", "0")),
        help="sampling temperature, 0 for greedy (env KVSERVE_TEMPERATURE; default %(default)s)",
    )
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling (default: random)")
    p.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16"),
        default=_env("DTYPE", "auto"),
        help="compute dtype; auto picks the measured fastest for the device (env KVSERVE_DTYPE; default %(default)s)",
    )
    p.add_argument("--raw", action="store_true", help="send the prompt as plain text, without the chat template")
    p.set_defaults(func=_cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KVServeError as exc:
        print(f"kvserve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
