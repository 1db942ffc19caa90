"""Topology: the shape of a pipeline and where this process sits in it.

`stages` ranks over `nnodes` hosts, the same number on each (rank r on node r // ranks_per_node);
they meet at master_addr:master_port, where rank 0 (or torchrun's agent) keeps a TCPStore. The
flags follow torchrun's names (--nnodes, --node-rank, --master-addr, --master-port); a process that
torchrun started reads them from its environment instead (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), and is then exactly one rank.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, replace

from kvserve.errors import InvalidRequestError

DEFAULT_MASTER_PORT = 29500  # torchrun's


@dataclass(frozen=True)
class Topology:
    stages: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0 on one node: a free port is picked
    torchrun_rank: int | None = None  # set when torchrun started this process as that one rank
    agent_store: bool = False  # torchrun's agent keeps the TCPStore (its workers connect to it)
    stage_timeout: float = 5.0  # seconds without a heartbeat after which a stage counts as gone

    def __post_init__(self) -> None:
        if self.stages < 1:
            raise InvalidRequestError(f"pipeline_parallel must be >= 1, got {self.stages}.", "pipeline_parallel")
        if self.nnodes < 1 or self.stages % self.nnodes:
            raise InvalidRequestError(
                f"pipeline_parallel ({self.stages}) must be a multiple of nnodes ({self.nnodes}): "
                "every host runs the same number of stages.",
                "nnodes",
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise InvalidRequestError(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank}.", "node_rank")
        if self.nnodes > 1 and not self.master_port:
            raise InvalidRequestError("Across hosts every node needs the same --master-port.", "master_port")

    @property
    def ranks_per_node(self) -> int:
        return self.stages // self.nnodes

    @property
    def local_ranks(self) -> list[int]:
        """The ranks this process starts or is: its node's, or its own under torchrun."""
        if self.torchrun_rank is not None:
            return [self.torchrun_rank]
        first = self.node_rank * self.ranks_per_node
        return list(range(first, first + self.ranks_per_node))

    @property
    def hosts_rank0(self) -> bool:
        return 0 in self.local_ranks

    def with_port(self) -> Topology:
        """This topology with a free port picked where none was given (one node, no torchrun)."""
        if self.master_port:
            return self
        with socket.socket() as s:
            s.bind((self.master_addr, 0))
            port = s.getsockname()[1]
        return replace(self, master_port=port)

    @staticmethod
    def from_settings(
        stages: int,
        nnodes: int | None = None,
        node_rank: int | None = None,
        master_addr: str | None = None,
        master_port: int | None = None,
        stage_timeout: float = 5.0,
    ) -> Topology:
        """From flags, or from torchrun's environment where torchrun started this process (its
        WORLD_SIZE must then equal `stages`, and each of its processes is one rank)."""
        env = os.environ
        if "RANK" in env and "WORLD_SIZE" in env and stages > 1:
            world = int(env["WORLD_SIZE"])
            if world != stages:
                raise InvalidRequestError(
                    f"torchrun started {world} processes for {stages} pipeline stages; start one per stage.",
                    "pipeline_parallel",
                )
            return Topology(
                stages,
                int(env.get("GROUP_WORLD_SIZE", env.get("NNODES", "1"))),
                int(env.get("GROUP_RANK", "0")),
                env.get("MASTER_ADDR", "127.0.0.1"),
                int(env.get("MASTER_PORT", str(DEFAULT_MASTER_PORT))),
                torchrun_rank=int(env["RANK"]),
                agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
                stage_timeout=stage_timeout,
            )
        return Topology(
            stages,
            nnodes or 1,
            node_rank or 0,
            master_addr or "127.0.0.1",
            master_port if master_port is not None else (DEFAULT_MASTER_PORT if (nnodes or 1) > 1 else 0),
            stage_timeout=stage_timeout,
        )


def stage_layers(num_layers: int, stages: int, rank: int) -> tuple[int, int]:
    """Layers [first, end) of stage `rank`: an even split, the earlier stages one more where it does
    not divide."""
    if stages > num_layers:
        raise InvalidRequestError(
            f"pipeline_parallel ({stages}) cannot exceed the model's {num_layers} layers.", "pipeline_parallel"
        )
    base, extra = divmod(num_layers, stages)
    first = rank * base + min(rank, extra)
    return first, first + base + (rank < extra)


def stage_cpus(topology: Topology, rank: int) -> list[int] | None:
    """The CPUs a local rank computes on: this process's CPUs split evenly between the node's ranks
    (none where one process is the node's only rank), so that two stages' thread teams never share a
    core."""
    local = topology.local_ranks
    if len(local) == 1 or not hasattr(os, "sched_getaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    share = max(1, len(cpus) // len(local))
    index = local.index(rank)
    return cpus[index * share : (index + 1) * share] or cpus[-share:]
