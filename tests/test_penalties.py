"""Penalties kept per request (engine/penalties.py): against transformers and OpenAI's formula, and, step
after step, against the penalties rebuilt from each row's whole history, in any batch."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kvserve.engine.penalties import MIN_COLUMNS, Penalties
from kvserve.engine.sampler import SamplingRow
from kvserve.sampling_params import SamplingParams

VOCAB = 50


def row(params: SamplingParams, prompt=(1, 2, 3), output=(), key: str | None = None) -> SamplingRow:
    return SamplingRow(params, list(prompt), list(output), None, (0,), key=key)


def penalized(penalties: Penalties, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    out = logits.clone()
    penalties.apply(out, rows, list(range(len(rows))))
    return out


def reference(logits: torch.Tensor, r: SamplingRow) -> torch.Tensor:
    """One row [V] penalized from its whole history: the repetition penalty on every id of the prompt
    and output, then frequency and presence on the output's counts."""
    x, p, vocab = logits.clone(), r.params, logits.shape[0]
    seen = torch.tensor(sorted({t for t in r.prompt_token_ids + r.output_token_ids if t < vocab}), dtype=torch.long)
    if p.repetition_penalty != 1.0 and len(seen):
        values = x[seen]
        x[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    if p.frequency_penalty or p.presence_penalty:
        counts = torch.bincount(torch.tensor(r.output_token_ids, dtype=torch.long), minlength=vocab).float()
        x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    return x


def test_the_repetition_penalty_is_transformers():
    transformers = pytest.importorskip("transformers")
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    prompt, output = [1, 5, 7], [7, 9, 9]
    ours = penalized(Penalties(), logits, [row(SamplingParams(repetition_penalty=1.3), prompt, output)])
    theirs = transformers.RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + output]), logits.clone())
    assert torch.equal(ours, theirs)


def test_frequency_and_presence_penalties_follow_openai():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    ours = penalized(Penalties(), logits, [row(params, output=[4, 4, 4, 9])])
    expected = logits.clone()
    expected[0, 4] -= 3 * 0.5 + 0.25
    expected[0, 9] -= 1 * 0.5 + 0.25
    assert torch.equal(ours, expected)


SETTINGS = [
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(repetition_penalty=0.8, frequency_penalty=0.5),
    SamplingParams(frequency_penalty=-0.7, presence_penalty=1.5),
    SamplingParams(presence_penalty=0.3),
]


def test_histories_kept_step_by_step_give_the_whole_historys_penalties_in_any_batch():
    """Requests come and go (their rows in the tables reused), grow by a token a step or several at
    once, and share steps in shuffled batches with others; past the tables' first width and 8 slots.
    Every step, every row equals its penalties rebuilt from its whole history."""
    rng = random.Random(0)
    vocab = 4 * MIN_COLUMNS
    penalties = Penalties()
    live: dict[str, SamplingRow] = {}
    made = 0
    for step in range(60):
        while len(live) < 12 or (rng.random() < 0.2 and len(live) < 20):  # new requests
            made += 1
            length = rng.choice([0, 5, MIN_COLUMNS + 40])  # a long one needs wider tables
            prompt = [rng.randrange(vocab + 10) for _ in range(length)]  # some ids past the logits
            live[f"r{made}"] = row(rng.choice(SETTINGS), prompt, key=f"r{made}")
        for key in rng.sample(sorted(live), 3):  # finished
            if rng.random() < 0.3:
                penalties.release([key])
                del live[key]
        for r in live.values():  # each one's tokens since its last step: usually one
            r.output_token_ids.extend(rng.randrange(vocab) for _ in range(rng.choice([1, 1, 1, 3])))
        batch = rng.sample(list(live.values()), rng.randrange(1, len(live) + 1))
        logits = torch.randn(len(batch) + 2, vocab, generator=torch.Generator().manual_seed(step)) * 4
        indices = sorted(rng.sample(range(len(batch) + 2), len(batch)))  # not every logits row is penalized
        rows = [None] * (len(batch) + 2)
        for i, r in zip(indices, batch, strict=True):
            rows[i] = r
        out = logits.clone()
        penalties.apply(out, rows, indices)
        for i in range(len(rows)):
            expected = logits[i] if rows[i] is None else reference(logits[i], rows[i])
            assert torch.equal(out[i], expected), (step, i)
        assert penalties.num_requests <= len(live)
    assert made > 20  # slots were reused and added
    assert penalties.num_bytes >= 16 * 2 * MIN_COLUMNS * 12  # grown in both directions
    penalties.release(list(live))
    assert penalties.num_requests == 0 and penalties.num_bytes == 0  # with none left, the tables go


def test_rows_without_a_key_keep_nothing():
    penalties = Penalties()
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(2))
    rows = [row(SETTINGS[1], output=[4, 4, 8]), row(SETTINGS[2], prompt=[], output=[9])]
    out = penalized(penalties, logits, rows)
    for i, r in enumerate(rows):
        assert torch.equal(out[i], reference(logits[i], r))
    assert penalties.num_requests == 0


def test_an_output_that_went_back_or_a_released_key_starts_again():
    penalties = Penalties()
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3))
    first = row(SETTINGS[1], output=[4, 4, 8, 8, 8], key="a")
    penalized(penalties, logits, [first])
    shorter = row(SETTINGS[1], output=[4, 9], key="a")  # the same key, fewer outputs than counted
    assert torch.equal(penalized(penalties, logits, [shorter])[0], reference(logits[0], shorter))
    penalties.release(["a"])
    assert penalties.num_requests == 0
    other = row(SETTINGS[2], prompt=[7], output=[11], key="a")  # a new request under a released key
    assert torch.equal(penalized(penalties, logits, [other])[0], reference(logits[0], other))
    assert penalties.num_requests == 1


def test_a_step_that_fails_midway_leaves_no_history_ahead_of_its_tables(monkeypatch):
    """A failure after the host's histories moved (here the tables' growth) must not leave a request
    penalized by what a reused row of the tables held: its next step starts from its whole history."""
    penalties = Penalties()
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(4))
    penalized(penalties, logits, [row(SETTINGS[0], prompt=[10, 11], key="old")])
    penalties.release(["old"])  # its row of the tables, holding 10 and 11, is free
    new = row(SETTINGS[0], prompt=[20, 21], key="new")
    fit = Penalties._fit

    def fails_once(self, *args):
        monkeypatch.setattr(Penalties, "_fit", fit)
        raise RuntimeError("out of memory")

    monkeypatch.setattr(Penalties, "_fit", fails_once)
    with pytest.raises(RuntimeError):
        penalized(penalties, logits, [new])
    assert torch.equal(penalized(penalties, logits, [new])[0], reference(logits[0], new))  # the step re-run


def test_the_engine_penalizes_each_request_as_alone_and_forgets_it_when_done(tiny_model_dir):
    from kvserve import LLM
    from tests.conftest import wait_idle_and_check

    penalized = [
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, repetition_penalty=1.5),
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, frequency_penalty=1.5, presence_penalty=0.5),
        SamplingParams(max_tokens=24, temperature=0.8, seed=3, ignore_eos=True, repetition_penalty=0.7),
    ]
    plain = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = [f"request {i}: " + "abc abc abc " * (1 + i) for i in range(6)]
    params = [penalized[i % 3] if i % 4 != 3 else plain for i in range(6)]
    with LLM(str(tiny_model_dir), dtype="float32", kv_cache_tokens=4096, max_num_seqs=8, progress=False) as llm:
        solo = [llm.generate(p, s).token_ids for p, s in zip(prompts, params, strict=True)]
        with ThreadPoolExecutor(len(prompts)) as pool:  # at once: batched together
            together = list(pool.map(lambda i: llm.generate(prompts[i], params[i]).token_ids, range(len(prompts))))
        assert together == solo
        assert solo[0] != llm.generate(prompts[0], plain).token_ids  # the penalty changed something
        wait_idle_and_check(llm)
        assert llm.engine.call(lambda: llm.engine.runner.sampler.penalties.num_requests) == 0
