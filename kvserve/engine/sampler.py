"""Batched sampling with per-row parameters and per-request random generators.

Order per row: logprobs of the raw model distribution (if asked), min_tokens masking of stop
tokens, logit_bias, repetition / frequency / presence penalties, the grammar's mask (structured
output: every token it forbids at -inf), then greedy argmax, or temperature, top-k, top-p and min-p
followed by a draw. Each of these runs on the rows that ask for it only, so a row's result never
depends on its neighbours'. A draw is `argmax(probs / E)` with E ~ Exp(1) per token (equivalent to
sampling from `probs`); a seeded request draws its randomness from its own generator (one seed per
step for the kernel, which hashes it with each token id: the C++ one on the CPU, the Triton pick on a
GPU; the engine's come from a SeedStream, a block of steps' seeds at a time), so it gets the same tokens
alone or in any batch.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

import torch

from kvserve.engine.penalties import Penalties
from kvserve.engine.seed_stream import HIGH, SeedStream
from kvserve.kernels import ops
from kvserve.layers.transfer import on_device, to_device
from kvserve.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: SeedStream | torch.Generator | None  # a seeded request's (the engine's: a SeedStream)
    stop_token_ids: tuple[int, ...]  # masked while fewer than min_tokens were generated
    token_bitmask: torch.Tensor | None = None  # [ceil(V / 32)] int32: bit t of word t // 32 allows token t
    key: str | None = None  # the request's id: its penalties' history is kept under it (engine/penalties.py)


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first


class Sampled:
    """A batch's draws, launched on the logits' device: `tokens` [B] there at once, the host's lists
    (`result`) once the device has computed them. On a GPU everything is queued behind the step and
    copied back without a stop of the host, so a runner may queue its next step first (async
    scheduling); on the CPU it is computed already."""

    def __init__(
        self, tokens: torch.Tensor, logprobs: tuple[list[tuple[int, int]], torch.Tensor, torch.Tensor] | None = None
    ) -> None:
        """`logprobs`: the rows asking for them as (row, n), in row order; then on the device, one after
        another, each one's [the chosen token's logprob, its top n's], and each one's top n ids."""
        self.tokens = tokens
        pinned = tokens.is_cuda
        self._tokens = tokens.to("cpu", non_blocking=pinned)
        self._logprobs = None
        if logprobs is not None:  # two copies however many rows ask
            asked, values, ids = logprobs
            self._logprobs = (asked, values.to("cpu", non_blocking=pinned), ids.to("cpu", non_blocking=pinned))
        self._done = None
        if pinned:
            self._done = torch.cuda.Event()
            self._done.record()

    def result(self) -> tuple[list[int], list[TokenLogprobs | None]]:
        if self._done is not None:
            self._done.synchronize()  # this batch's kernels and copies only, not what was queued after
        token_list = self._tokens.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(token_list)
        if self._logprobs is not None:
            asked, values, ids = self._logprobs
            values, ids = values.tolist(), ids.tolist()
            at = 0  # row j's values start at at + j (its chosen token's logprob first), its ids at at
            for j, (i, n) in enumerate(asked):
                first = at + j
                logprobs[i] = TokenLogprobs(
                    token_list[i],
                    values[first],
                    list(zip(ids[at : at + n], values[first + 1 : first + 1 + n], strict=True)),
                )
                at += n
        return token_list, logprobs


class Sampler:
    def __init__(self) -> None:
        self._counters: torch.Tensor | None = None  # the GPU pick's row counters (kernels/gpu/sample.py)
        self.penalties = Penalties()

    def release(self, request_ids: list[str]) -> None:
        """Forget finished requests' state (their penalties' histories)."""
        self.penalties.release(request_ids)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[TokenLogprobs | None]]:
        return self.launch(logits, rows).result()

    def launch(self, logits: torch.Tensor, rows: list[SamplingRow]) -> Sampled:
        # logits: [B, V] float32, one row per sampled request
        num_rows, vocab = logits.shape
        raw_logprobs = None
        if any(r.params.logprobs is not None for r in rows):
            raw_logprobs = torch.log_softmax(logits, dim=-1)

        masked = {i: stops for i, row in enumerate(rows) if (stops := _stops_to_mask(row, vocab))}
        biased = [i for i, row in enumerate(rows) if row.params.logit_bias]
        penalized = [i for i, row in enumerate(rows) if row.params.has_penalties]
        constrained = [i for i, row in enumerate(rows) if row.token_bitmask is not None]
        if masked or biased or penalized or constrained:  # the caller's logits stay as they are
            logits = logits.clone()
        if masked:  # each row's own ids, in one fill for every row (a Python value assigned through
            # index tensors would be copied to the device, a copy that waits for the step queued ahead)
            entries = [(i, token) for i, stops in masked.items() for token in stops]
            at = on_device(logits.device, list(zip(*entries, strict=True)))
            logits.view(-1).index_fill_(0, at[0] * vocab + at[1], float("-inf"))
        if biased:
            _apply_bias(logits, [(i, rows[i].params.logit_bias) for i in biased])
        self.penalties.apply(logits, rows, penalized)
        if constrained:  # each row's own mask: no row sees another's
            bitmasks = torch.stack([rows[i].token_bitmask for i in constrained])
            if logits.device.type == "cpu" and ops.available():
                ops.apply_token_bitmask(logits, torch.tensor(constrained), bitmasks)
            else:
                logits[on_device(logits.device, constrained)] += to_device(bitmask_bias(bitmasks, vocab), logits.device)

        random_rows = [i for i, row in enumerate(rows) if not row.params.is_greedy]
        counters = self._gpu_counters(logits)
        if len(random_rows) < num_rows:
            tokens = _argmax_rows(logits, counters)
        else:
            tokens = torch.empty(num_rows, dtype=torch.long, device=logits.device)
        if random_rows:
            drawn = _draw(logits, [(i, rows[i]) for i in random_rows], counters)
            tokens[on_device(logits.device, random_rows)] = drawn

        logprobs = None
        if raw_logprobs is not None:  # on the device: each asking row's chosen token's logprob and top n
            asked = [(i, row.params.logprobs) for i, row in enumerate(rows) if row.params.logprobs is not None]
            at = on_device(logits.device, [i for i, _ in asked])
            chosen = raw_logprobs.gather(1, tokens[:, None])[at]  # [R, 1]
            values, ids = [], []
            for j, (i, n) in enumerate(asked):  # a row's own top n (one topk a row: its ties in one order)
                top_values, top_ids = raw_logprobs[i].topk(n)
                values += [chosen[j], top_values]
                ids.append(top_ids)
            logprobs = (asked, torch.cat(values), torch.cat(ids))
        return Sampled(tokens, logprobs)

    def _gpu_counters(self, logits: torch.Tensor) -> torch.Tensor | None:
        """The GPU pick's row counters where the logits are on a GPU that runs the Triton kernels."""
        if not logits.is_cuda or not _triton():
            return None
        if self._counters is None or self._counters.device != logits.device:
            from kvserve.kernels.gpu import sample

            self._counters = sample.counters(logits.device)
        return self._counters


def draws_by_seed(device: torch.device) -> bool:
    """Whether random rows on `device` draw through a kernel, one seed a row and step (`_seeds`), rather
    than uniforms from their generators (`_draw`'s fallback)."""
    return (device.type == "cuda" and _triton()) or (device.type == "cpu" and ops.available())


@functools.cache
def _triton() -> bool:
    from kvserve.kernels import gpu

    return gpu.available()


def _draw(
    logits: torch.Tensor, rows: list[tuple[int, SamplingRow]], counters: torch.Tensor | None = None
) -> torch.Tensor:
    """One token for each (index into logits [B, V], row) at the row's temperature: argmax(probs / E),
    E ~ Exp(1) per token, each row's randomness from its own generator (the default one where None).
    In one pass from one 63-bit seed a row draws from its generator per step, on the logits as they are
    (rows without top-k, top-p or min-p: no copy) or as filtered: on the CPU the C++ kernel, on a GPU
    with `counters` the Triton pick (kernels/gpu/sample.py, in its Gumbel form). Elsewhere E = -log(U)
    from uniforms the generator draws (torch's exponential_ has the same law, at 5x the cost on a CPU).
    Which way a row goes depends on its own settings only."""
    vocab = logits.shape[-1]
    params = [row.params for _, row in rows]
    device = logits.device
    temperatures = on_device(device, [p.temperature for p in params], torch.float32)
    tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
    removes = [_ranked(p, vocab) or _floored(p) for p in params]  # top-k, top-p or min-p: _filter
    filtered = [j for j, r in enumerate(removes) if r]
    plain = [j for j, r in enumerate(removes) if not r]
    kernel = counters is not None or (logits.device.type == "cpu" and ops.available())
    if kernel and plain:
        seeds = _seeds([rows[j][1].generator for j in plain])
        index, at = [rows[j][0] for j in plain], on_device(device, plain)
        tokens[at] = _sample_rows(logits, index, 1 / temperatures[at], seeds, counters)
    drawn = filtered if kernel else list(range(len(rows)))
    if drawn:
        picked = on_device(device, drawn)
        sub = logits[on_device(device, [rows[j][0] for j in drawn])] / temperatures[picked][:, None]
        sub = _filter(sub, [params[j] for j in drawn], gpu_kernels=counters is not None)
        generators = [rows[j][1].generator for j in drawn]
        if kernel:
            ones = torch.ones(len(drawn), dtype=torch.float32, device=device)
            tokens[picked] = _sample_rows(sub, list(range(len(drawn))), ones, _seeds(generators), counters)
        else:
            probs = torch.softmax(sub, dim=-1)
            noise = torch.empty_like(probs)
            for j, generator in enumerate(generators):  # U in [0, 1): U = 0 gives E = inf, never drawn
                if isinstance(generator, SeedStream):  # made `direct` for this path: its marks keep the state
                    generator = generator.generator
                on = device if generator is None else generator.device  # a CPU generator's draws copied over
                noise[j] = torch.empty(vocab, dtype=noise.dtype, device=on).uniform_(generator=generator)
            tokens[picked] = (probs / noise.log_().neg_()).argmax(dim=-1)
    return tokens


def _sample_rows(
    logits: torch.Tensor,
    index: list[int],
    inv_temperatures: torch.Tensor,
    seeds: torch.Tensor,
    counters: torch.Tensor | None,
) -> torch.Tensor:
    """The kernels' draw for logits' rows `index` (each at 1 / inv_temperatures, from its seed):
    the C++ kernel's on the CPU, the Triton pick's on a GPU (with its row counters)."""
    if counters is None:
        return ops.sample_rows(logits, torch.tensor(index), inv_temperatures, seeds)
    from kvserve.kernels.gpu import sample

    device = logits.device
    return sample.pick(
        logits.contiguous(), counters, on_device(device, index), to_device(seeds, device), inv_temperatures
    )


def _seeds(generators: list[SeedStream | torch.Generator | None]) -> torch.Tensor:
    """A 63-bit seed from each row's stream or generator (the default one where None): one draw per
    row and step. The default generator's rows take theirs in one call: the numbers of one call each,
    in row order."""
    default = [j for j, g in enumerate(generators) if g is None]
    own = [j for j, g in enumerate(generators) if g is not None]
    if not own:
        return torch.randint(0, HIGH, (len(default),))
    drawn = torch.tensor([_take(generators[j]) for j in own], dtype=torch.long)
    if not default:
        return drawn
    seeds = torch.empty(len(generators), dtype=torch.long)
    seeds[default] = torch.randint(0, HIGH, (len(default),))
    seeds[own] = drawn
    return seeds


def _take(source: SeedStream | torch.Generator) -> int:
    if isinstance(source, SeedStream):
        return source.take()
    return int(torch.randint(0, HIGH, (1,), generator=source))


def _ranked(params: SamplingParams, vocab: int) -> bool:
    """Whether top-k or top-p can remove tokens for this row (_filter's ranked rows)."""
    return 0 < params.top_k < vocab or params.top_p < 1


def _floored(params: SamplingParams) -> bool:
    """Whether min-p can remove tokens for this row (_filter's floored rows)."""
    return params.min_p > 0


def _stops_to_mask(row: SamplingRow, vocab: int) -> list[int]:
    """The stop tokens masked while fewer than min_tokens were generated."""
    params = row.params
    if not params.min_tokens or len(row.output_token_ids) >= params.min_tokens:
        return []
    return [t for t in (*row.stop_token_ids, *params.stop_token_ids) if t < vocab]


# _BYTE_BIAS[b, j]: 0 where bit j of byte b is set, else -inf
_BYTE_BIAS = torch.tensor([[0.0 if b >> j & 1 else float("-inf") for j in range(8)] for b in range(256)])


def bitmask_bias(bitmasks: torch.Tensor, vocab: int) -> torch.Tensor:
    """Grammars' bitmasks [R, W] int32 as logit offsets [R, vocab]: 0 for a token its row allows, -inf
    for one it forbids. Token t is bit t % 32 of word t // 32 (llguidance's layout); ids past 32 * W
    are forbidden. One table lookup per byte of the mask (its words are read as little-endian bytes)."""
    assert sys.byteorder == "little"
    num_rows = bitmasks.shape[0]
    bias = _BYTE_BIAS[bitmasks.cpu().contiguous().view(torch.uint8).long()].view(num_rows, -1)  # [R, 32 * W]
    if bias.shape[1] < vocab:
        bias = torch.cat([bias, bias.new_full((num_rows, vocab - bias.shape[1]), float("-inf"))], dim=1)
    return bias[:, :vocab]


def _apply_bias(logits: torch.Tensor, biases: list[tuple[int, tuple[tuple[int, float], ...]]]) -> None:
    """In place on logits [B, V]: for each (row, its logit_bias), add each (token id, bias) to that row
    (a row's ids are distinct: SamplingParams keeps the last of a repeated one); ids outside the
    vocabulary are ignored. One gather, add and scatter for every row."""
    vocab = logits.shape[1]
    entries = [(i, t, b) for i, bias in biases for t, b in bias if t < vocab]
    if entries:
        rows, ids, values = zip(*entries, strict=True)
        at = tuple(on_device(logits.device, [rows, ids]))
        logits[at] = logits[at] + on_device(logits.device, values, logits.dtype)


def _argmax_rows(logits: torch.Tensor, counters: torch.Tensor | None = None) -> torch.Tensor:
    """logits.argmax(dim=-1), through the C++ kernel on the CPU once it is loaded (torch's is scalar
    there, a visible share of a many-row step over a large vocabulary), and on a GPU with `counters`
    through the Triton pick (a row's vocabulary split over programs: torch's took 16 us for one row of
    49,152 on an H200, gpu_profile.json)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and ops.available():
        return ops.argmax_rows(logits)
    if counters is not None and logits.dtype == torch.float32 and logits.stride(1) == 1:
        from kvserve.kernels.gpu import sample

        return sample.pick(logits, counters)
    return logits.argmax(dim=-1)


def _filter(logits: torch.Tensor, params: list[SamplingParams], gpu_kernels: bool = False) -> torch.Tensor:
    """top-k, top-p and min-p masking (to -inf) on temperature-scaled logits [b, V]. Each filter runs
    only on the rows that ask for it, so that a row's result never depends on its neighbours' settings.
    `gpu_kernels`: top-p's sums through the Triton scan (the sampler's branch for logits on a GPU)."""
    vocab = logits.shape[-1]
    ranked = [i for i, p in enumerate(params) if _ranked(p, vocab)]
    floored = [i for i, p in enumerate(params) if _floored(p)]
    if ranked or floored:  # the caller's logits stay as they are
        logits = logits.clone()
    if ranked:
        ranked_rows = on_device(logits.device, ranked)
        sub = logits[ranked_rows]
        top_k = on_device(logits.device, [params[i].top_k if params[i].top_k > 0 else vocab for i in ranked])
        top_p = on_device(logits.device, [params[i].top_p for i in ranked], logits.dtype)
        sorted_logits, order = sub.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        remove = ranks >= top_k[:, None]
        sorted_probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
        # keep the smallest prefix whose mass reaches top_p (the token crossing it included)
        mass_before = _row_cumsum(sorted_probs, gpu_kernels) - sorted_probs
        remove |= mass_before >= top_p[:, None]
        remove[:, 0] = False
        logits[ranked_rows] = sub.scatter(-1, order, sorted_logits.masked_fill(remove, float("-inf")))
    if floored:
        floored_rows = on_device(logits.device, floored)
        sub = logits[floored_rows]
        min_p = on_device(logits.device, [params[i].min_p for i in floored], logits.dtype)
        probs = torch.softmax(sub, dim=-1)
        threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        logits[floored_rows] = sub.masked_fill(probs < threshold, float("-inf"))
    return logits


def _row_cumsum(values: torch.Tensor, gpu_kernels: bool = False) -> torch.Tensor:
    """cumsum along each row of [b, V], a row's sums in one order whatever rows are beside it. With
    `gpu_kernels` the Triton scan, one program a row in one launch. On the CPU torch's scan is
    sequential per row; CUDA's takes cub's device-wide scan for one row and a row-wise kernel for
    several, which add in other orders, so without Triton each row is scanned alone there."""
    if gpu_kernels:
        from kvserve.kernels.gpu import sample

        return sample.row_cumsum(values.contiguous())
    if values.device.type == "cpu" or values.shape[0] == 1:
        return values.cumsum(dim=-1)
    return torch.cat([row.cumsum(dim=-1) for row in values.split(1)])
