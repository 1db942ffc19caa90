"""A stage's share of the model, on any rank (or the whole model, a pipeline of one): its layers
(and the embedding, or the final norm and lm_head, where it has them) loaded from the model file,
and a ModelRunner over them with a KV pool for those layers alone, sized by rank 0 so that a block id
means the same slots on every stage."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from kvserve.engine.kv_cache import kv_cache_bytes_per_token
from kvserve.engine.model_runner import ModelRunner
from kvserve.errors import InvalidRequestError, first_line
from kvserve.pipeline.rendezvous import EngineSizes
from kvserve.pipeline.topology import Topology, stage_cpus, stage_layers
from kvserve.weights.loader import load_config, load_model

logger = logging.getLogger("kvserve.pipeline")


@dataclass(frozen=True)
class StageSpec:
    """How every stage loads and runs its share (the LLM's resolved settings); the same on every rank,
    which rank 0 checks (rendezvous.introduce)."""

    model: str  # a model file or folder on this host
    dtype: torch.dtype
    weights: str  # the WeightPlan mode
    activations: str
    kv_cache_dtype: torch.dtype
    batch_invariant: bool
    device: str = "cpu"  # torch.device's spelling, "cuda:1" included
    cuda_graphs: bool = True  # decode steps of a whole model on a GPU replay CUDA graphs (engine/cuda_graphs.py)
    async_scheduling: bool = False  # a whole model's runner queues step n+1 before taking back step n

    def settings(self, stages: int) -> dict[str, object]:
        """What must be the same on every rank, besides kvserve's version and the model file."""
        return {
            "stages": stages,
            "dtype": self.dtype,
            "weights": self.weights,
            "activations": self.activations,
            "kv_cache_dtype": self.kv_cache_dtype,
            "batch_invariant": self.batch_invariant,
            "device": torch.device(self.device).type,
        }


def bind_cpus(topology: Topology, rank: int) -> None:
    """Compute on this rank's share of the node's CPUs (topology.stage_cpus) from the calling thread:
    on Linux the thread's affinity, which its OpenMP team inherits, and torch's thread count, which is
    the process's: threads this process starts later begin with it too (each C++ library re-reads it
    on a thread's first parallel region, so it cannot be set for one thread alone)."""
    cpus = stage_cpus(topology, rank)
    if cpus:
        os.sched_setaffinity(0, cpus)
        torch.set_num_threads(len(cpus))


def stage_of(spec: StageSpec, topology: Topology, rank: int) -> tuple[int, int]:
    """The layers [first, end) of stage `rank`."""
    first, end = stage_layers(load_config(spec.model).num_hidden_layers, topology.stages, rank)
    logger.info("pipeline stage %d of %d: layers %d..%d of %s", rank, topology.stages, first, end - 1, spec.model)
    return first, end


def build_stage(spec: StageSpec, layers: tuple[int, int], sizes: EngineSizes, progress: bool) -> ModelRunner:
    """The model's layers [first, end) and a runner over them; (0, num_hidden_layers) is the whole
    model, as LLM runs it without a pipeline. Call on the thread that computes with it."""
    device = torch.device(spec.device)
    # each out-of-memory error is read inside its `except` and raised as ours after it: the error's
    # traceback (which holds the tensors made so far) is gone by then, so a retry has the memory back
    failed, free = None, _free_memory(device)
    try:
        model = load_model(
            spec.model,
            spec.dtype,
            device,
            progress=progress,
            weights=spec.weights,
            activations=spec.activations,
            stage=layers,
        )
    except RuntimeError as exc:
        failed = _out_of_memory(exc)
        if failed is None:
            raise
    if failed is not None:
        smaller = [] if spec.weights in ("q4", "q8") else ["weights=q4 or q8 (--weights)"]
        smaller.append("a smaller model")
        if device.type == "cuda":
            smaller.append("the CPU (device='cpu'; for kvserve serve, CUDA_VISIBLE_DEVICES='')")
        raise InvalidRequestError(
            f"{spec.model}'s weights do not fit in {_memory(device, free, 'before them')} ({failed}); use "
            f"{' or '.join(smaller)}.",
            "weights",
        )
    free = _free_memory(device)
    try:
        return ModelRunner(
            model,
            sizes.num_kv_blocks,
            sizes.block_size,
            sizes.stop_token_ids,
            spec.kv_cache_dtype,
            spec.batch_invariant,
            sizes.max_num_seqs,
            sizes.max_model_len,
            spec.cuda_graphs,
            spec.async_scheduling,
        )
    except RuntimeError as exc:
        failed = _out_of_memory(exc)
        if failed is None:
            raise
    tokens = sizes.num_kv_blocks * sizes.block_size
    pool = tokens * kv_cache_bytes_per_token(model.config, spec.kv_cache_dtype) * len(model.layers)
    pool //= model.config.num_hidden_layers  # this stage's layers'
    del model
    raise InvalidRequestError(
        f"A KV cache of {tokens} tokens ({_size(pool)}) and the decode steps' buffers do not fit in "
        f"{_memory(device, free, 'after the weights')} ({failed}); lower kv_cache_tokens or max_num_seqs.",
        "kv_cache_tokens",
    )


def _out_of_memory(exc: RuntimeError) -> str | None:
    """The first line of an allocation's failure: torch's on a GPU, Triton's where a kernel could not be
    loaded, the CPU allocator's; None for any other error."""
    text = str(exc)
    if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in text or "can't allocate memory" in text:
        return first_line(text, "out of memory")
    return None


def _free_memory(device: torch.device) -> tuple[int, int] | None:
    """A GPU's free and total bytes now (None on the CPU)."""
    return torch.cuda.mem_get_info(device) if device.type == "cuda" else None


def _memory(device: torch.device, free: tuple[int, int] | None, when: str) -> str:
    """The memory the failed allocations had, in words."""
    if free is None:
        return "this machine's memory"
    name = torch.cuda.get_device_name(device)
    return f"{name}'s memory ({_size(free[0])} of {_size(free[1])} free {when})"


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.1f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.1f} MiB"
