"""Paged attention through the Triton kernels (kvserve/kernels/gpu/attention.py): the GPU's backend.

The kernels read each sequence's block table themselves (no gather copy of the cache). A step's
query tokens are cut into tiles of consecutive tokens of one sequence (`tokens_per_tile` of them);
one program attends a tile's tokens x the query heads of one KV head, over key chunks aligned to
absolute positions, so a token's arithmetic is the same in a decode, a prefill or a chunk behind a
cached prefix, and beside any other sequence (R7). `build_triton_batch` makes the metadata once per
step (one host-to-device copy); a CUDA graph keeps one in static buffers (engine/cuda_graphs.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvserve.layers.transfer import to_device

# Up to this many sequences of one new token each, a step splits each one's keys into ranges attended by
# programs of their own (a long decode still occupies the GPU); otherwise the tiles occupy it, and one
# kernel per layer saves the merge and its workspace (splits x tokens x heads x head_dim floats: a long
# prefill's would be hundreds of MB). A token's bits are the same either way (kernels/gpu/attention.py).
MAX_SPLIT_BATCH = 4


def step_num_splits(num_new_tokens: Sequence[int], max_position: int) -> int:
    """Key splits for a step of sequences adding these token counts, the furthest at `max_position`."""
    from kvserve.kernels.gpu.attention import num_splits_for

    is_few_decodes = len(num_new_tokens) <= MAX_SPLIT_BATCH and all(n == 1 for n in num_new_tokens)
    return num_splits_for(max_position) if is_few_decodes else 1


@dataclass(frozen=True)
class TritonAttentionMetadata:
    """Everything the Triton attention needs about one step's batch, on the device; read by every layer."""

    slot_mapping: torch.Tensor  # [T] int32 cache slot of each new token; negative: a padding row, not written
    block_tables: torch.Tensor  # [S, W] int32 block ids of each sequence (padded with 0)
    positions: torch.Tensor  # [T] int32 position of each new token in its sequence
    tile_seq: torch.Tensor  # [num_tiles] int32 row of block_tables
    tile_first: torch.Tensor  # [num_tiles] int32 first token of the tile (a row of q)
    tile_len: torch.Tensor  # [num_tiles] int32 tokens in the tile; 0: a padding tile
    num_splits: int  # key ranges of SPLIT_KEYS attended apart, then combined (fixed for a CUDA graph)
    # with num_splits > 1, kernels/gpu/attention.attention_counters: the splits merged without a launch
    split_counters: torch.Tensor | None = None


def tile_layout(
    num_computed_tokens: Sequence[int], num_new_tokens: Sequence[int], tokens_per_tile: int
) -> tuple[list[int], list[int], list[int]]:
    """(tile_seq, tile_first, tile_len): sequence i's new tokens, flattened in sequence order, cut
    into tiles of up to `tokens_per_tile` consecutive tokens."""
    tile_seq, tile_first, tile_len = [], [], []
    start = 0
    for i, new in enumerate(num_new_tokens):
        for j in range(0, new, tokens_per_tile):
            tile_seq.append(i)
            tile_first.append(start + j)
            tile_len.append(min(tokens_per_tile, new - j))
        start += new
    return tile_seq, tile_first, tile_len


def build_triton_batch(
    block_tables: Sequence[Sequence[int]],
    num_computed_tokens: Sequence[int],
    num_new_tokens: Sequence[int],
    block_size: int,
    tokens_per_tile: int,
    device: torch.device | str,
    split_counters: torch.Tensor | None = None,
) -> tuple[torch.Tensor, TritonAttentionMetadata]:
    """Positions [T] (int32) and the metadata for a step: sequence i has `num_computed_tokens[i]`
    tokens in its blocks and adds `num_new_tokens[i]` (a prompt, a chunk, one decode token). Built on
    the host and copied to the device in one transfer, queued without a stop of the host. `split_counters`: the caller's
    `attention_counters`, kept for its steps."""
    positions = np.concatenate(
        [np.arange(c, c + n, dtype=np.int64) for c, n in zip(num_computed_tokens, num_new_tokens, strict=True)]
    )
    tables = np.zeros((len(block_tables), max(len(t) for t in block_tables)), dtype=np.int64)
    for row, table in enumerate(block_tables):
        tables[row, : len(table)] = table
    seq_of_token = np.repeat(np.arange(len(block_tables)), num_new_tokens)
    slots = tables[seq_of_token, positions // block_size] * block_size + positions % block_size
    tiles = np.array(tile_layout(num_computed_tokens, num_new_tokens, tokens_per_tile), dtype=np.int64)
    # one host array -> one copy; the views below split it again on the device
    packed = torch.from_numpy(
        np.concatenate([positions, slots, tiles.reshape(-1), tables.reshape(-1)]).astype(np.int32)
    )
    on_device = to_device(packed, device)
    num_tokens, num_tiles = len(positions), tiles.shape[1]
    parts = on_device.split([num_tokens, num_tokens, num_tiles, num_tiles, num_tiles, tables.size])
    metadata = TritonAttentionMetadata(
        slot_mapping=parts[1],
        block_tables=parts[5].view(tables.shape),
        positions=parts[0],
        tile_seq=parts[2],
        tile_first=parts[3],
        tile_len=parts[4],
        num_splits=step_num_splits(num_new_tokens, int(positions.max())),
        split_counters=split_counters,
    )
    return parts[0], metadata


def triton_paged_attention(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: TritonAttentionMetadata,
    scale: float,
    window: int = 0,
    quantized: list | None = None,
) -> torch.Tensor:
    """Write the new K/V into the cache, then attend each query over its own sequence's keys up to its
    position (the last `window` of them where window > 0). q: [T, H, D]; k, v: [T, Hkv, D], or None
    where they are in the cache already (elementwise.rotate_and_store). Returns [T, H, D]; with
    `quantized`, kernels/gpu/attention.paged_attention's."""
    from kvserve.kernels.gpu.attention import paged_attention, store_kv

    if k is not None and v is not None:
        store_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
    return paged_attention(
        q,
        k_cache,
        v_cache,
        metadata.block_tables,
        metadata.positions,
        metadata.tile_seq,
        metadata.tile_first,
        metadata.tile_len,
        scale,
        window,
        metadata.num_splits,
        counters=metadata.split_counters,
        quantized=quantized,
    )
