"""How the ranks of a pipeline meet: a TCPStore at master_addr:master_port (rank 0 keeps it, or
torchrun's agent), where each rank says who it is, rank 0 checks that every rank runs the same
kvserve and the same model file with the same settings, and hands out the engine's sizes; then a
gloo process group of its own (never torch.distributed's default group, which a script embedding
kvserve may use for itself), and a heartbeat per rank.

Keys (under "kvserve/"): hello/<rank> (each rank: Identity), verdict/<rank> (rank 0: "ok" or why
not), engine (rank 0: EngineSizes), beat/<rank> (a counter each rank adds to every half second).
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import os
import pickle
import socket
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch.distributed as dist

from kvserve.errors import KVServeError
from kvserve.pipeline.topology import Topology
from kvserve.version import __version__

logger = logging.getLogger("kvserve.pipeline")

MEET_TIMEOUT = datetime.timedelta(seconds=600)  # every rank loads its model first: minutes for a large one
# Links idle for as long as no request comes; a dead peer closes its connection (an error at once)
# and a hung one stops its heartbeat (`Heartbeats`), so the group's own timeout is only a backstop.
LINK_TIMEOUT = datetime.timedelta(days=7)
BEAT_INTERVAL = 0.5


class PipelineError(KVServeError):
    """A pipeline could not start (a rank refused, unreachable or started differently) or lost a stage."""


@dataclass(frozen=True)
class Identity:
    """What a rank says of itself; rank 0 refuses a rank whose `must_match` part differs from its own."""

    rank: int
    host: str
    pid: int
    version: str
    model: str  # the path as this rank was given it
    fingerprint: str  # model_fingerprint()
    settings: tuple[tuple[str, str], ...]  # dtype, weights, activations, ... as strings

    @property
    def must_match(self) -> dict[str, str]:
        return {"kvserve version": self.version, "model file": self.fingerprint, **dict(self.settings)}

    def where(self) -> str:
        return f"rank {self.rank} ({self.host}, pid {self.pid})"


@dataclass(frozen=True)
class EngineSizes:
    """What rank 0 decides for every stage: the KV pool's blocks (the same ids everywhere), the
    tokens the last stage's sampler treats as stops, and the limits a stage sizes its buffers by."""

    num_kv_blocks: int
    block_size: int
    stop_token_ids: tuple[int, ...]
    max_num_seqs: int
    max_model_len: int


def model_fingerprint(path: str | os.PathLike[str]) -> str:
    """sha256 of a model file's size and bytes (the first and last 64 MiB of a larger file: its header,
    which names every tensor, and samples of its data), or of a folder's file names, sizes and JSON."""
    path = Path(path)
    digest = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.name if path.is_dir() else ''}:{size}".encode())
        window = 64 << 20
        with file.open("rb") as f:
            if path.is_dir() and file.suffix != ".json" and file.suffix != ".safetensors":
                continue
            if size <= 2 * window:
                digest.update(f.read())
            else:
                digest.update(f.read(window))
                f.seek(size - window)
                digest.update(f.read(window))
    return digest.hexdigest()[:16]


def _connect(topology: Topology, is_master: bool) -> dist.TCPStore:
    store = dist.TCPStore(
        topology.master_addr,
        topology.master_port,
        None,
        is_master,
        timeout=MEET_TIMEOUT,
        wait_for_workers=False,
    )
    return store


def open_store(topology: Topology, rank: int) -> dist.Store:
    """This rank's client of the meeting point (rank 0 starts it unless torchrun's agent keeps one)."""
    try:
        store = _connect(topology, is_master=rank == 0 and not topology.agent_store)
    except (RuntimeError, dist.DistStoreError) as exc:
        raise PipelineError(
            f"rank {rank} could not reach the pipeline's meeting point {topology.master_addr}:{topology.master_port}: "
            f"{exc}. Start rank 0 first (the node with --node-rank 0) and give every node the same "
            "--master-addr and --master-port."
        ) from exc
    return dist.PrefixStore("kvserve", store)


def introduce(store: dist.Store, identity: Identity, stages: int) -> None:
    """Say who this rank is and wait for rank 0's verdict; rank 0 checks every rank against itself.
    Raises PipelineError on a refusal, naming what differs."""
    store.set(f"hello/{identity.rank}", pickle.dumps(identity))
    if identity.rank == 0:
        for rank in range(1, stages):
            store.wait([f"hello/{rank}"], MEET_TIMEOUT)
            other: Identity = pickle.loads(store.get(f"hello/{rank}"))
            differences = [
                f"{key} {other.must_match.get(key)!r} where rank 0 has {value!r}"
                for key, value in identity.must_match.items()
                if other.must_match.get(key) != value
            ]
            if differences:
                reason = (
                    f"{other.where()} was started differently from rank 0 ({identity.where()}, model "
                    f"{identity.model}): {'; '.join(differences)}. Start every rank with the same kvserve, "
                    "the same model file and the same flags."
                )
                store.set(f"verdict/{rank}", reason)
                raise PipelineError(f"The pipeline refused {reason}")
            store.set(f"verdict/{rank}", "ok")
        return
    store.wait([f"verdict/{identity.rank}"], MEET_TIMEOUT)
    verdict = store.get(f"verdict/{identity.rank}").decode()
    if verdict != "ok":
        raise PipelineError(f"Rank 0 refused this rank: {verdict}")


def publish_sizes(store: dist.Store, sizes: EngineSizes) -> None:
    store.set("engine", pickle.dumps(asdict(sizes)))


def read_sizes(store: dist.Store) -> EngineSizes:
    store.wait(["engine"], MEET_TIMEOUT)
    return EngineSizes(**pickle.loads(store.get("engine")))


def process_group(store: dist.Store, rank: int, stages: int) -> dist.ProcessGroup:
    """A gloo group of the pipeline's ranks (every rank calls this; it returns once all have)."""
    return dist.ProcessGroupGloo(dist.PrefixStore("group", store), rank, stages, LINK_TIMEOUT)


def identity(rank: int, model: str | os.PathLike[str], settings: dict[str, object]) -> Identity:
    return Identity(
        rank=rank,
        host=socket.gethostname(),
        pid=os.getpid(),
        version=__version__,
        model=str(model),
        fingerprint=model_fingerprint(model),
        settings=tuple(sorted((key, str(value)) for key, value in settings.items())),
    )


class Heartbeats:
    """A thread that adds to this rank's beat/<rank> counter every BEAT_INTERVAL, on a store client of
    its own (a C++ step releases the interpreter lock, so a rank deep in a long step still beats),
    and `stalled(ranks, timeout)`: the first of `ranks` whose counter has not moved for `timeout`
    seconds, with how long. A store that stops answering (rank 0's process, which keeps it, is
    gone) is reported as rank 0 stalled."""

    def __init__(self, topology: Topology, rank: int) -> None:
        self.rank = rank
        self.store = dist.PrefixStore("kvserve", _connect(topology, is_master=False))
        self._rank0 = (-1, time.monotonic())  # rank 0's counter as this thread last saw it move, and when
        self._seen: dict[int, tuple[int, float]] = {}
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._beat, name=f"kvserve-beat-{rank}", daemon=True)
        self.thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(BEAT_INTERVAL):
            try:
                self.store.add(f"beat/{self.rank}", 1)
                if self.rank != 0:  # read here: a store call can block for good (rank 0's process stopped)
                    count = self.store.add("beat/0", 0)
                    if count != self._rank0[0]:
                        self._rank0 = (count, time.monotonic())
            except Exception:  # the store is gone: stalled() and rank0_silence() say so to whoever watches
                return

    def rank0_silence(self) -> float:
        """Seconds since this rank's beat thread last saw rank 0's counter move (its process gone,
        stopped, or not beating), without a store call of the caller's own."""
        return time.monotonic() - self._rank0[1]

    def stalled(self, ranks: list[int], timeout: float) -> tuple[int, float] | None:
        now = time.monotonic()
        for rank in ranks:
            try:
                count = self.store.add(f"beat/{rank}", 0)
            except Exception:
                return 0, timeout
            last = self._seen.get(rank)
            if last is None or last[0] != count:
                self._seen[rank] = (count, now)
            elif now - last[1] > timeout:
                return rank, now - last[1]
        return None

    def stop(self) -> None:
        self._stop.set()

    def stopped(self, wait: float) -> bool:
        """Whether `stop` was called, waiting up to `wait` seconds for it."""
        return self._stop.wait(wait)
