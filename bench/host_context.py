"""The host's work per decode step at 64 streams against the length of their conversations: the
scheduler's step (schedule and update), a GPU decode graph's fill (DecodeGraphs.run with its replay a
no-op: what the host does before the graph starts), the C++ layer loop's inputs (the CPU's
`_token_inputs`) and a pipeline's plan for 64 penalized requests (trimmed and pickled on rank 0,
unpickled and their histories rebuilt at the last stage; its bytes too). None of it should grow with
the context; a copy of each request's whole token list or block table per step did. No model runs: the
scheduler and the fills alone, on their own data.

    python bench/host_context.py --out bench/results/host_context.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

STREAMS = 64
BLOCK = 16


def _decoding_scheduler(context: int, steps: int, params_of):
    """A scheduler holding 64 requests of `context`-token prompts, room for `steps` more tokens each,
    request i's settings `params_of()`."""
    from kvserve.engine.block_pool import BlockPool
    from kvserve.engine.request import Request
    from kvserve.engine.scheduler import Scheduler

    blocks = STREAMS * (-(-(context + steps + 2) // BLOCK))
    scheduler = Scheduler(BlockPool(blocks + 1, BLOCK), STREAMS, STREAMS * context + STREAMS, context + steps + 8)
    for i in range(STREAMS):
        prompt = [1000 + (i * 7919 + j) % 30000 for j in range(context)]
        scheduler.add_request(Request(f"r{i}", prompt, params_of(), (2,)))
    return scheduler


def scheduler_ms(context: int, steps: int) -> float:
    """ms per schedule + update_from_output of 64 decoding requests at `context` tokens."""
    from kvserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True)
    scheduler = _decoding_scheduler(context, steps, lambda: params)

    def step() -> None:
        out = scheduler.schedule()
        scheduler.update_from_output(out, {item.request_id: 7 for item in out.scheduled if item.sample})

    step()  # the prompts
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) * 1000 / steps


def tables_at(context: int) -> list[list[int]]:
    per = -(-context // BLOCK)
    return [list(range(i * per, (i + 1) * per)) for i in range(STREAMS)]


def graph_fill_ms(context: int, steps: int) -> float | None:
    """ms per DecodeGraphs.run of 64 rows, its replay a no-op (the host's fill and copy call only)."""
    import torch

    from kvserve.engine.cuda_graphs import DecodeGraphs

    try:
        import triton  # noqa: F401  (DecodeGraphs makes the attention's counters)
    except ImportError:
        return None
    model = torch.nn.Linear(1, 1)
    graphs = DecodeGraphs(
        model,
        BLOCK,
        STREAMS,
        context + steps + BLOCK,
        capture=lambda fn, pool: ((lambda: None), torch.zeros(STREAMS, 1)),
    )
    graphs.capture_all()
    tables = tables_at(context)
    spare = STREAMS * len(tables[0])
    start = time.perf_counter()
    for n in range(steps):
        computed = context + n
        if computed % BLOCK == 0:  # each row's next block
            for table in tables:
                table.append(spare)
                spare += 1
        graphs.run([7] * STREAMS, [computed] * STREAMS, [list(t) for t in tables])  # fresh lists, as scheduled
    return (time.perf_counter() - start) * 1000 / steps


def token_inputs_ms(context: int, steps: int) -> float:
    """ms per ModelRunner._token_inputs of 64 decoding rows (the C++ loop's positions, slots, tables)."""
    from kvserve.engine.model_runner import ModelRunner
    from kvserve.engine.scheduler import ScheduledRequest
    from kvserve.sampling_params import SamplingParams

    runner = types.SimpleNamespace(
        block_size=BLOCK, _table_rows=None, _table_shape=(STREAMS, 1 + (context + steps) // BLOCK)
    )
    if hasattr(ModelRunner, "_block_table_rows"):  # absent before dd66c26: this file also times that code
        runner._block_table_rows = lambda items, width: ModelRunner._block_table_rows(runner, items, width)
    tables = tables_at(context)
    spare = STREAMS * len(tables[0])
    params = SamplingParams(max_tokens=1)
    start = time.perf_counter()
    for n in range(steps):
        computed = context + n
        if computed % BLOCK == 0:
            for table in tables:
                table.append(spare)
                spare += 1
        items = [ScheduledRequest(f"r{i}", [7], computed, list(t), True, params, [], []) for i, t in enumerate(tables)]
        ModelRunner._token_inputs(runner, items)
    return (time.perf_counter() - start) * 1000 / steps


def pipeline_plan(context: int, steps: int) -> tuple[float, float]:
    """(ms, bytes) per step of a pipeline's plan for 64 penalized decoding requests at `context` tokens:
    rank 0 trims the items and pickles the plan, the last stage unpickles it and rebuilds each request's
    lists (what the engine thread and a stage do per step besides the model; pipeline/deltas.py).
    Before 2026-12-03 (no deltas.py) every plan carried each request's whole block table and each such
    request's whole prompt and outputs."""
    import pickle

    from kvserve.pipeline import wire
    from kvserve.sampling_params import SamplingParams

    try:
        from kvserve.pipeline.deltas import Mirror, Outbound
    except ImportError:  # the tree before: the whole lists with every plan
        Mirror = Outbound = None
    scheduler = _decoding_scheduler(  # each its own settings, as a server's requests have
        context,
        steps,
        lambda: SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True, repetition_penalty=1.1),
    )
    outbound, mirror = (Outbound(), Mirror(histories=True)) if Outbound is not None else (None, None)
    spent, sent = 0.0, 0
    for n in range(steps + 1):
        out = scheduler.schedule()
        start = time.perf_counter()
        if outbound is not None:
            items, histories, tables = outbound.trim(out.scheduled)
            plan = wire.StepPlan(n, items, histories=histories, tables=tables)
        else:
            plan = wire.StepPlan(n, [wire.trimmed(item) for item in out.scheduled])
        data = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
        received = pickle.loads(data)
        if mirror is not None:
            mirror.apply(received.items, received.histories, received.tables)
        if n:  # the prompts' step aside: decode steps only
            spent += time.perf_counter() - start
            sent += len(data)
        scheduler.update_from_output(out, {item.request_id: 7 for item in out.scheduled if item.sample})
    return spent * 1000 / steps, sent / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="60,2000,8000")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5, help="runs per figure; the median is reported")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows = []
    for context in map(int, args.contexts.split(",")):
        row = {"streams": STREAMS, "context": context}
        for name, fn in (("scheduler", scheduler_ms), ("graph_fill", graph_fill_ms), ("token_inputs", token_inputs_ms)):
            runs = [fn(context, args.steps) for _ in range(args.repeats)]
            row[f"{name}_ms"] = None if runs[0] is None else round(statistics.median(runs), 4)
        plans = [pipeline_plan(context, args.steps) for _ in range(args.repeats)]
        row["pipeline_plan_ms"] = round(statistics.median(ms for ms, _ in plans), 4)
        row["pipeline_plan_bytes"] = round(statistics.median(size for _, size in plans))
        rows.append(row)
        print(json.dumps(row), flush=True)
    described = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True, cwd=ROOT)
    result = {
        "commit": described.stdout.strip() or "unknown",
        "date": time.strftime("%Y-%m-%d"),
        "steps": args.steps,
        "runs": rows,
    }
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
