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
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvserve.engine.cuda_graphs import DecodeGraphs, cuda_capture, eager_capture
from kvserve.engine.kv_cache import allocate_kv_cache
from kvserve.engine.sampler import Sampler, SamplingRow, TokenLogprobs
from kvserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from kvserve.kernels import build
from kvserve.layers import fused_decode
from kvserve.layers.attention import build_batch
from kvserve.layers.attention_triton import build_triton_batch
from kvserve.layers.fused_decode import FusedDecoder
from kvserve.layers.gpu import uses_triton
from kvserve.layers.quantized import set_batch_invariant


@dataclass
class RunnerTimings:
    """Seconds spent per phase, summed over steps (Python overhead = prepare + postprocess)."""

    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    steps: int = 0
    fused_steps: int = 0  # steps run by the C++ layer loop, each token with its own block table
    fused_prefills: int = 0  # steps of fresh prompts only, run by the same loop
    graph_steps: int = 0  # decode steps replayed as a CUDA graph (GPU)

    def as_dict(self) -> dict[str, float]:
        return {
            "prepare_s": self.prepare,
            "forward_s": self.forward,
            "sample_s": self.sample,
            "steps": self.steps,
            "fused_steps": self.fused_steps,
            "fused_prefills": self.fused_prefills,
            "graph_steps": self.graph_steps,
        }


@dataclass
class RunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)


class ModelRunner:
    """Computes each step in this process, at once (the engine's Runner with depth 1)."""

    depth = 1

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
    ) -> None:
        """`max_num_seqs` and `max_model_len` size the CUDA graphs (GPU, a whole model, `cuda_graphs`):
        captured here, so start-up includes them. Without a GPU (KVSERVE_KERNELS=triton on a CPU) the
        graphs' bookkeeping runs with each replay computed eagerly, for tests."""
        self.model = model
        self.batch_invariant = batch_invariant
        set_batch_invariant(model, batch_invariant)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.block_size = block_size
        # the KV pool in the compute dtype unless told (LLM's kv_cache_dtype)
        self.kv_caches = allocate_kv_cache(
            model.config, num_blocks, block_size, kv_cache_dtype or self.dtype, self.device, len(model.layers)
        )
        model.bind_kv_cache(self.kv_caches)
        self.sampler = Sampler()
        self.stop_token_ids = stop_token_ids
        self.generators: dict[str, torch.Generator] = {}
        self.timings = RunnerTimings()
        # Steps on the CPU go through the fused C++ layer loop. Batch-invariant, the engine waits for
        # its build (once per machine), so that no step's path depends on when the build finished;
        # otherwise it builds in the background and the Python forward serves until then.
        self.fused: FusedDecoder | None = None
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
        self.graphs: DecodeGraphs | None = None
        if self.triton and cuda_graphs and model.has_embedding and model.has_head:
            capture = cuda_capture if self.device.type == "cuda" else eager_capture
            self.graphs = DecodeGraphs(model, block_size, max_num_seqs, max_model_len, capture)
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
    def execute(self, out: SchedulerOutput, ticket: int = 0) -> RunnerOutput:
        items = out.scheduled
        if self.graphs is not None and self.graphs.covers(
            [len(s.token_ids) for s in items], [len(s.block_ids) for s in items]
        ):
            return self._execute_graph(items)
        return self.sample(items, self.forward(items))

    def _execute_graph(self, items: list[ScheduledRequest]) -> RunnerOutput:
        """A decode step replayed as the CUDA graph of its bucket, then the sampler."""
        t0 = time.perf_counter()
        ends, rows, ids = self._sampling_rows(items)
        t1 = time.perf_counter()
        logits = self.graphs.run(
            [s.token_ids[0] for s in items], [s.num_computed_tokens for s in items], [s.block_ids for s in items]
        )
        if len(ends) < len(items):  # a prefill-only request ending on one token samples nothing
            logits = logits[torch.tensor(ends, device=self.device)]
        t2 = time.perf_counter()
        result = self._sample(logits, rows, ids) if ends else RunnerOutput()
        self.timings.prepare += t1 - t0
        self.timings.forward += t2 - t1
        self.timings.sample += time.perf_counter() - t2
        self.timings.steps += 1
        self.timings.graph_steps += 1
        return result

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
        t0 = time.perf_counter()
        ends, rows, ids = self._sampling_rows(items)
        t1 = time.perf_counter()
        logits = self.model.compute_logits(hidden[torch.tensor(ends, device=self.device)]) if ends else None
        t2 = time.perf_counter()
        result = self._sample(logits, rows, ids) if logits is not None else RunnerOutput()
        self.timings.prepare += t1 - t0
        self.timings.forward += t2 - t1
        self.timings.sample += time.perf_counter() - t2
        return result

    def _prepare_forward(self, items: list, hidden: torch.Tensor | None) -> Callable[[], torch.Tensor]:
        """The step's forward (hidden states [T, hidden] for its T tokens), its inputs built now, on
        one of four paths: the C++ layer loop with each token's own block table (every CPU step by
        default); the C++ loop's causal prefill for fresh prompts (batch invariance off); the
        model's Python forward over the Triton kernels (GPU); over PyTorch's attention (no compiler)."""
        if hidden is None:
            input_ids = torch.tensor([t for s in items for t in s.token_ids], dtype=torch.long).to(self.device)
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
                    )
                )
        return ends, rows, ids

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow], ids: list[str]) -> RunnerOutput:
        # A failed step is re-run (EngineCore confines failures): a draw must not advance twice.
        seeded = [(r.generator, r.generator.get_state()) for r in rows if r.generator is not None]
        try:
            tokens, logprobs = self.sampler(logits, rows)
        except Exception:
            for generator, state in seeded:
                generator.set_state(state)
            raise
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
        tables = torch.tensor([s.block_ids + [0] * (width - len(s.block_ids)) for s in items], dtype=torch.long)
        if len(positions) > len(items):  # some sequence adds several tokens: one table row per token
            counts = torch.tensor([len(s.token_ids) for s in items])
            tables = tables.repeat_interleave(counts, dim=0)
        position_tensor = torch.tensor(positions, dtype=torch.long)
        return position_tensor, torch.tensor(slots, dtype=torch.long), tables, position_tensor + 1

    def release(self, request_ids: list[str]) -> None:
        """Forget per-request state (generators) of finished requests."""
        for request_id in request_ids:
            self.generators.pop(request_id, None)

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

    def _generator(self, s) -> torch.Generator | None:
        seed = s.params.seed
        if seed is None or s.params.is_greedy:
            return None
        generator = self.generators.get(s.request_id)
        if generator is None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed)
            self.generators[s.request_id] = generator
        return generator
