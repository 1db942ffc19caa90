"""ModelRunner: owns the model and the KV pool tensors; turns a SchedulerOutput into token ids.

One forward over the flattened batch per step; logits only for the rows that sample.

On the CPU every step (decode, prefill, chunks, prefix hits, mixed) runs through the C++ layer
loop, each token attending to its own sequence's cache up to its own position: a token's
arithmetic is the same in every kind of step and beside any other tokens (batch invariance, on by
default). With batch_invariant=False, steps of fresh prompts take the faster causal prefill
attention and large batches the GEMM over dequantized weights.

On a GPU the model's Python forward runs over the Triton kernels (layers/gpu.py,
layers/attention_triton.py), which keep the same promise, and decode steps replay CUDA graphs
(engine/cuda_graphs.py). The Python forward with PyTorch's attention serves where neither can (no
compiler, KVSERVE_FUSED_DECODE=0).

Async scheduling (`runs_ahead`, on a GPU by default): `execute` queues a step and its sampler on the
device and returns; `collect` hands back the oldest step's tokens once the device has them, while the
step after it is already queued, so the GPU never waits for the host's bookkeeping. A step scheduled
ahead of its request's sampling step (scheduler.AHEAD) takes that token on the device: every sampling
row writes its token into the request's slot of `token_slots`, which the next step's embedding reads.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from kvserve.engine.block_tables import BlockTableRows
from kvserve.engine.cuda_graphs import DecodeGraphs, cuda_capture, eager_capture
from kvserve.engine.kv_cache import allocate_kv_cache
from kvserve.engine.sampler import Sampled, Sampler, SamplingRow, TokenLogprobs, draws_by_seed
from kvserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from kvserve.engine.seed_stream import SeedStream
from kvserve.kernels import build
from kvserve.layers import fused_decode
from kvserve.layers.attention import build_batch
from kvserve.layers.attention_triton import build_triton_batch
from kvserve.layers.fused_decode import FusedDecoder
from kvserve.layers.gpu import fuse_epilogues, uses_triton
from kvserve.layers.quantized import set_batch_invariant
from kvserve.layers.transfer import on_device


@dataclass
class RunnerTimings:
    """Seconds spent per phase, summed over steps (Python overhead = prepare + postprocess)."""

    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    steps: int = 0
    fused_steps: int = 0  # steps run by the C++ layer loop, each token with its own block table
    fused_prefills: int = 0  # steps of fresh prompts only, run by the same loop
    graph_steps: int = 0  # steps replayed as a CUDA graph (GPU): decodes, short prompts
    ahead_rows: int = 0  # rows scheduled ahead, their token read on the device (async scheduling)

    def as_dict(self) -> dict[str, float]:
        return {
            "prepare_s": self.prepare,
            "forward_s": self.forward,
            "sample_s": self.sample,
            "steps": self.steps,
            "fused_steps": self.fused_steps,
            "fused_prefills": self.fused_prefills,
            "graph_steps": self.graph_steps,
            "ahead_rows": self.ahead_rows,
        }


@dataclass
class RunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)


class ModelRunner:
    """Computes each step in this process: at once (the engine's Runner with depth 1), or running ahead
    (depth 2: a step queued behind the one whose result `collect` waits for)."""

    def __init__(
        self,
        model: torch.nn.Module,
        num_blocks: int,
        block_size: int,
        stop_token_ids: tuple[int, ...] = (),
        kv_cache_dtype: torch.dtype | None = None,
        batch_invariant: bool = True,
        max_num_seqs: int = 64,
        max_model_len: int = 2048,
        cuda_graphs: bool = True,
        async_scheduling: bool = False,
    ) -> None:
        """`max_num_seqs` and `max_model_len` size the CUDA graphs (GPU, a whole model, `cuda_graphs`):
        captured here, so start-up includes them. Without a GPU (KVSERVE_KERNELS=triton on a CPU) the
        graphs' bookkeeping runs with each replay computed eagerly, for tests. `async_scheduling` runs
        ahead where the step runs on the Triton kernels (a whole model: the sampler is here)."""
        self.model = model
        self.batch_invariant = batch_invariant
        set_batch_invariant(model, batch_invariant)
        fuse_epilogues(model)  # on a GPU, after it: a float layer through cuBLAS has no epilogue
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        if self.device.type == "cuda" and self.device.index is not None:
            # built on the thread that runs the steps: its events, streams and Triton's launches are the
            # current device's, which must be the model's (cuda:1's copies are not on cuda:0's stream)
            torch.cuda.set_device(self.device)
        self.block_size = block_size
        # the KV pool in the compute dtype unless told (LLM's kv_cache_dtype)
        self.kv_caches = allocate_kv_cache(
            model.config, num_blocks, block_size, kv_cache_dtype or self.dtype, self.device, len(model.layers)
        )
        model.bind_kv_cache(self.kv_caches)
        self.sampler = Sampler()
        self.stop_token_ids = stop_token_ids
        self.generators: dict[str, SeedStream] = {}
        self.timings = RunnerTimings()
        # Steps on the CPU go through the fused C++ layer loop. Batch-invariant, the engine waits for
        # its build (once per machine), so that no step's path depends on when the build finished;
        # otherwise it builds in the background and the Python forward serves until then.
        self.fused: FusedDecoder | None = None
        self._table_rows: BlockTableRows | None = None  # the C++ loop's block tables, kept from step to step
        self._table_shape = (max_num_seqs, -(-max_model_len // block_size))
        self.triton = uses_triton(self.device)
        self.wants_fused = not self.triton and FusedDecoder.supports(model) and build.is_enabled()
        if self.wants_fused and batch_invariant:
            build.load()
        elif self.wants_fused:
            build.start_loading()
        # the eager steps' counters for merging attention splits in the kernel (kernels/gpu/attention.py)
        self.attention_counters = None
        if self.triton:
            from kvserve.kernels.gpu.attention import attention_counters

            self.attention_counters = attention_counters(self.device)
        whole = model.has_embedding and model.has_head
        self.runs_ahead = async_scheduling and self.triton and whole
        self.depth = 2 if self.runs_ahead else 1
        self.token_slots: torch.Tensor | None = None
        if self.runs_ahead:
            # A slot per request with a sampling step in flight: at most two steps' requests, and the
            # last slot takes the draws of rows that need none (a graph's rows all write one).
            self.token_slots = torch.zeros(2 * max_num_seqs + 1, dtype=torch.int32, device=self.device)
        self._free_slots = list(range(2 * max_num_seqs)) if self.runs_ahead else []
        self._slot_of: dict[str, int] = {}
        self._samples_in_flight: dict[str, int] = {}  # request id -> its sampling steps not collected
        self._taken: list[str] = []  # the slots the step being queued took
        self._drawn: list = []  # its seeded rows' streams, marked before its draws
        self._pending: deque[tuple[int, Sampled, list[str]]] = deque()  # (ticket, draws, their request ids)
        self.graphs: DecodeGraphs | None = None
        if self.triton and cuda_graphs and whole:
            capture = cuda_capture if self.device.type == "cuda" else eager_capture
            self.graphs = DecodeGraphs(model, block_size, max_num_seqs, max_model_len, capture, self.token_slots)
            self.graphs.capture_all()

    @property
    def tokens_per_tile(self) -> int:
        """Consecutive query tokens of a sequence that one program of the Triton attention takes."""
        from kvserve.kernels.gpu.attention import tokens_per_tile

        config = self.model.config
        return tokens_per_tile(config.num_attention_heads, config.num_key_value_heads)

    def _fused_decoder(self) -> FusedDecoder | None:
        if self.fused is None and self.wants_fused and build.loaded() is not None:
            self.fused = fused_decode.make_fused_decoder(self.model, wait=False)
        return self.fused

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, ticket: int = 0) -> RunnerOutput | None:
        """The step's result; running ahead, None: the step is queued, and `collect` hands it back."""
        items = out.scheduled
        self._taken.clear()
        self._drawn = []
        try:
            if self.graphs is not None and self.graphs.covers(
                [len(s.token_ids) for s in items],
                [s.num_computed_tokens for s in items],
                [len(s.block_ids) for s in items],
            ):
                sampled, ids = self._execute_graph(items)
            else:
                sampled, ids = self._launch_from_hidden(items, self.forward(items))
                if sampled is not None and self.runs_ahead:
                    sinks = on_device(self.device, [self._take_slot(i) for i in ids])
                    self.token_slots.index_copy_(0, sinks, sampled.tokens.int())
        except Exception:  # not queued: EngineCore re-runs its requests, with their slots and draws as before
            for request_id in self._taken:
                self._put_slot(request_id)
            for stream, mark in self._drawn:
                stream.restore(mark)
            raise
        if not self.runs_ahead:
            return self._output(sampled, ids)
        self._pending.append((ticket, sampled, ids))
        return None

    @property
    def num_pending(self) -> int:
        """Steps queued (running ahead) whose results `collect` has not handed back."""
        return len(self._pending)

    def collect(self) -> tuple[int, RunnerOutput | Exception]:
        """The oldest queued step's (ticket, result), once the device has computed it; an exception
        where copying its results back failed (the device's own failure)."""
        ticket, sampled, ids = self._pending.popleft()
        t0 = time.perf_counter()
        try:
            outcome: RunnerOutput | Exception = self._output(sampled, ids)
        except Exception as exc:
            outcome = exc
        for request_id in ids:
            self._put_slot(request_id)
        self.timings.sample += time.perf_counter() - t0
        return ticket, outcome

    def _take_slot(self, request_id: str) -> int:
        """The token slot of a request whose sampling step is being queued."""
        if request_id not in self._slot_of:
            self._slot_of[request_id] = self._free_slots.pop()
        self._samples_in_flight[request_id] = self._samples_in_flight.get(request_id, 0) + 1
        self._taken.append(request_id)
        return self._slot_of[request_id]

    def _put_slot(self, request_id: str) -> None:
        """One of a request's sampling steps is back: its slot is free once no step in flight writes it."""
        self._samples_in_flight[request_id] -= 1
        if not self._samples_in_flight[request_id]:
            del self._samples_in_flight[request_id]
            self._free_slots.append(self._slot_of.pop(request_id))

    def _step_tokens(self, items: list[ScheduledRequest]) -> tuple[list[list[int]], list[int] | None]:
        """Per item, its token ids and the token slot its token comes from (-1: the ids as given); None
        for the slots if no item takes one. An item ahead reads the slot of its request's sampling step
        in flight, or, where that step is back already (nothing queues a step between scheduling one
        and running it but a test's gate), the token it appended on the host."""
        tokens, sources = [], []
        for s in items:
            if not s.ahead:
                tokens.append(s.token_ids)
                sources.append(-1)
            elif s.request_id in self._slot_of:
                self.timings.ahead_rows += 1
                tokens.append([0])
                sources.append(self._slot_of[s.request_id])
            else:  # (an output list without it: the request was aborted, and this step's token is dropped)
                index = s.num_computed_tokens - len(s.prompt_token_ids)
                tokens.append([s.output_token_ids[index] if index < len(s.output_token_ids) else 0])
                sources.append(-1)
        return tokens, sources if any(source >= 0 for source in sources) else None

    def _execute_graph(self, items: list[ScheduledRequest]) -> tuple[Sampled | None, list[str]]:
        """A step replayed as the CUDA graph of its bucket, a row per token (`DecodeGraphs.run`), then
        the sampler on the rows that sample (each sampling sequence's last token)."""
        t0 = time.perf_counter()
        ends, rows, ids = self._sampling_rows(items)
        tokens, sources = self._step_tokens(items)
        if all(len(t) == 1 for t in tokens):  # decode: a row a sequence (5x less host time at 64 rows)
            row_ids, positions = [t[0] for t in tokens], [s.num_computed_tokens for s in items]
            tables, row_sources = [s.block_ids for s in items], sources
        else:  # a row a token: consecutive positions of its sequence
            row_ids, positions, tables, row_sources = [], [], [], []
            for index, s in enumerate(items):
                count = len(tokens[index])
                row_ids += tokens[index]
                positions += range(s.num_computed_tokens, s.num_computed_tokens + count)
                tables += [s.block_ids] * count
                row_sources += [sources[index] if sources is not None else -1] * count
        sinks = None
        if self.runs_ahead:  # a sampling sequence's last row draws into its request's slot
            sinks = [-1] * len(row_ids)
            for end, request_id in zip(ends, ids, strict=True):
                sinks[end] = self._take_slot(request_id)
        t1 = time.perf_counter()
        logits = self.graphs.run(row_ids, positions, tables, *((row_sources, sinks) if sinks is not None else ()))
        every_row_samples = len(ends) == len(row_ids)
        if not every_row_samples:  # a prompt's rows but its last; a prefill-only request
            logits = logits[on_device(self.device, ends)]
        t2 = time.perf_counter()
        sampled = self._launch_sample(logits, rows, ids) if ends else None
        if sampled is not None and sinks is not None:
            self.graphs.store_tokens(sampled.tokens, None if every_row_samples else [sinks[i] for i in ends])
        self.timings.prepare += t1 - t0
        self.timings.forward += t2 - t1
        self.timings.sample += time.perf_counter() - t2
        self.timings.steps += 1
        self.timings.graph_steps += 1
        return sampled, ids

    @torch.inference_mode()
    def forward(self, items: list[ScheduledRequest], hidden: torch.Tensor | None = None) -> torch.Tensor:
        """The step's T tokens through this model's layers, [T, hidden]: from their embeddings, or (a
        later pipeline stage) from the previous stage's residual stream `hidden`; after the final
        norm where the model has it (else the residual stream for the next stage)."""
        t0 = time.perf_counter()
        forward = self._prepare_forward(items, hidden)
        t1 = time.perf_counter()
        out = forward()
        self.timings.prepare += t1 - t0
        self.timings.forward += time.perf_counter() - t1
        self.timings.steps += 1
        return out

    @torch.inference_mode()
    def sample(self, items: list[ScheduledRequest], hidden: torch.Tensor) -> RunnerOutput:
        """The next token of every request that samples this step, from `forward`'s hidden states:
        logits from the lm_head (float32), then the sampler (the model's last stage)."""
        return self._output(*self._launch_from_hidden(items, hidden))

    def _launch_from_hidden(
        self, items: list[ScheduledRequest], hidden: torch.Tensor
    ) -> tuple[Sampled | None, list[str]]:
        """`sample`'s logits and draws, launched; None where no row samples."""
        t0 = time.perf_counter()
        ends, rows, ids = self._sampling_rows(items)
        t1 = time.perf_counter()
        logits = self.model.compute_logits(hidden[on_device(self.device, ends)]) if ends else None
        t2 = time.perf_counter()
        sampled = self._launch_sample(logits, rows, ids) if logits is not None else None
        self.timings.prepare += t1 - t0
        self.timings.forward += t2 - t1
        self.timings.sample += time.perf_counter() - t2
        return sampled, ids

    def _prepare_forward(self, items: list, hidden: torch.Tensor | None) -> Callable[[], torch.Tensor]:
        """The step's forward (hidden states [T, hidden] for its T tokens), its inputs built now, on
        one of four paths: the C++ layer loop with each token's own block table (every CPU step by
        default); the C++ loop's causal prefill for fresh prompts (batch invariance off); the
        model's Python forward over the Triton kernels (GPU); over PyTorch's attention (no compiler)."""
        if hidden is None:
            tokens, sources = self._step_tokens(items)
            input_ids = on_device(self.device, [t for ids in tokens for t in ids])
            if sources is not None:  # steps ahead: their tokens from the slots their sampling steps write
                src = on_device(self.device, [source for ids, source in zip(tokens, sources, strict=True) for _ in ids])
                input_ids = torch.where(src >= 0, self.token_slots[src.clamp(min=0)].long(), input_ids)
            hidden = self.model.embed(input_ids)  # [T, hidden]
        else:
            hidden = hidden.to(self.device)
        # the step's sequences: block tables, tokens already in them, tokens added now
        batch = (
            [s.block_ids for s in items],
            [s.num_computed_tokens for s in items],
            [len(s.token_ids) for s in items],
        )
        if self.triton:
            positions, metadata = build_triton_batch(
                *batch, self.block_size, self.tokens_per_tile, self.device, self.attention_counters
            )
            return lambda: self.model.run_layers(hidden, positions, metadata)
        fused = self._fused_decoder()
        if fused is not None and (self.batch_invariant or any(s.num_computed_tokens for s in items)):
            inputs = self._token_inputs(items)

            def per_token() -> torch.Tensor:
                self.timings.fused_steps += 1
                return fused.forward_hidden(hidden, *inputs)

            return per_token
        positions, metadata = build_batch(*batch, self.block_size, self.device)
        if fused is not None:
            starts = [0, *itertools.accumulate(batch[2])]

            def fresh_prompts() -> torch.Tensor:
                self.timings.fused_prefills += 1
                return fused.prefill_hidden(hidden, positions, metadata.slot_mapping, starts)

            return fresh_prompts
        return lambda: self.model.run_layers(hidden, positions, metadata)

    def _sampling_rows(self, items: list) -> tuple[list[int], list[SamplingRow], list[str]]:
        """The rows that sample this step: each one's last token's index in the step, its sampling
        state, its request id."""
        ends, rows, ids = [], [], []
        offset = 0
        for s in items:
            offset += len(s.token_ids)
            if s.sample:
                ends.append(offset - 1)
                ids.append(s.request_id)
                generator = self._generator(s)
                rows.append(
                    SamplingRow(
                        s.params,
                        s.prompt_token_ids,
                        s.output_token_ids,
                        generator,
                        self.stop_token_ids,
                        s.token_bitmask,
                        s.request_id,
                    )
                )
        return ends, rows, ids

    def _launch_sample(self, logits: torch.Tensor, rows: list[SamplingRow], ids: list[str]) -> Sampled:
        # A failed step is re-run (EngineCore confines failures): a draw must not advance twice.
        seeded = [(r.generator, r.generator.mark()) for r in rows if r.generator is not None]
        try:
            sampled = self.sampler.launch(logits, rows)
            self._drawn = seeded  # put back too if the step fails after its draws (execute)
            return sampled
        except Exception:
            for stream, mark in seeded:
                stream.restore(mark)
            raise

    @staticmethod
    def _output(sampled: Sampled | None, ids: list[str]) -> RunnerOutput:
        if sampled is None:
            return RunnerOutput()
        tokens, logprobs = sampled.result()
        return RunnerOutput(
            sampled=dict(zip(ids, tokens, strict=True)),
            logprobs={i: lp for i, lp in zip(ids, logprobs, strict=True) if lp is not None},
        )

    def _token_inputs(self, items: list) -> tuple[torch.Tensor, ...]:
        """(positions, slot_mapping, block_tables, seq_lens) per token of a step for the C++ loop: each
        token's row of block_tables is its sequence's table, and it attends to seq_lens = position + 1
        keys, its own included."""
        size = self.block_size
        positions: list[int] = []
        slots: list[int] = []
        for s in items:
            first = s.num_computed_tokens
            span = range(first, first + len(s.token_ids))
            positions.extend(span)
            slots.extend(s.block_ids[p // size] * size + p % size for p in span)
        width = max(len(s.block_ids) for s in items)
        tables = torch.from_numpy(self._block_table_rows(items, width)[: len(items), :width].copy())
        if len(positions) > len(items):  # some sequence adds several tokens: one table row per token
            counts = torch.tensor([len(s.token_ids) for s in items])
            tables = tables.repeat_interleave(counts, dim=0)
        position_tensor = torch.tensor(positions, dtype=torch.long)
        return position_tensor, torch.tensor(slots, dtype=torch.long), tables, position_tensor + 1

    def _block_table_rows(self, items: list, width: int) -> np.ndarray:
        """The step's block tables, one row an item padded with zeros, in the buffer kept for them (grown
        to fit): rewritten where they changed since the last step."""
        rows = self._table_rows
        if rows is None or rows.buffer.shape[0] < len(items) or rows.buffer.shape[1] < width:
            shape = np.maximum(self._table_shape if rows is None else rows.buffer.shape, (len(items), width))
            rows = self._table_rows = BlockTableRows(np.zeros(shape, dtype=np.int64))
        rows.write([s.block_ids for s in items])
        return rows.buffer

    def release(self, request_ids: list[str]) -> None:
        """Forget per-request state (generators, penalties' histories) of finished requests."""
        for request_id in request_ids:
            self.generators.pop(request_id, None)
        self.sampler.release(request_ids)

    def close(self) -> None:
        """Let the KV pool (and the graphs' memory) go now, on the engine thread's way out, rather than
        whenever a garbage collection reaches a reference cycle around the LLM: the model's layers hold
        the pool, and a test suite or an application that makes LLMs one after another would otherwise
        keep a GiB per LLM until then. The model is not used again (the engine is closed)."""
        for layer in self.model.layers:
            layer.self_attn.k_cache = layer.self_attn.v_cache = None
        self.kv_caches = []
        self.fused = None  # holds the pool too
        self.graphs = None

    def _generator(self, s) -> SeedStream | None:
        """A seeded request's stream of seeds: on the host on every device, as the sampler's kernels take
        one seed a row and step from it (a GPU's generator would need its draw copied back)."""
        seed = s.params.seed
        if seed is None or s.params.is_greedy:
            return None
        stream = self.generators.get(s.request_id)
        if stream is None:
            stream = SeedStream(seed, direct=not draws_by_seed(self.device))
            self.generators[s.request_id] = stream
        return stream
