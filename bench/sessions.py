"""Sessions benchmark: what keeping a conversation's KV between turns buys.

1. Time to first token of turn N (1..10) of one session, each turn adding a user message of about
   --turn-tokens tokens and a reply of --reply-tokens, against the same history sent statelessly
   to an engine without prefix caching (every turn recomputes the whole history).
2. Time to first token after --stream-tokens tokens of input streamed in --chunks chunks (the
   engine prefills them eagerly while they arrive), against the same input sent at once.
Writes JSON (--out) and prints Markdown tables. Smoke test: `python bench/sessions.py --quick`.
"""

from __future__ import annotations

# kvserve first: importing it sets its GOMP_SPINCOUNT default, which only counts before torch loads libgomp.
import kvserve  # isort: skip  # noqa: F401
import argparse
import datetime
import json
import os
import platform
import random
import time
from pathlib import Path

import torch
from common import WORDS

from kvserve import LLM, SamplingParams

DEFAULT_OUT = Path(__file__).parent / "results" / "sessions.json"


def text_of(llm: LLM, num_tokens: int, rng: random.Random) -> str:
    """Random words, trimmed to about `num_tokens` tokens."""
    words = []
    while len(llm.tokenizer.encode(" ".join(words))) < num_tokens:
        words.append(rng.choice(WORDS))
    return " ".join(words)


def ttft(stream) -> tuple[float, str]:
    start, first, pieces = time.perf_counter(), None, []
    for chunk in stream:
        if first is None and chunk.token_ids:
            first = time.perf_counter() - start
        pieces.append(chunk.text)
    return first, "".join(pieces)


def turns(args, rng: random.Random) -> list[dict]:
    reply = SamplingParams(max_tokens=args.reply_tokens, temperature=0, ignore_eos=True)
    with LLM(session_db=False, progress=False) as llm:
        messages = [text_of(llm, args.turn_tokens, rng) for _ in range(args.turns)]
        session = llm.session(system="You are a helpful assistant.")
        rows, history = [], [{"role": "system", "content": "You are a helpful assistant."}]
        for n, message in enumerate(messages, 1):
            session.add_message("user", message)
            history.append({"role": "user", "content": message})
            first, text = ttft(session.stream(reply))
            rows.append({"turn": n, "history_tokens": len(llm.tokenizer.encode_chat(history)), "session_ttft_s": first})
            history.append({"role": "assistant", "content": text})
        session.close()
    with LLM(enable_prefix_caching=False, session_db=False, progress=False) as plain:
        for row, n in zip(rows, range(1, args.turns + 1), strict=True):
            prefix = history[: 2 * n]  # system + n user messages + n-1 replies
            row["stateless_ttft_s"], _ = ttft(plain.stream_chat(prefix, reply))
    return rows


def streamed_input(args, rng: random.Random) -> dict:
    reply = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with LLM(session_db=False, progress=False) as llm:
        text = text_of(llm, args.stream_tokens, rng)
        size = -(-len(text) // args.chunks)
        streamed = llm.session()
        for start in range(0, len(text), size):
            streamed.append(text[start : start + size])
            time.sleep(args.chunk_interval)  # the user is still typing (or speaking)
        streamed_ttft, _ = ttft(streamed.stream(reply))
        at_once = llm.session()
        at_once.add_message("user", text_of(llm, args.stream_tokens, rng))  # fresh text: no shared prefix
        at_once_ttft, _ = ttft(at_once.stream(reply))
    return {
        "input_tokens": args.stream_tokens,
        "chunks": args.chunks,
        "chunk_interval_s": args.chunk_interval,
        "streamed_ttft_s": streamed_ttft,
        "at_once_ttft_s": at_once_ttft,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--turn-tokens", type=int, default=200, help="tokens of each user message")
    parser.add_argument("--reply-tokens", type=int, default=32)
    parser.add_argument("--stream-tokens", type=int, default=2000)
    parser.add_argument("--chunks", type=int, default=100)
    parser.add_argument("--chunk-interval", type=float, default=0.05, help="seconds between streamed chunks")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="3 turns of 50 tokens, 300 tokens in 10 chunks")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    if args.quick:
        args.turns, args.turn_tokens, args.reply_tokens, args.stream_tokens, args.chunks = 3, 50, 8, 300, 10
    torch.set_num_threads(os.cpu_count() or 1)
    rng = random.Random(args.seed)
    report = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "torch": torch.__version__},
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "turns": turns(args, rng),
        "streamed_input": streamed_input(args, rng),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print("| turn | history tokens | TTFT session (ms) | TTFT stateless, no cache (ms) |\n|---:|---:|---:|---:|")
    for row in report["turns"]:
        print(
            f"| {row['turn']} | {row['history_tokens']} | {row['session_ttft_s'] * 1e3:.0f} | "
            f"{row['stateless_ttft_s'] * 1e3:.0f} |"
        )
    s = report["streamed_input"]
    print(
        f"\n{s['input_tokens']} tokens of input in {s['chunks']} chunks: TTFT {s['streamed_ttft_s'] * 1e3:.0f} ms "
        f"streamed (eager prefill) vs {s['at_once_ttft_s'] * 1e3:.0f} ms sent at once"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
