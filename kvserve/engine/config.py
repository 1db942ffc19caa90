"""EngineConfig: the engine's sizes, fixed at start."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    """Engine sizes, fixed at start. Derived values are properties, never second fields."""

    num_kv_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.num_kv_blocks < 1:
            raise ValueError("block_size and the KV pool must be at least 1")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")

    @property
    def kv_cache_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size
