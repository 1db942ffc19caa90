"""A minimal single-request generation path over the paged model interface.

Tests use it as a reference with no scheduler in it: one sequence, KV blocks 0..n-1 of a pool
sized for exactly that sequence, bound to the model it is given (never the engine's model).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from kvserve.engine.kv_cache import allocate_kv_cache
from kvserve.layers.attention import build_batch

BLOCK_SIZE = 16


def _bind_pool(model: torch.nn.Module, num_tokens: int) -> tuple[list[int], torch.device]:
    """Bind a KV pool of exactly enough blocks for `num_tokens`; return its block table and device."""
    param = next(model.parameters())
    num_blocks = -(-num_tokens // BLOCK_SIZE)
    model.bind_kv_cache(allocate_kv_cache(model.config, num_blocks, BLOCK_SIZE, param.dtype, param.device))
    return list(range(num_blocks)), param.device


@torch.inference_mode()
def stream_token_ids(model: torch.nn.Module, prompt_ids: Sequence[int], max_tokens: int) -> Iterator[int]:
    """Yield `max_tokens` greedy token ids (no stop rule: references compare fixed lengths)."""
    if not prompt_ids:
        raise ValueError("prompt_ids is empty; a prompt needs at least one token.")
    block_table, device = _bind_pool(model, len(prompt_ids) + max_tokens)
    num_computed, new_ids = 0, list(prompt_ids)
    for _ in range(max_tokens):
        positions, metadata = build_batch([block_table], [num_computed], [len(new_ids)], BLOCK_SIZE, device)
        hidden = model(torch.tensor(new_ids, device=device), positions, metadata)
        token = int(model.compute_logits(hidden[-1:])[0].argmax())
        yield token
        num_computed += len(new_ids)
        new_ids = [token]


@torch.inference_mode()
def prompt_logits(model: torch.nn.Module, prompt_ids: Sequence[int]) -> torch.Tensor:
    """float32 logits of every prompt position, [len(prompt_ids), vocab_size]."""
    block_table, device = _bind_pool(model, len(prompt_ids))
    positions, metadata = build_batch([block_table], [0], [len(prompt_ids)], BLOCK_SIZE, device)
    return model.compute_logits(model(torch.tensor(list(prompt_ids), device=device), positions, metadata))
