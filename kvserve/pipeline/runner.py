"""PipelineRunner: rank 0's side of a pipeline, the engine's Runner (engine/core.py) with depth = the
number of stages.

`execute` runs the first stage's layers on the engine thread and sends the step's plan and output
down the pipeline; the step's result comes back from the last stage to a receiver thread, which
hands it to the engine (`EngineCore.step_done`). The engine meanwhile schedules other requests into
the next micro-batch, so that every stage has one to work on. Every block table, abort, preemption
and eviction is the scheduler's decision, made once here; the stages only apply the plans, in order,
so a stage can never hold state another has dropped (the exo failure: a cache not reset in every
shard).

A watchdog thread ends the engine (`EngineCore.runner_died`: every request fails, /health 503) when
a local stage's process exits, a stage's heartbeat stops for `stage_timeout`, or a link breaks;
`close` sends the shutdown down the pipeline and stops the local stages, killing what does not stop.

Sends down the pipeline leave from a sender thread, never from the engine thread: gloo completes a
send only once the peer has posted its receive, so a stage that stops (SIGSTOP, a hung host) would
hold a sending engine thread forever, and with it the inbox where the watchdog's verdict waits.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import subprocess
import threading
import time

import torch
import torch.distributed as dist

from kvserve.engine.core import EngineCore
from kvserve.engine.model_runner import ModelRunner, RunnerOutput
from kvserve.engine.scheduler import SchedulerOutput
from kvserve.errors import EngineError
from kvserve.pipeline import wire
from kvserve.pipeline.deltas import Outbound
from kvserve.pipeline.rendezvous import (
    MEET_TIMEOUT,
    EngineSizes,
    Heartbeats,
    PipelineError,
    identity,
    introduce,
    open_store,
    process_group,
    publish_sizes,
)
from kvserve.pipeline.stage import StageSpec, bind_cpus, build_stage, stage_of
from kvserve.pipeline.topology import Topology
from kvserve.pipeline.worker import start_local

logger = logging.getLogger("kvserve.pipeline")


class PipelineRunner:
    def __init__(
        self,
        engine: EngineCore,
        topology: Topology,
        stage: ModelRunner,
        group: dist.ProcessGroup,
        beats: Heartbeats,
        workers: dict[int, subprocess.Popen],
    ) -> None:
        self.engine = engine
        self.topology = topology
        self.depth = topology.stages
        self.stage = stage  # the first stage's layers and KV pool
        self.group = group
        self.beats = beats
        self.workers = workers  # this host's other stages' processes, by rank
        self.bytes_sent = 0  # plans and activations sent down the pipeline, for the benchmark
        self.stage_seconds = [0.0] * topology.stages  # each stage's compute time, over the steps that came back
        self._released: list[str] = []
        self._deltas = Outbound()  # what the plans have told the stages of each request's lists
        self._dead = False
        self._closing = False
        self._stop = threading.Event()
        self._outgoing: queue.SimpleQueue = queue.SimpleQueue()  # (kind, plan, hidden) for the sender, in order
        self._receiver = threading.Thread(target=self._receive, name="kvserve-pipeline-recv", daemon=True)
        self._watchdog = threading.Thread(target=self._watch, name="kvserve-pipeline-watch", daemon=True)
        self._sender = threading.Thread(target=self._send, name="kvserve-pipeline-send", daemon=True)
        self._receiver.start()
        self._watchdog.start()
        self._sender.start()

    # ----- start -----------------------------------------------------------------------------
    @staticmethod
    def start(engine: EngineCore, topology: Topology, spec: StageSpec, sizes: EngineSizes, progress: bool):
        """Start the node's other ranks, meet every rank (checking it runs what this one does), load
        the first stage on this thread (the engine's) and wait until every stage has loaded its own.
        Raises PipelineError, having stopped whatever it started, when a rank is refused or fails."""
        workers = start_local(topology, topology.local_ranks[1:], spec)
        try:
            store = open_store(topology, 0)
            local = dict(zip(topology.local_ranks[1:], workers, strict=True))
            _await(store, [f"hello/{r}" for r in range(1, topology.stages)], local, "to meet rank 0")
            introduce(store, identity(0, spec.model, spec.settings(topology.stages)), topology.stages)
            publish_sizes(store, sizes)
            bind_cpus(topology, 0)
            stage = build_stage(spec, stage_of(spec, topology, 0), sizes, progress)
            loaded = [f"loaded/{r}" for r in range(1, topology.stages)]
            _await(store, loaded, local, "to load its stage")
            for key in loaded:
                if (status := store.get(key).decode()) != "ok":
                    raise PipelineError(f"pipeline stage {key.split('/')[1]} failed to load its layers: {status}")
            group = process_group(store, 0, topology.stages)
            beats = Heartbeats(topology, 0)
            # each stage's watchdog started: rank 0 stopped before then left a stage waiting in its store
            # client's connect for the meeting's 10 minutes, with nothing watching
            _await(store, [f"watching/{r}" for r in range(1, topology.stages)], local, "to watch rank 0")
        except BaseException:
            _stop_processes(workers, wait=0.0)  # they wait for a pipeline that will not come
            raise
        logger.info("pipeline of %d stages ready (%d on this host)", topology.stages, len(topology.local_ranks))
        return PipelineRunner(engine, topology, stage, group, beats, local)

    # ----- the engine's Runner ---------------------------------------------------------------------
    @property
    def model(self) -> torch.nn.Module:
        return self.stage.model

    @property
    def timings(self):
        return self.stage.timings

    def execute(self, out: SchedulerOutput, ticket: int = 0) -> RunnerOutput | None:
        """Run the first stage on this step and queue it for the next stage; its result arrives
        through step_done. Raises where the first stage fails (nothing has been sent then)."""
        started = time.perf_counter()
        hidden = self.stage.forward(out.scheduled).to("cpu")  # gloo sends from host memory; a copy on a GPU
        items, histories, tables = self._deltas.trim(out.scheduled)
        plan = wire.StepPlan(ticket, items, self._released, histories=histories, tables=tables)
        plan.stage_seconds.append(time.perf_counter() - started)
        self._released = []
        self._outgoing.put((wire.Kind.STEP, plan, hidden))
        return None

    def release(self, request_ids: list[str]) -> None:
        self.stage.release(request_ids)
        self._deltas.release(request_ids)
        self._released.extend(request_ids)  # the stages' copies and the last one's generators go with the next plan

    def close(self) -> None:
        """Stop every stage: the shutdown down the pipeline (the last answers when it has passed),
        then the local processes, killed if they do not end (at once where the pipeline is broken)."""
        self._closing = True
        self._stop.set()
        if not self._dead:  # after the steps still queued; a link that breaks now: the stages are going anyway
            self._outgoing.put((wire.Kind.SHUTDOWN, None, None))
            self._sender.join(10.0)
            self._receiver.join(10.0)
        self.beats.stop()
        _stop_processes(list(self.workers.values()), wait=0.0 if self._dead else 10.0)

    # ----- threads ----------------------------------------------------------------------------
    def _send(self) -> None:
        """Send the queued steps (and at last the shutdown) to stage 1, in order. Only this thread waits
        on a stage that stopped; the watchdog's verdict reaches the engine meanwhile."""
        while True:
            kind, plan, hidden = self._outgoing.get()
            try:
                self.bytes_sent += wire.send(self.group, 1, wire.TAG_DOWN, kind, plan, hidden)
            except RuntimeError as exc:
                if kind == wire.Kind.SHUTDOWN:
                    return
                self._died(self._gone(1, exc))
                return
            if kind == wire.Kind.SHUTDOWN:
                return

    def _receive(self) -> None:
        last = self.topology.stages - 1
        while True:
            try:
                kind, result, _ = wire.recv(self.group, last, wire.TAG_BACK)
            except RuntimeError as exc:
                if not self._closing:
                    self._died(self._gone(last, exc))
                return
            if kind == wire.Kind.CLOSED:
                return
            for stage, seconds in enumerate(result.stage_seconds):
                self.stage_seconds[stage] += seconds
            outcome = result.output if result.error is None else EngineError(result.error)
            self.engine.step_done(result.ticket, outcome)

    def _watch(self) -> None:
        others = list(range(1, self.topology.stages))
        while not self._stop.wait(0.5):
            exited = _first_exit(self.workers)
            if exited is not None:
                self._died(exited)
                return
            stalled = self.beats.stalled(others, self.topology.stage_timeout)
            if stalled is not None:
                rank, seconds = stalled
                self._died(f"pipeline stage {rank} stopped answering ({seconds:.0f} s without a heartbeat)")
                return

    def _gone(self, peer: int, exc: RuntimeError) -> str:
        """Why a link to `peer` broke: a local stage's exit where one exited (its process is reaped
        within a moment of its connections closing), else the link's own error."""
        for process in self.workers.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(0.5)
                break
        exited = _first_exit(self.workers)
        if exited is not None:
            return exited
        detail = str(exc).split(" This is typically")[0].split("] ")[-1]  # gloo's text, less its source path
        return f"the link to pipeline stage {peer} broke ({detail})"

    def _died(self, reason: str) -> None:
        if self._dead or self._closing:
            return
        self._dead = True
        self.engine.runner_died(reason)


def _first_exit(workers: dict[int, subprocess.Popen]) -> str | None:
    """Which local stage's process has exited, with its code; None while all run."""
    for rank, process in workers.items():
        if process.poll() is not None:
            return f"pipeline stage {rank} (pid {process.pid}) exited with code {process.returncode}"
    return None


def _await(store: dist.Store, keys: list[str], workers: dict[int, subprocess.Popen], what: str) -> None:
    """Wait until every key is in the store, or raise PipelineError when a local stage (`workers`) has
    died or MEET_TIMEOUT has passed."""
    deadline = time.monotonic() + MEET_TIMEOUT.total_seconds()
    while not store.check(keys):
        reason = _first_exit(workers)
        if reason is not None:
            raise PipelineError(f"The pipeline could not start: {reason} while waiting for every stage {what}.")
        if time.monotonic() > deadline:
            missing = [key.split("/")[1] for key in keys if not store.check([key])]
            raise PipelineError(
                f"The pipeline could not start: ranks {', '.join(missing)} did not come {what} within "
                f"{MEET_TIMEOUT.total_seconds():.0f} s. Start them with the same --master-addr and --master-port."
            )
        time.sleep(0.05)


def _stop_processes(processes: list[subprocess.Popen], wait: float = 10.0) -> None:
    """Reap `processes`, killing those still running after `wait` seconds."""
    for process in processes:
        try:
            process.wait(wait)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
