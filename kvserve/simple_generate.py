"""A minimal single-request generation path over the paged model interface.

Tests use it as a reference with no scheduler in it: one sequence, KV blocks 0..n-1 of a pool
sized for exactly that sequence, bound to the model it is given (never the engine's model).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from kvserve.kv_cache import allocate_kv_cache
from kvserve.layers.attention import build_batch

BLOCK_SIZE = 16


@torch.inference_mode()
def stream_token_ids(
    model: torch.nn.Module,
    prompt_ids: Sequence[int],
    max_tokens: int,
    stop_token_ids: Sequence[int] = (),
    temperature: float = 0.0,
    seed: int | None = None,
) -> Iterator[int]:
    """Yield up to `max_tokens` sampled ids (greedy when temperature == 0), stopping after a stop id."""
    if not prompt_ids:
        raise ValueError("prompt_ids is empty; a prompt needs at least one token.")
    param = next(model.parameters())
    total = len(prompt_ids) + max_tokens
    num_blocks = -(-total // BLOCK_SIZE)
    model.bind_kv_cache(allocate_kv_cache(model.config, num_blocks, BLOCK_SIZE, param.dtype, param.device))
    block_table = list(range(num_blocks))
    generator = torch.Generator(device=param.device)
    if seed is not None:
        generator.manual_seed(seed)
    num_computed, new_ids = 0, list(prompt_ids)
    for _ in range(max_tokens):
        positions, metadata = build_batch([block_table], [num_computed], [len(new_ids)], BLOCK_SIZE, param.device)
        hidden = model(torch.tensor(new_ids, device=param.device), positions, metadata)
        logits = model.compute_logits(hidden[-1:])[0]
        if temperature > 0:
            probs = torch.softmax(logits / temperature, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=generator))
        else:
            token = int(logits.argmax())
        yield token
        if token in stop_token_ids:
            return
        num_computed += len(new_ids)
        new_ids = [token]


@torch.inference_mode()
def prompt_logits(model: torch.nn.Module, prompt_ids: Sequence[int]) -> torch.Tensor:
    """float32 logits of every prompt position, [len(prompt_ids), vocab_size]."""
    param = next(model.parameters())
    num_blocks = -(-len(prompt_ids) // BLOCK_SIZE)
    model.bind_kv_cache(allocate_kv_cache(model.config, num_blocks, BLOCK_SIZE, param.dtype, param.device))
    positions, metadata = build_batch([list(range(num_blocks))], [0], [len(prompt_ids)], BLOCK_SIZE, param.device)
    return model.compute_logits(model(torch.tensor(list(prompt_ids), device=param.device), positions, metadata))
