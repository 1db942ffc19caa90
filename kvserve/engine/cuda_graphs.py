"""DecodeGraphs: the decode step on a GPU, captured once per batch-size bucket as a CUDA graph.

Eager, a decode step of a small model is a few hundred kernel launches from Python, each costing more
than the kernel itself. At start every bucket's whole step (embedding, layers, final norm, lm_head ->
float32 logits) is captured once, largest bucket first, all graphs sharing one memory pool; a step of
B rows (a decode step: B sequences) then fills one static int32 buffer (token ids, positions, slots,
block tables, one attention tile per row), copies it to the device in one transfer and replays the graph
of the smallest bucket >= B. Padding rows write no KV (slot -1) and attend to nothing (tile length 0).

A row is a token, not a sequence: a short prompt, a chunk or a prompt joining the decodes runs in a
graph too, each of its tokens a row with its sequence's block table at its own position. The step's
KV writes come before its attention in every layer, so a row sees the keys of the rows before it as a
prefill's tile does; the attention kernel gives a token the same bits either way, as a matmul gives a
row (R7: fixed tile configurations, splits of the keys fixed by position, never by the batch). So
the graphs take every step of at most the largest bucket's tokens whose prompts' contexts are short
(GRAPH_CONTEXT: each such row reads its whole context, where a prefill's tile shares the reads), and
only the rest (long prefills, batches past the largest bucket) runs eagerly, a few hundred launches
from Python. A lone 60-token prompt's prefill was such an eager step.

Everything the engine guarantees stays with the scheduler, which never sees a graph: an abort, a
preemption or a finished request only changes what the next step's buffer holds.

With `layers/persistent_step.PERSISTENT_STEP` on (KVSERVE_PERSISTENT_STEP=1), the one-row graph runs a 4-bit
model's decoder layers as one kernel (kernels/gpu/persistent.py) instead of a kernel a phase: the same bits.

Running ahead (async scheduling, model_runner.py), the graphs read a row's token from the runner's
`token_slots` where the buffer names a slot (a step ahead: its token is being sampled on the device),
and `store_tokens` writes each row's draw to the slot the buffer names for it, both on the device.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from kvserve.engine.block_tables import BlockTableRows
from kvserve.layers.attention_triton import TritonAttentionMetadata, step_num_splits
from kvserve.layers.transfer import on_device

logger = logging.getLogger("kvserve.engine")

# Batch sizes with a graph of their own: small ones exactly, then every 16 (nano-vllm's buckets); a
# step pads its batch to the next one.
SMALL_BUCKETS = (1, 2, 4, 8)
BUCKET_STEP = 16
# A sequence adding several tokens runs in a graph while its context (its tokens so far and these) is at
# most this long: each of its rows reads the whole context, where an eager prefill's tile reads it once.
GRAPH_CONTEXT = 1024

# capture(fn, pool) -> (replay, out): records fn's kernels once, returning a callable that runs them
# again on whatever the static buffers then hold, and fn's output tensor, which each replay rewrites.
Capture = Callable[[Callable[[], torch.Tensor], object], tuple[Callable[[], None], torch.Tensor]]


def cuda_capture(fn: Callable[[], torch.Tensor], pool: object) -> tuple[Callable[[], None], torch.Tensor]:
    """A CUDA graph of fn, after one eager run that compiles and loads its kernels."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    # thread_local: another thread's CUDA work (a second engine in the process) does not break the capture
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = fn()
    return graph.replay, out


def eager_capture(fn: Callable[[], torch.Tensor], pool: object) -> tuple[Callable[[], None], torch.Tensor]:
    """Stands in for cuda_capture where there is no GPU (tests of the bookkeeping on a CPU, the kernels in
    Triton's interpreter): nothing is recorded, and a replay runs fn over the static buffers and writes
    its result into the captured output, empty until then. So a bucket that no step takes never runs here,
    where a GPU's capture runs each at start (tests/test_cuda.py); a run at capture cost the interpreter's
    GPU-path tests a quarter of their time, its result overwritten by the first replay."""
    out = torch.empty(0)

    def replay() -> None:
        result = fn()
        out.resize_(result.shape).copy_(result)

    return replay, out


def buckets_for(max_num_seqs: int) -> list[int]:
    """The batch sizes that get a graph: the buckets below max_num_seqs, and max_num_seqs itself."""
    sizes = [*SMALL_BUCKETS, *range(BUCKET_STEP, max_num_seqs, BUCKET_STEP)]
    return [b for b in sizes if b < max_num_seqs] + [max_num_seqs]


@dataclass(frozen=True)
class _Layout:
    """Where each input lives in the one static int32 buffer of `max_batch` rows."""

    max_batch: int
    max_blocks: int

    @property
    def sizes(self) -> list[int]:
        # token ids, positions, slots, tile lengths, tile rows (0..max_batch-1), token slots read (-1:
        # none), token slots written, block tables
        return [self.max_batch] * 7 + [self.max_batch * self.max_blocks]

    @property
    def total(self) -> int:
        return sum(self.sizes)


class DecodeGraphs:
    """Decode steps of a whole model (embedding to logits) as CUDA graphs, one per bucket."""

    def __init__(
        self,
        model: nn.Module,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        capture: Capture = cuda_capture,
        token_slots: torch.Tensor | None = None,
    ) -> None:
        self.model = model
        self.token_slots = token_slots  # running ahead: where steps ahead take their tokens
        self.block_size = block_size
        self.buckets = buckets_for(max_num_seqs)
        self.layout = _Layout(self.buckets[-1], math.ceil(max_model_len / block_size))
        device = next(model.parameters()).device
        self.host = torch.zeros(self.layout.total, dtype=torch.int32, pin_memory=device.type == "cuda")
        self.static = torch.zeros(self.layout.total, dtype=torch.int32, device=device)
        self.max_position = max_model_len - 1  # the furthest position a graph may meet
        # the host buffer is rewritten only once its last copy to the device is done (no sampler may have
        # read anything back since: a step whose rows all skip sampling)
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        self._capture = capture
        self._host_views = [v.numpy() for v in self._views(self.host)]  # made once: a step only fills them
        self._tables = BlockTableRows(self._host_views[-1])  # a row rewritten where its table changed
        self._bucket_of = [None] + [next(b for b in self.buckets if b >= n) for n in range(1, self.buckets[-1] + 1)]
        # per bucket, the prefix of the buffer its graph reads, on the device and here
        self._transfers = {}
        for bucket in self.buckets:
            used = self.layout.total - (self.layout.max_batch - bucket) * self.layout.max_blocks
            self._transfers[bucket] = (self.static[:used], self.host[:used])
        from kvserve.kernels.gpu.attention import attention_counters  # triton, imported on the GPU path only

        self._attention_counters = attention_counters(device)  # the graphs' own
        self.persistent = _persistent_step(model)  # the one-row graph's layers in one kernel, where on
        self._batch = 0  # rows of the last run
        self._replays: dict[int, Callable[[], None]] = {}
        self._logits: dict[int, torch.Tensor] = {}
        self.capture_seconds = 0.0

    def _views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        *rows, tables = buffer.split(self.layout.sizes)
        return [*rows, tables.view(self.layout.max_batch, self.layout.max_blocks)]

    def _fill_padding(self) -> None:
        """Every row a padding row: no KV write (slot -1), no attention (tile length 0), its token as
        given, its draw (if any) into the last token slot, which nobody reads."""
        ids, positions, slots, tile_len, rows, sources, sinks, tables = self._host_views
        ids[:], positions[:], slots[:], tile_len[:], tables[:], sources[:] = 0, 0, -1, 0, 0, -1
        self._tables.forget()
        sinks[:] = self._sink
        rows[:] = np.arange(self.layout.max_batch)

    @property
    def _sink(self) -> int:
        return self.token_slots.numel() - 1 if self.token_slots is not None else 0

    def _forward(self, batch: int) -> torch.Tensor:
        """The whole step for `batch` rows of the static buffers -> float32 logits [batch, vocab]."""
        ids, positions, slots, tile_len, rows, sources, _, tables = (v[:batch] for v in self._views(self.static))
        if self.token_slots is not None:  # a step ahead's token, from the slot its sampling step writes
            ids = torch.where(sources >= 0, self.token_slots[sources.clamp(min=0)], ids)
        metadata = TritonAttentionMetadata(
            slot_mapping=slots,
            block_tables=tables,
            positions=positions,
            tile_seq=rows,
            tile_first=rows,
            tile_len=tile_len,
            num_splits=step_num_splits([1] * batch, self.max_position),
            split_counters=self._attention_counters,
        )
        if batch == 1 and self.persistent is not None:
            return self.model.compute_logits(self.persistent(ids, positions, metadata))
        return self.model.compute_logits(self.model(ids, positions, metadata))

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every bucket's step, largest first (the others then fit in its memory pool)."""
        start = time.perf_counter()
        self._fill_padding()
        self.static.copy_(self.host)
        pool = torch.cuda.graph_pool_handle() if self.static.is_cuda else None
        for batch in reversed(self.buckets):
            self._replays[batch], self._logits[batch] = self._capture(lambda b=batch: self._forward(b), pool)
        self.capture_seconds = time.perf_counter() - start
        logger.info(
            "captured %d CUDA graphs of the decode step (batch sizes %s) in %.2f s",
            len(self.buckets),
            ", ".join(map(str, self.buckets)),
            self.capture_seconds,
        )

    def covers(self, num_new_tokens: list[int], num_computed: list[int], num_blocks: list[int]) -> bool:
        """Whether a step of sequences adding these token counts to these computed ones, with block tables
        of these lengths, runs as a graph: at most the largest bucket's tokens, and a sequence adding
        several within GRAPH_CONTEXT."""
        return (
            0 < sum(num_new_tokens) <= self.layout.max_batch
            and all(n == 1 or c + n <= GRAPH_CONTEXT for n, c in zip(num_new_tokens, num_computed, strict=True))
            and max(num_blocks) <= self.layout.max_blocks
        )

    def run(
        self,
        token_ids: list[int],
        num_computed_tokens: list[int],
        block_tables: list[list[int]],
        sources: list[int] | None = None,
        sinks: list[int] | None = None,
    ) -> torch.Tensor:
        """Float32 logits [B, vocab] of one step of B rows: row i adds token_ids[i] at position
        num_computed_tokens[i] of the sequence whose blocks are block_tables[i] (several rows of one
        sequence: consecutive positions, in order). A view of the bucket's output, valid until the next
        run. Running ahead, row i takes its token from token slot sources[i] where that is not -1, and
        `store_tokens` writes its draw to slot sinks[i] (-1: none)."""
        batch = len(token_ids)
        bucket = self._bucket_of[batch]
        size = self.block_size
        if self._copied is not None:
            self._copied.synchronize()
        ids, positions, slots, tile_len, _, source_view, sink_view, _ = self._host_views
        self._tables.write(block_tables)  # entries past a sequence's own blocks are never read
        row_slots = [  # each new token's slot
            table[computed // size] * size + computed % size
            for table, computed in zip(block_tables, num_computed_tokens, strict=True)
        ]
        ids[:batch], positions[:batch], slots[:batch], tile_len[:batch] = token_ids, num_computed_tokens, row_slots, 1
        if bucket > batch:
            ids[batch:bucket], positions[batch:bucket], slots[batch:bucket], tile_len[batch:bucket] = 0, 0, -1, 0
        if self.token_slots is not None:
            source_view[:batch] = sources if sources is not None else -1
            sink_view[:batch] = [self._sink if s < 0 else s for s in sinks] if sinks is not None else self._sink
            source_view[batch:bucket], sink_view[batch:bucket] = -1, self._sink
        # one transfer, of what the bucket's graph reads: the per-row values and its rows' block tables
        # (the tables come last, row by row: a prefix), not the largest bucket's whole table
        static, host = self._transfers[bucket]
        static.copy_(host, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        self._replays[bucket]()
        self._batch = batch
        return self._logits[bucket][:batch]

    def store_tokens(self, tokens: torch.Tensor, sinks: list[int] | None = None) -> None:
        """After the last run's sampler: its draws [B] (one per row) into the token slots the buffer
        names, on the device; or, where not every row samples (a prompt's rows but its last, a
        prefill-only request), its draws into the slots `sinks` names."""
        if sinks is None:
            index = self._views(self.static)[6][: self._batch].long()
        else:
            index = on_device(self.token_slots.device, sinks)
        self.token_slots.index_copy_(0, index, tokens.int())


def _persistent_step(model: nn.Module):
    """The model's `PersistentStep` where `PERSISTENT_STEP` is on and the model takes it, else None (logged)."""
    from kvserve.layers import persistent_step

    if not persistent_step.PERSISTENT_STEP:
        return None
    reason = persistent_step.PersistentStep.unsupported(model)
    if reason is not None:
        logger.info("the one-row decode graph launches a kernel a phase (the persistent step is off: %s)", reason)
        return None
    logger.info("the one-row decode graph runs the decoder layers in one kernel (the persistent step)")
    return persistent_step.PersistentStep(model)
