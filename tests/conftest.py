"""Shared fixtures: the bundled GGUF (fetched once into $KVSERVE_HOME) and tiny random Llama checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve.model_files import DEFAULT_MODEL, pull

TINY_LLAMA = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    initializer_range=0.1,
    tie_word_embeddings=False,
)


@pytest.fixture(scope="session")
def bundled_gguf() -> Path:
    """The default model's GGUF, fetched with `kvserve pull` semantics on first use."""
    return pull(DEFAULT_MODEL, progress=False)


@pytest.fixture(scope="session")
def hf_gguf_tokenizer(bundled_gguf: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(bundled_gguf.parent, gguf_file=bundled_gguf.name)


def make_tiny_llama(path: Path, seed: int = 0, **overrides):
    """Save a random-weight transformers Llama with `overrides` applied to TINY_LLAMA; return it (eval)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, **overrides})).eval()
    model.save_pretrained(path, safe_serialization=True)
    return model
