"""Ranks 1.. of a pipeline: meet rank 0, load this stage, then receive, compute and pass on until told
to stop. Each step arrives from the previous rank as a plan and the residual stream; the stage runs
its layers (the first applies the plan's releases, the last samples) and sends the plan and its
output to the next rank, or the result back to rank 0. A failure in a step goes on as the plan's
error instead (rank 0 then runs that step's requests alone); a failure to start is written to the
store for rank 0 to report. The process exits when rank 0 is gone or stops answering."""

from __future__ import annotations

import base64
import logging
import os
import pickle
import subprocess
import sys
import threading
import time

import torch

from kvserve.errors import KVServeError
from kvserve.pipeline import wire
from kvserve.pipeline.deltas import Mirror
from kvserve.pipeline.rendezvous import (
    Heartbeats,
    identity,
    introduce,
    open_store,
    process_group,
    read_sizes,
)
from kvserve.pipeline.stage import StageSpec, bind_cpus, build_stage, stage_of
from kvserve.pipeline.topology import Topology
from kvserve.processes import die_with_parent, freeze_startup_heap

logger = logging.getLogger("kvserve.pipeline")
ARGS_ENV = "KVSERVE_STAGE_ARGS"  # start_local's arguments for the process it starts, pickled


def run_rank(topology: Topology, rank: int, spec: StageSpec, progress: bool = False) -> None:
    """Serve as stage `rank` (> 0) until rank 0 sends the shutdown or goes away. Raises PipelineError
    when rank 0 refuses this rank or cannot be reached."""
    bind_cpus(topology, rank)
    store = open_store(topology, rank)
    introduce(store, identity(rank, spec.model, spec.settings(topology.stages)), topology.stages)
    sizes = read_sizes(store)
    try:
        with torch.inference_mode():
            runner = build_stage(spec, stage_of(spec, topology, rank), sizes, progress)
    except Exception as exc:
        store.set(f"loaded/{rank}", f"{type(exc).__name__}: {exc}")
        raise
    store.set(f"loaded/{rank}", "ok")
    freeze_startup_heap(f"pipeline stage {rank}")
    group = process_group(store, rank, topology.stages)
    beats = Heartbeats(topology, rank)
    watchdog = threading.Thread(target=_watch_rank0, args=(beats, topology), name="kvserve-watch", daemon=True)
    watchdog.start()
    # rank 0 is ready once every stage watches it: stopped any time after, no stage outlives it
    store.set(f"watching/{rank}", "ok")
    logger.info("pipeline stage %d ready", rank)
    last = rank == topology.stages - 1
    copies = Mirror(histories=last)  # each request's block table, and at the last stage its sampler's lists
    while True:
        try:
            kind, plan, hidden = wire.recv(group, rank - 1, wire.TAG_DOWN)
        except RuntimeError as exc:  # gloo's: the rank before is gone (rank 0 killed, say)
            _gone(rank, exc)
        if kind == wire.Kind.SHUTDOWN:
            if last:
                wire.send(group, 0, wire.TAG_BACK, wire.Kind.CLOSED)
            else:
                wire.send(group, rank + 1, wire.TAG_DOWN, wire.Kind.SHUTDOWN)
            beats.stop()
            return
        runner.release(plan.released)
        copies.release(plan.released)
        items = plan.items
        try:  # every plan, a failed one's too: the copies follow rank 0's plans one by one
            items = copies.apply(plan.items, plan.histories, plan.tables)
        except RuntimeError as exc:
            plan.error = plan.error or f"pipeline stage {rank} failed: {exc}"
        output = None
        started = time.perf_counter()
        if plan.error is None:
            try:
                hidden = runner.forward(items, hidden)
                if last:
                    output = runner.sample(items, hidden)
            except Exception as exc:
                logger.exception("pipeline stage %d failed on a step", rank)
                plan.error = f"pipeline stage {rank} failed: {exc!r}"
        plan.stage_seconds.append(time.perf_counter() - started)
        try:
            if last:
                result = wire.StepResult(plan.ticket, output, plan.error, plan.stage_seconds)
                wire.send(group, 0, wire.TAG_BACK, wire.Kind.RESULT, result)
            else:
                wire.send(group, rank + 1, wire.TAG_DOWN, wire.Kind.STEP, plan, hidden if plan.error is None else None)
        except RuntimeError as exc:  # the rank it sends to is gone
            _gone(rank, exc)


def _gone(rank: int, exc: Exception) -> None:
    """The pipeline's connections closed under this stage: one line, and out at once (the interpreter's
    teardown under a thread still in gloo's C++ can abort the process)."""
    cause = str(exc).strip().split("\n", 1)[0][:200]
    logger.error("pipeline stage %d lost its connection to another rank (%s); this stage exits", rank, cause)
    logging.shutdown()
    os._exit(1)


def _watch_rank0(beats: Heartbeats, topology: Topology) -> None:
    """Exit when rank 0 is gone (its store closes), stopped, or has not beaten for stage_timeout: a stage
    without its engine must not linger. It reads what the beat thread saw, never the store itself, whose
    calls wait for good on a stopped process. Ends once this stage stops beating: after the shutdown,
    rank 0 stops too, and this stage's own exit must not be taken for an orphan's."""
    while not beats.stopped(1.0):
        silence = beats.rank0_silence()
        if silence > topology.stage_timeout:
            logger.error("rank 0 stopped answering (%.0f s); this pipeline stage exits", silence)
            os._exit(1)


def start_local(topology: Topology, ranks: list[int], spec: StageSpec) -> list[subprocess.Popen]:
    """Start `ranks` as processes of this host (a fresh interpreter each, not multiprocessing's spawn,
    which would need an `if __name__ == "__main__"` guard in the caller's script); they die with this
    process."""
    processes = []
    for rank in ranks:
        args = (topology, rank, spec, logging.getLogger("kvserve").getEffectiveLevel(), os.getpid())
        env = {**os.environ, ARGS_ENV: base64.b64encode(pickle.dumps(args)).decode()}
        command = "from kvserve.pipeline.worker import local_main; local_main()"
        processes.append(subprocess.Popen([sys.executable, "-c", command], env=env))
    return processes


def local_main() -> None:
    """A rank that rank 0's process started on its own host (start_local)."""
    topology, rank, spec, log_level, parent_pid = pickle.loads(base64.b64decode(os.environ.pop(ARGS_ENV)))
    die_with_parent(parent_pid)
    logging.basicConfig(level=log_level, format=f"%(levelname)s:     stage {rank}: %(message)s")
    try:
        run_rank(topology, rank, spec)
    except KVServeError as exc:  # refused, or its model's files (rank 0 says so too): one line, no traceback
        logger.error("%s", exc)
        raise SystemExit(2) from None


def run_node(topology: Topology, spec: StageSpec) -> int:
    """`kvserve serve` on a host without rank 0: serve its ranks (torchrun's one, else the node's,
    each a process) until they end; the exit status of the first that fails, else 0."""
    if topology.torchrun_rank is not None:
        try:
            run_rank(topology, topology.torchrun_rank, spec, progress=True)
        except KVServeError as exc:
            logger.error("%s", exc)
            return 2
        return 0
    processes = start_local(topology, topology.local_ranks, spec)
    status = 0
    for process in processes:
        status = status or process.wait()
    return status
