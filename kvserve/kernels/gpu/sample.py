"""The sampler's kernels on a GPU: the pick (each row's argmax, or a draw at the row's temperature, in one
launch), and top-p's cumulative sums of each row in one launch.

A draw is the Gumbel-max form of the CPU's `argmax(probs / E)`, E ~ Exp(1) per token: the argmax of
logit / T - log(E), which is log(probs / E) less the row's log-sum-exp, so the same law with no
softmax. E = -log(U) from Philox (`tl.randint`) keyed by the row's 64-bit seed and the token id, U at
the centres of a grid of 2^-23 in (0, 1): never 0 nor 1, so E is finite and positive, a token at -inf
is never drawn and a row's one finite token always is. The seed is one draw per step from the
request's generator (engine/sampler.py), as for the CPU's kernel. So a row's token depends on its
logits, temperature and seed only, never on the rows beside it (R7), and torch's per-row uniform_
launches (one per random row and step) are gone.

Each row's vocabulary is cut into chunks of BLOCK tokens, one program each; every program stores its
chunk's best (value, first index), counts itself on the row's counter, and the row's last program
takes the first best of the chunks: torch.argmax's choice, the first of equal maxima (NaN counts
as +inf: torch would pick a NaN after an inf).

`row_cumsum` scans each row in one program, BLOCK_SCAN tokens at a time with the running total carried
from one block to the next: a row's sums in one order whatever rows are beside it (torch's cumsum on
CUDA takes another algorithm for one row than for several), without one launch per row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.kernels.gpu import cdiv, launch_options, next_power_of_2
from kvserve.kernels.gpu.common import wait_for_prior

BLOCK = 2048  # tokens per program: 24 programs a row for a 49,152-token vocabulary
NUM_COUNTERS = 1024  # rows a call picks with the counters; more rows take several calls
BLOCK_SCAN = 4096  # tokens a scan step: 12 steps a row for a 49,152-token vocabulary


@triton.jit
def uniform_of(bits):
    """uint32 random bits -> U in (0, 1): the top 23 bits k as (k + 1/2) / 2^23, exact in float32."""
    return ((bits >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07


@triton.jit(do_not_specialize=["vocab", "stride"])
def _pick_kernel(
    logits_ptr,
    rows_ptr,
    seeds_ptr,
    inv_temperatures_ptr,
    best_ptr,
    index_ptr,
    counters_ptr,
    out_ptr,
    vocab,
    stride,
    HAS_ROWS: tl.constexpr,
    RANDOM: tl.constexpr,
    BLOCK: tl.constexpr,
    CHUNKS: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_prior(PDL)
    r = tl.program_id(0)
    chunk = tl.program_id(1)
    num_chunks = tl.num_programs(1)
    row = tl.load(rows_ptr + r).to(tl.int64) if HAS_ROWS else r.to(tl.int64)
    tokens = chunk * BLOCK + tl.arange(0, BLOCK)
    valid = tokens < vocab
    x = tl.load(logits_ptr + row * stride + tokens, mask=valid, other=float("-inf"))
    x = tl.where(x == x, x, float("inf"))  # NaN: the largest
    if RANDOM:
        bits = tl.randint(tl.load(seeds_ptr + r), tokens).to(tl.uint32, bitcast=True)
        u = uniform_of(bits)
        score = x * tl.load(inv_temperatures_ptr + r) - tl.log(-tl.log(u))
        x = tl.where(valid, score, float("-inf"))
    best = tl.max(x, axis=0)
    first = tl.min(tl.where((x == best) & valid, tokens, vocab), axis=0)
    tl.store(best_ptr + r * num_chunks + chunk, best)
    tl.store(index_ptr + r * num_chunks + chunk, first)
    tl.debug_barrier()  # the chunk's best stored before the count (released with it)
    if tl.atomic_add(counters_ptr + r, 1, sem="acq_rel") == num_chunks - 1:
        # the row's last program: every chunk's best in one load ("from L2": other multiprocessors
        # stored them), the first chunk holding the largest, and that chunk's first index
        chunks = tl.arange(0, CHUNKS)
        bests = tl.load(
            best_ptr + r * num_chunks + chunks, mask=chunks < num_chunks, other=float("-inf"), cache_modifier=".cg"
        )
        top = tl.max(bests, axis=0)
        first_chunk = tl.min(tl.where((bests == top) & (chunks < num_chunks), chunks, CHUNKS), axis=0)
        pick = tl.load(index_ptr + r * num_chunks + first_chunk, cache_modifier=".cg")
        tl.store(out_ptr + r, tl.minimum(pick, vocab - 1).to(tl.int64))
        tl.store(counters_ptr + r, 0)


def counters(device: torch.device | str) -> torch.Tensor:
    """A sampler's row counters for `pick`, all 0 between calls (calls on one stream are ordered)."""
    return torch.zeros(NUM_COUNTERS, dtype=torch.int32, device=device)


def pick(
    logits: torch.Tensor,
    counters: torch.Tensor,
    rows: torch.Tensor | None = None,
    seeds: torch.Tensor | None = None,
    inv_temperatures: torch.Tensor | None = None,
) -> torch.Tensor:
    """Token ids [R] (int64) from logits [B, V] (float32, each row contiguous): for each row named in
    `rows` (int, on the device; None: every row) its argmax, or with `seeds` (int64 [R]) a draw at
    the temperature 1 / `inv_temperatures` (float32 [R])."""
    assert logits.dtype == torch.float32 and logits.stride(1) == 1
    num_rows, vocab = logits.shape[0] if rows is None else rows.numel(), logits.shape[1]
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    num_chunks = cdiv(vocab, BLOCK)
    random = seeds is not None
    for start in range(0, num_rows, NUM_COUNTERS):
        end = min(start + NUM_COUNTERS, num_rows)
        best = torch.empty((end - start, num_chunks), dtype=torch.float32, device=logits.device)
        index = torch.empty((end - start, num_chunks), dtype=torch.int32, device=logits.device)
        _pick_kernel[(end - start, num_chunks)](
            logits[start:] if rows is None else logits,
            logits if rows is None else rows[start:end],
            seeds[start:end] if random else logits,
            inv_temperatures[start:end] if random else logits,
            best,
            index,
            counters,
            out[start:end],
            vocab,
            logits.stride(0),
            HAS_ROWS=rows is not None,
            RANDOM=random,
            BLOCK=BLOCK,
            CHUNKS=next_power_of_2(num_chunks),
            **launch_options(logits.device),
        )
    return out


@triton.jit(do_not_specialize=["length", "stride"])
def _cumsum_kernel(values_ptr, out_ptr, length, stride, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_prior(PDL)
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK)
    carried = 0.0
    for start in range(0, length, BLOCK):
        at = start + offsets
        x = tl.load(values_ptr + row * stride + at, mask=at < length, other=0.0)
        sums = tl.cumsum(x, axis=0) + carried
        tl.store(out_ptr + row * length + at, sums, mask=at < length)
        carried = tl.sum(tl.where(offsets == BLOCK - 1, sums, 0.0), axis=0)  # the block's last sum, exactly


def row_cumsum(values: torch.Tensor) -> torch.Tensor:
    """cumsum along each row of `values` [B, V] (float32, each row contiguous): one program a row, its
    sums in one order however many rows there are."""
    assert values.dtype == torch.float32 and values.dim() == 2 and values.stride(1) == 1
    out = torch.empty(values.shape, dtype=torch.float32, device=values.device)
    if values.numel():
        _cumsum_kernel[(values.shape[0],)](
            values, out, values.shape[1], values.stride(0), BLOCK=BLOCK_SCAN, **launch_options(values.device)
        )
    return out
