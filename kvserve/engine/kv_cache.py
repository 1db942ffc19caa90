"""Allocation of the paged KV pool: one (k, v) pair of tensors per layer, allocated once."""

from __future__ import annotations

import torch

from kvserve.models.config import ModelConfig


def allocate_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    num_layers: int | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed `[num_blocks, block_size, num_kv_heads, head_dim]` K and V tensors for each of
    `num_layers` layers (all the model's unless told: a pipeline stage holds its own layers' only): views
    of one [layers, ...] tensor for K and one for V, so that one kernel may reach every layer's cache from
    the first's (layers/persistent_step.py)."""
    layers = config.num_hidden_layers if num_layers is None else num_layers
    shape = (layers, num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    k, v = torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)
    return [(k[i], v[i]) for i in range(layers)]


def kv_cache_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    element = torch.empty(0, dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * element
