"""Sampler against transformers' logits processors, plus seeding and logprobs."""

from __future__ import annotations

import pytest
import torch

from kvserve.engine.sampler import Sampler, SamplingRow, _filter
from kvserve.errors import InvalidRequestError
from kvserve.sampling_params import SamplingParams

pytestmark = pytest.mark.threaded  # the C++ kernels' splits over threads stay tested under xdist

transformers = pytest.importorskip("transformers")

VOCAB = 50


def row(params: SamplingParams, prompt=(1, 2, 3), output=(), seed_generator=True) -> SamplingRow:
    generator = None
    if params.seed is not None and seed_generator:
        generator = torch.Generator().manual_seed(params.seed)
    return SamplingRow(params, list(prompt), list(output), generator, (0,))


def logits_batch(n: int = 4, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize(
    "params, warper",
    [
        (SamplingParams(top_k=5), lambda: transformers.TopKLogitsWarper(5)),
        (SamplingParams(top_p=0.7), lambda: transformers.TopPLogitsWarper(0.7)),
        (SamplingParams(min_p=0.2), lambda: transformers.MinPLogitsWarper(0.2)),
    ],
    ids=["top_k", "top_p", "min_p"],
)
def test_filters_keep_the_same_tokens_as_transformers(params, warper):
    logits = logits_batch(8)
    ours = _filter(logits, [params] * 8)
    theirs = warper()(None, logits.clone())
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))


def test_greedy_and_degenerate_filters_pick_the_argmax():
    logits = logits_batch(4)
    argmax = logits.argmax(-1).tolist()
    sampler = Sampler()
    for params in (
        SamplingParams(temperature=0),
        SamplingParams(temperature=1, top_k=1),
        SamplingParams(temperature=1, min_p=1.0),
        SamplingParams(temperature=1, top_p=1e-6),
    ):
        tokens, _ = sampler(logits, [row(params) for _ in range(4)])
        assert tokens == argmax, params


@pytest.mark.parametrize("kernels", ["kernels", "torch"])
def test_temperatures_near_zero_pick_the_argmax_with_any_filter(kernels, monkeypatch):
    """Below GREEDY_BELOW a row is greedy, as in vLLM, with or without top-k, top-p or min-p and a seed.
    Far below it (a temperature whose inverse overflows float32) a seeded draw was garbage: logits / T
    of +-inf made the filtered rows' probabilities NaN, and a plain row took the first of its infinite
    scores. The C++ kernels' path and torch's (no kernels) alike."""
    from kvserve.kernels import ops
    from kvserve.sampling_params import GREEDY_BELOW

    if kernels == "torch":
        monkeypatch.setattr(ops, "available", lambda: False)
    elif not ops.available():
        pytest.skip("the C++ kernels are not built here: the torch case covers the sampler")
    logits = logits_batch(6, seed=3)
    logits[:, 7] = logits.max(dim=1).values - 1e-3  # a runner-up within 1e-3 of each row's best
    argmax = logits.argmax(-1).tolist()
    sampler = Sampler()
    for temperature in (GREEDY_BELOW / 2, 1e-30, 1e-40, 1e-45):
        for extra in ({}, {"top_k": 5}, {"top_p": 0.5}, {"min_p": 0.1}):
            params = SamplingParams(temperature=temperature, seed=7, **extra)
            assert params.is_greedy
            tokens, _ = sampler(logits, [row(params) for _ in range(6)])
            assert tokens == argmax, (temperature, extra)
    assert not SamplingParams(temperature=GREEDY_BELOW).is_greedy


def test_the_greedy_kernel_picks_what_torch_argmax_picks():
    """The C++ argmax that greedy rows take on the CPU: the first of tied maxima, NaN as the largest,
    rows of -inf, and a vocabulary that is not a multiple of the vector width."""
    import shutil

    from kvserve.kernels import build, ops

    extension = build.load()
    if extension is None and shutil.which("c++") is None:
        pytest.skip("no C++ compiler: greedy rows take torch.argmax")
    assert extension is not None, build.error()
    logits = torch.randn(9, 49157, generator=torch.Generator().manual_seed(4))
    logits[1, [100, 3000]] = 50.0  # a tie in the vector part: the first wins
    logits[2, [49155, 49156]] = 50.0  # a tie in the leftover lanes
    logits[3, 20] = 50.0
    logits[3, 49156] = 50.0  # a tie across both
    logits[4] = float("-inf")
    logits[5, 7] = float("nan")
    logits[6, 49156] = float("nan")  # NaN in the leftover lanes
    logits[7, 12] = float("inf")
    logits[8, [11, 500]] = float("nan")  # the first NaN
    assert torch.equal(ops.argmax_rows(logits), logits.argmax(-1))
    assert torch.equal(extension.argmax_rows(logits[:, :5]), logits[:, :5].argmax(-1))  # under one vector


def test_seeded_rows_are_independent_of_batch_position():
    logits = logits_batch(1, seed=3).repeat(4, 1)
    sampler = Sampler()
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = [sampler(logits[:1], [row(seeded)])[0][0]]
    gen = torch.Generator().manual_seed(1234)
    alone_seq = []
    for _ in range(5):
        r = SamplingRow(seeded, [1], [], gen, (0,))
        alone_seq.append(sampler(logits[:1], [r])[0][0])
    gen_b = torch.Generator().manual_seed(1234)
    batch_seq = []
    for _ in range(5):
        rows = [row(SamplingParams(temperature=1.0)), SamplingRow(seeded, [1], [], gen_b, (0,)), row(seeded)]
        batch_seq.append(sampler(logits[:3], rows)[0][1])
    assert alone[0] == alone_seq[0]
    assert alone_seq == batch_seq
    assert len(set(alone_seq)) > 1  # really sampling


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2] + [0.0] * (VOCAB - 3))
    logits = probs.clamp_min(1e-30).log()[None]
    sampler = Sampler()
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(VOCAB)
    for _ in range(3000):
        token = sampler(logits, [SamplingRow(SamplingParams(temperature=1.0), [], [], generator, ())])[0][0]
        counts[token] += 1
    assert torch.allclose(counts[:3] / 3000, probs[:3], atol=0.04)
    assert counts[3:].sum() == 0


def test_min_tokens_masks_stop_tokens():
    logits = torch.zeros(1, VOCAB)
    logits[0, 0] = 10.0  # token 0 is the stop token of `row`
    params = SamplingParams(temperature=0, min_tokens=2, max_tokens=4)
    before = logits.clone()
    tokens, _ = Sampler()(logits, [row(params, output=[5])])
    assert tokens[0] != 0
    assert torch.equal(logits, before)  # masked in a copy: the caller's logits are left as they were
    tokens, _ = Sampler()(logits, [row(params, output=[5, 6])])
    assert tokens[0] == 0


def test_stop_masks_and_logit_biases_reach_their_own_rows_only():
    """min_tokens' masks and logit_bias are written for every row at once: each row gets its own."""
    logits = torch.zeros(4, VOCAB)
    logits[:, 0] = 10.0  # the stop token leads everywhere
    rows = [
        row(SamplingParams(temperature=0, min_tokens=3, max_tokens=4), output=[5]),  # masked: the next best
        row(SamplingParams(temperature=0, logit_bias={7: 20.0, 9: -5.0})),  # 7 forced
        row(SamplingParams(temperature=0)),
        row(SamplingParams(temperature=0, min_tokens=3, max_tokens=4, logit_bias={VOCAB + 3: 50.0, 2: 5.0})),
    ]
    tokens, _ = Sampler()(logits, rows)
    assert tokens == [1, 7, 0, 2]  # the first of the equal rest; an id past the vocabulary is ignored
    for i, r in enumerate(rows):  # and alone, the same
        assert Sampler()(logits[i : i + 1], [r])[0] == [tokens[i]]


def test_a_repeated_logit_bias_token_keeps_its_last_value():
    params = SamplingParams(logit_bias=((3, 1.0), (4, 2.0), (3, -7.5)))
    assert params.logit_bias == ((3, -7.5), (4, 2.0))
    logits = torch.zeros(1, VOCAB)
    logits[0, 3] = 5.0
    assert Sampler()(logits, [row(SamplingParams(temperature=0, logit_bias=params.logit_bias))])[0] == [4]


def test_logprobs_are_the_raw_distribution():
    logits = logits_batch(2)
    params = SamplingParams(temperature=0, logprobs=3)
    tokens, logprobs = Sampler()(logits, [row(params), row(SamplingParams(temperature=0))])
    reference = torch.log_softmax(logits[0], -1)
    assert logprobs[1] is None
    lp = logprobs[0]
    assert lp.token_id == tokens[0] and lp.logprob == pytest.approx(float(reference[tokens[0]]))
    assert [t for t, _ in lp.top] == reference.topk(3).indices.tolist()


def test_each_row_gets_its_own_logprobs_from_the_batchs_one_copy():
    """Rows asking for different numbers (none, 0, 3, 5, a drawn row's) share two copies to the host:
    each gets its own chosen token's logprob and top n, as the row alone does."""
    logits = logits_batch(5, seed=3)
    params = [
        SamplingParams(temperature=0, logprobs=3),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, logprobs=0),
        SamplingParams(temperature=1.0, seed=4, logprobs=5),
        SamplingParams(temperature=0, logprobs=1),
    ]
    tokens, logprobs = Sampler()(logits, [row(p) for p in params])
    for i, p in enumerate(params):
        alone_tokens, alone = Sampler()(logits[i : i + 1], [row(p)])
        assert alone_tokens == [tokens[i]]
        if p.logprobs is None:
            assert logprobs[i] is None and alone[0] is None
            continue
        reference = torch.log_softmax(logits[i], -1)
        assert logprobs[i] == alone[0]
        assert logprobs[i].token_id == tokens[i] and logprobs[i].logprob == float(reference[tokens[i]])
        top = reference.topk(p.logprobs)
        assert logprobs[i].top == list(zip(top.indices.tolist(), top.values.tolist(), strict=True))


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", 0),
        ("temperature", -1.0),
        ("top_k", -2),
        ("top_p", 1.5),
        ("min_p", 2.0),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 3.0),
        ("frequency_penalty", -3.0),
        ("seed", -1),
        ("stop", ("",)),
        ("stop_token_ids", (-1,)),
        ("min_tokens", -1),
        ("logprobs", 21),
        # values of the wrong type: a typed error, never a TypeError or a string taken as true
        ("temperature", "0.5"),
        ("temperature", None),
        ("top_p", True),
        ("min_p", None),
        ("stop", 5),
        ("stop_token_ids", 5),
        ("stop_token_ids", "12"),
        ("stop_token_ids", [True]),
        ("logit_bias", 5),
        ("ignore_eos", "false"),
        ("skip_special_tokens", "no"),
    ],
)
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**{field: value})
    assert err.value.param == field and field in str(err.value)


@pytest.mark.parametrize("vocab", [5, 13, 1000], ids=lambda v: f"vocab{v}")
def test_the_sampling_kernel_follows_the_distribution_under_any_seeds(extension, vocab):
    """sample_rows (sampling.cpp: argmax of exp(logit - max) / -log(U), U a hash of the row's seed and the
    token id) against softmax: 40,000 rows, each its own seed, consecutive ones (a weak hash of small
    seeds drew token 0 at 0.17 too often) and random ones; Pearson's chi-square below its 1e-6 quantile
    (a fixed draw: the same figures every run). A token whose logit is -inf is never drawn; a row's
    draw is the same alone as in the batch. Vocabularies under and over the kernel's 8 lanes."""
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(vocab)) * 2
    logits[1] = float("-inf")
    probs = torch.softmax(logits, -1).double()
    rows = 40_000
    for seeds in (torch.arange(rows), torch.randint(0, 2**63 - 1, (rows,), generator=torch.Generator().manual_seed(1))):
        ones = torch.ones(rows)
        tokens = extension.sample_rows(logits[None], torch.zeros(rows, dtype=torch.long), ones, seeds)
        counts = torch.bincount(tokens, minlength=vocab).double()
        assert counts[1] == 0
        expected = rows * probs
        kept = expected > 5  # chi-square's usual condition; the rest pooled
        statistic = ((counts[kept] - expected[kept]) ** 2 / expected[kept]).sum()
        rest = expected[~kept & (probs > 0)].sum()
        if rest > 5:
            statistic += (counts[~kept & (probs > 0)].sum() - rest) ** 2 / rest
        degrees = int(kept.sum()) - 1 + (1 if rest > 5 else 0)
        # chi-square's upper 1e-6 quantile by Wilson and Hilferty's approximation (z = 4.753)
        quantile = degrees * (1 - 2 / (9 * degrees) + 4.753 * (2 / (9 * degrees)) ** 0.5) ** 3
        assert statistic < quantile, (statistic, degrees)
        for i in (0, 7, rows - 1):
            alone = extension.sample_rows(logits[None], torch.zeros(1, dtype=torch.long), ones[:1], seeds[i : i + 1])
            assert int(alone[0]) == int(tokens[i])


def _top_step_of_u(vocab: int) -> tuple[int, int]:
    """A (seed, token) whose uniform in sample_rows falls in the top of its 2^24 steps: sampling.cpp's
    hash (splitmix64's finalizer for the row's keys, two rounds of lowbias32) in numpy, over seeds."""
    import numpy as np

    def mix32(x):
        x = (x ^ (x >> np.uint32(16))) * np.uint32(0x7FEB352D)
        x = (x ^ (x >> np.uint32(15))) * np.uint32(0x846CA68B)
        return x ^ (x >> np.uint32(16))

    tokens = np.arange(vocab, dtype=np.uint32)
    with np.errstate(over="ignore"):
        for start in range(0, 1 << 20, 1024):
            z = np.arange(start, start + 1024, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
            z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            z ^= z >> np.uint64(31)
            key0, key1 = (z & np.uint64(0xFFFFFFFF)).astype(np.uint32), (z >> np.uint64(32)).astype(np.uint32)
            hashed = mix32(mix32(tokens[None, :] + key0[:, None]) ^ key1[:, None])
            hits = np.argwhere(hashed >> np.uint32(8) == 0xFFFFFF)
            if len(hits):
                return start + int(hits[0][0]), int(hits[0][1])
    raise AssertionError("no seed found")


def test_the_top_step_of_u_gives_a_finite_score(extension):
    """U's top step, centred, is 1 - 2^-25, which rounds to 1 in float: -log(U) was 0 and the token's
    score infinite, so it was drawn whatever its probability (one draw in 2^24 / vocab). Held below 1,
    a token at e^-50 of the others' probability is not drawn."""
    seed, token = _top_step_of_u(4096)
    logits = torch.zeros(1, 4096)
    logits[0, token] = -50.0
    drawn = extension.sample_rows(logits, torch.zeros(1, dtype=torch.long), torch.ones(1), torch.tensor([seed]))
    assert int(drawn[0]) != token


def test_the_cpu_sampler_draws_through_the_kernel_one_seed_a_row_and_step(extension):
    """On the CPU with the kernels loaded a random row takes one 63-bit seed from its generator per step
    and sample_rows draws with it: the Sampler's token is the kernel's for that seed, on the logits as
    they are at 1 / temperature, or on the filtered ones (top-k here) at 1, wherever the row sits."""
    from kvserve.kernels import ops

    assert ops.available()
    logits = logits_batch(3, seed=5)
    seed = torch.randint(0, 2**63 - 1, (1,), generator=torch.Generator().manual_seed(99))
    plain, top_k = SamplingParams(temperature=0.7, seed=99), SamplingParams(temperature=0.7, top_k=5, seed=99)
    rows = [row(SamplingParams(temperature=0.0)), row(plain), row(top_k)]
    tokens = Sampler()(logits, rows)[0]
    inv = 1 / torch.tensor([0.7])  # as the Sampler makes it, in float32
    assert tokens[1] == int(extension.sample_rows(logits, torch.tensor([1]), inv, seed)[0])
    filtered = _filter(logits[2:3] / 0.7, [top_k])
    assert tokens[2] == int(extension.sample_rows(filtered, torch.tensor([0]), torch.ones(1), seed)[0])
    assert tokens[0] == int(logits[0].argmax())


def test_a_steps_seeds_are_one_draw_per_row_from_its_generator_in_row_order():
    """The default generator's rows (no seed) take their seeds in one call: the same numbers as one
    call per row in row order, beside seeded rows that draw from their own generators."""
    from kvserve.engine.sampler import _seeds

    def one_by_one(generators):
        return [int(torch.randint(0, 2**63 - 1, (1,), generator=g)) for g in generators]

    def mixed():
        return [None, torch.Generator().manual_seed(5), None, None, torch.Generator().manual_seed(6)]

    torch.manual_seed(11)
    expected = [one_by_one(generators) for generators in (mixed(), mixed()[:1], mixed()[1:2])]
    torch.manual_seed(11)
    got = [_seeds(generators).tolist() for generators in (mixed(), mixed()[:1], mixed()[1:2])]
    assert got == expected and len(set(expected[0])) == 5
