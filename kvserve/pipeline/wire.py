"""One message between two ranks over torch.distributed point-to-point (gloo): a header of five
int64 (kind, the payload's bytes, the tensor's rows, its columns, its dtype), the payload (a pickled
plan or result, or none), the tensor (or none). Three sends, each of a size the receiver knows."""

from __future__ import annotations

import enum
import pickle
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from kvserve.engine.model_runner import RunnerOutput
from kvserve.engine.scheduler import ScheduledRequest
from kvserve.pipeline.deltas import Histories, Tables

DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# Tags keep the two directions apart where one pair of ranks carries both (two stages).
TAG_DOWN = 1  # a stage to the next: steps, shutdown
TAG_BACK = 2  # the last stage to rank 0: results, closed


class Kind(enum.IntEnum):
    STEP = 1  # payload: a StepPlan; tensor: the residual stream after the sender's layers
    RESULT = 2  # payload: a StepResult (last stage -> rank 0)
    SHUTDOWN = 3  # every stage stops; the last answers CLOSED
    CLOSED = 4


@dataclass
class StepPlan:
    """What every stage needs of one step: rank 0's scheduled requests (their block tables, and where the
    last stage's sampler reads them their prompts and outputs, only as far as they are new since the
    request's last plan: `tables` and `histories`, pipeline/deltas.py), the requests finished since the
    last plan (the stages drop their copies, the last stage their random generators) and, once a stage
    failed, why (the later stages pass it on unrun)."""

    ticket: int
    items: list[ScheduledRequest]
    released: list[str] = field(default_factory=list)
    error: str | None = None
    stage_seconds: list[float] = field(default_factory=list)  # each stage's compute time so far, in order
    histories: Histories = field(default_factory=dict)
    tables: Tables = field(default_factory=dict)


@dataclass
class StepResult:
    ticket: int
    output: RunnerOutput | None = None
    error: str | None = None
    stage_seconds: list[float] = field(default_factory=list)


def send(group: dist.ProcessGroup, dst: int, tag: int, kind: Kind, payload: Any = None, tensor=None) -> int:
    """Send one message; returns the bytes sent."""
    data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL) if payload is not None else b""
    rows, cols, dtype = (
        (tensor.shape[0], tensor.shape[1], DTYPES.index(tensor.dtype)) if tensor is not None else (0, 0, 0)
    )
    header = torch.tensor([int(kind), len(data), rows, cols, dtype], dtype=torch.int64)
    group.send([header], dst, tag).wait()
    if data:
        group.send([torch.frombuffer(bytearray(data), dtype=torch.uint8)], dst, tag).wait()
    if tensor is not None:  # gloo sends from host memory: a GPU stage's activations go through it
        group.send([tensor.to("cpu").contiguous().view(torch.uint8)], dst, tag).wait()
    return header.numel() * 8 + len(data) + (tensor.numel() * tensor.element_size() if tensor is not None else 0)


def recv(group: dist.ProcessGroup, src: int, tag: int) -> tuple[Kind, Any, torch.Tensor | None]:
    """Receive one message: (kind, payload or None, tensor or None). Raises RuntimeError if the peer's
    connection closes (its process died)."""
    header = torch.empty(5, dtype=torch.int64)
    group.recv([header], src, tag).wait()
    kind, size, rows, cols, dtype_index = header.tolist()
    payload = None
    if size:
        data = torch.empty(size, dtype=torch.uint8)
        group.recv([data], src, tag).wait()
        payload = pickle.loads(data.numpy().tobytes())
    tensor = None
    if rows:
        dtype = DTYPES[dtype_index]
        raw = torch.empty(rows, cols * dtype.itemsize, dtype=torch.uint8)
        group.recv([raw], src, tag).wait()
        tensor = raw.view(dtype)
    return Kind(kind), payload, tensor
