"""kvserve's Llama over the paged KV interface vs Hugging Face transformers, on tiny random models.

A batch of sequences of different lengths is prefilled in one flattened forward, then decoded for
8 steps, with one sequence prefilled in chunks alongside the decodes; blocks are deliberately
scattered through the pool. Every logit must equal transformers' full-sequence forward within 1e-4.
"""

from __future__ import annotations

import pytest
import torch

from kvserve.engine.kv_cache import allocate_kv_cache
from kvserve.layers.attention import build_batch
from kvserve.weights.loader import load_model
from tests.conftest import make_tiny_llama

pytest.importorskip("transformers")

VARIANTS = {
    "gqa-untied": {},
    "mha-tied": dict(num_key_value_heads=4, tie_word_embeddings=True),
    "llama3-rope-mqa": dict(
        num_key_value_heads=1,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "linear-rope-headdim-bias": dict(
        head_dim=24, rope_scaling={"rope_type": "linear", "factor": 2.0}, attention_bias=True
    ),
}
BLOCK_SIZE = 4
NUM_BLOCKS = 64


class PagedSequences:
    """Test-side bookkeeping: token ids, computed counts and scattered block tables per sequence."""

    def __init__(self, prompts: list[list[int]], seed: int) -> None:
        self.tokens = [list(p) for p in prompts]
        self.computed = [0] * len(prompts)
        free = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed)).tolist()
        self.tables: list[list[int]] = [[] for _ in prompts]
        self._free = free

    def schedule(self, seq: int, num_new: int) -> None:
        needed = -(-(self.computed[seq] + num_new) // BLOCK_SIZE)
        while len(self.tables[seq]) < needed:
            self.tables[seq].append(self._free.pop())


def _reference_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_transformers_through_prefill_and_decode(tmp_path, variant):
    hf_model = make_tiny_llama(tmp_path, seed=hash(variant) % 1000, **VARIANTS[variant])
    model = load_model(tmp_path, torch.float32, progress=False)
    model.bind_kv_cache(allocate_kv_cache(model.config, NUM_BLOCKS, BLOCK_SIZE, torch.float32, "cpu"))
    gen = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    lengths = [5, 13, 1, 29, 23]  # the last one is prefilled in chunks of 7 during the decode steps
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]
    seqs = PagedSequences(prompts, seed=2)
    chunked = len(prompts) - 1

    worst = 0.0
    for step in range(9):  # step 0 prefills, steps 1..8 decode
        batch, new_counts = [], []
        for i in range(len(prompts)):
            if i == chunked:
                num_new = min(7, len(seqs.tokens[i]) - seqs.computed[i])
                if num_new == 0:  # prefill finished: decode like the others
                    seqs.tokens[i].append(int(torch.randint(0, vocab, (1,), generator=gen)))
                    num_new = 1
            elif step == 0:
                num_new = len(seqs.tokens[i])
            else:
                seqs.tokens[i].append(int(torch.randint(0, vocab, (1,), generator=gen)))
                num_new = 1
            seqs.schedule(i, num_new)
            batch.append(i)
            new_counts.append(num_new)
        input_ids = [t for i, n in zip(batch, new_counts, strict=True) for t in seqs.tokens[i][seqs.computed[i] :][:n]]
        positions, metadata = build_batch(
            [seqs.tables[i] for i in batch], [seqs.computed[i] for i in batch], new_counts, BLOCK_SIZE
        )
        with torch.inference_mode():
            logits = model.compute_logits(model(torch.tensor(input_ids), positions, metadata))
        offset = 0
        for i, n in zip(batch, new_counts, strict=True):
            end = seqs.computed[i] + n
            expected = _reference_logits(hf_model, seqs.tokens[i][:end])[seqs.computed[i] : end]
            diff = (logits[offset : offset + n] - expected).abs().max().item()
            worst = max(worst, diff)
            offset += n
            seqs.computed[i] = end
    assert worst <= 1e-4, f"max |logit difference| {worst:.2e} > 1e-4"
    assert all(len(t) == c for t, c in zip(seqs.tokens, seqs.computed, strict=True))


def test_bfloat16_tracks_float32(tmp_path):
    hf_model = make_tiny_llama(tmp_path, seed=3)
    model = load_model(tmp_path, torch.bfloat16, progress=False)
    assert next(model.parameters()).dtype == torch.bfloat16
    model.bind_kv_cache(allocate_kv_cache(model.config, 16, BLOCK_SIZE, torch.bfloat16, "cpu"))
    tokens = torch.randint(0, model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    positions, metadata = build_batch([list(range(10))], [0], [len(tokens)], BLOCK_SIZE)
    with torch.inference_mode():
        logits = model.compute_logits(model(torch.tensor(tokens), positions, metadata))
    expected = _reference_logits(hf_model, tokens)
    cosine = torch.nn.functional.cosine_similarity(logits, expected, dim=-1)
    assert cosine.min().item() > 0.99
    assert (logits - expected).abs().max().item() > 1e-6  # really computed in bfloat16


def test_sharded_safetensors_load_like_a_single_file(tmp_path):
    hf_model = make_tiny_llama(tmp_path / "single", seed=5)
    hf_model.save_pretrained(tmp_path / "sharded", safe_serialization=True, max_shard_size="50KB")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    single = load_model(tmp_path / "single", progress=False).state_dict()
    sharded = load_model(tmp_path / "sharded", progress=False).state_dict()
    assert single.keys() == sharded.keys()
    for name in single:
        assert torch.equal(single[name], sharded[name]), name
