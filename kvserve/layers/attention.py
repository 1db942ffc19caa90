"""Paged attention in plain PyTorch.

The KV cache of one layer is two tensors `[num_blocks, block_size, num_kv_heads, head_dim]`.
A token's K/V lives at slot `block_id * block_size + offset`; a sequence's blocks are listed,
in order, in its row of `block_tables`. One step processes a flattened batch of T new tokens
belonging to B sequences (prefill chunks and decodes alike): the new K/V are written through
`slot_mapping`, every sequence's context is gathered through its block table in one indexing
operation, and a single scaled-dot-product attention call runs over the padded batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class AttentionMetadata:
    """Everything attention needs about one step's batch. Built once per step, read by every layer."""

    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    block_tables: torch.Tensor  # [B, max_blocks] block ids per sequence (padded with 0)
    query_seq_idx: torch.Tensor  # [T] which sequence each new token belongs to
    query_pos_in_seq: torch.Tensor  # [T] index of each new token among its sequence's new tokens
    attn_mask: torch.Tensor  # [B, 1, max_query_len, max_seq_len] True where a query may attend
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return self.block_tables.shape[0]


def build_batch(
    block_tables: Sequence[Sequence[int]],
    num_computed_tokens: Sequence[int],
    num_new_tokens: Sequence[int],
    block_size: int,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, AttentionMetadata]:
    """Positions and attention metadata for a batch.

    Sequence i has `num_computed_tokens[i]` tokens already in its KV blocks and contributes
    `num_new_tokens[i]` new tokens this step (all of a prompt, a chunk of it, or one decode
    token); its block table must cover `num_computed_tokens[i] + num_new_tokens[i]` tokens.
    Returns `(positions [T], metadata)`; the new tokens are flattened in sequence order.
    """
    num_seqs = len(block_tables)
    assert num_seqs == len(num_computed_tokens) == len(num_new_tokens) and num_seqs > 0
    computed = torch.tensor(num_computed_tokens, dtype=torch.int64)
    new = torch.tensor(num_new_tokens, dtype=torch.int64)
    seq_lens = computed + new
    for table, seq_len in zip(block_tables, seq_lens.tolist(), strict=True):
        assert len(table) * block_size >= seq_len, "block table too short for the sequence"
    max_blocks = max(len(t) for t in block_tables)
    tables = torch.zeros(num_seqs, max_blocks, dtype=torch.int64)
    for i, table in enumerate(block_tables):
        tables[i, : len(table)] = torch.tensor(table, dtype=torch.int64)

    query_seq_idx = torch.repeat_interleave(torch.arange(num_seqs), new)  # [T]
    starts = torch.cumsum(new, 0) - new  # [B]
    query_pos_in_seq = torch.arange(int(new.sum())) - starts[query_seq_idx]  # [T]
    positions = computed[query_seq_idx] + query_pos_in_seq  # [T]
    slot_mapping = tables[query_seq_idx, positions // block_size] * block_size + positions % block_size  # [T]

    max_query_len = int(new.max())
    max_seq_len = int(seq_lens.max())
    # Query i of sequence b sits at position computed[b] + i and sees keys 0..that position.
    # Padding rows (i >= new[b]) see key 0 only, so softmax stays finite; their output is dropped.
    query_positions = computed[:, None] + torch.arange(max_query_len)[None, :]  # [B, Q]
    query_positions = torch.where(torch.arange(max_query_len)[None, :] < new[:, None], query_positions, 0)
    attn_mask = torch.arange(max_seq_len)[None, None, :] <= query_positions[:, :, None]  # [B, Q, S]

    metadata = AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        block_tables=tables.to(device),
        query_seq_idx=query_seq_idx.to(device),
        query_pos_in_seq=query_pos_in_seq.to(device),
        attn_mask=attn_mask.unsqueeze(1).to(device),
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
    )
    return positions.to(device), metadata


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write the new K/V into the cache, then attend over each sequence's whole context.

    q: [T, H, D]; k, v: [T, Hkv, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D]
    (mutated in place at `slot_mapping`). Returns [T, H, D].
    """
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, v.to(v_cache.dtype))

    num_seqs, seq_len = metadata.num_seqs, metadata.max_seq_len
    num_table_blocks = metadata.block_tables.shape[1]
    flat_tables = metadata.block_tables.flatten()
    # index_select over whole blocks: one contiguous gather per tensor, [B, S, Hkv, D]
    keys = k_cache.view(k_cache.shape[0], -1).index_select(0, flat_tables)
    keys = keys.view(num_seqs, num_table_blocks * k_cache.shape[1], num_kv_heads, head_dim)[:, :seq_len]
    values = v_cache.view(v_cache.shape[0], -1).index_select(0, flat_tables)
    values = values.view(num_seqs, num_table_blocks * v_cache.shape[1], num_kv_heads, head_dim)[:, :seq_len]
    keys, values = keys.to(q.dtype), values.to(q.dtype)

    if metadata.max_query_len == 1:  # decode-only step: [B] queries, one per sequence
        return _decode_attention(q, keys, values, metadata.attn_mask, scale)

    padded_q = q.new_zeros(num_seqs, metadata.max_query_len, q.shape[1], head_dim)  # [B, Q, H, D]
    padded_q[metadata.query_seq_idx, metadata.query_pos_in_seq] = q
    out = F.scaled_dot_product_attention(
        padded_q.transpose(1, 2),  # [B, H, Q, D]
        keys.transpose(1, 2),  # [B, Hkv, S, D]
        values.transpose(1, 2),
        attn_mask=metadata.attn_mask,
        scale=scale,
        enable_gqa=q.shape[1] != num_kv_heads,
    )  # [B, H, Q, D]
    return out.transpose(1, 2)[metadata.query_seq_idx, metadata.query_pos_in_seq]  # [T, H, D]


def _decode_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, attn_mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """One query per sequence, grouped-query heads kept as groups (no K/V expansion).

    q: [B, H, D]; keys, values: [B, S, Hkv, D]; attn_mask: [B, 1, 1, S]. Returns [B, H, D].
    On CPU this is several times faster than scaled_dot_product_attention for single-token queries.
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[2]
    grouped = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [B, Hkv, G, D]
    scores = torch.einsum("bkgd,bskd->bkgs", grouped, keys).float() * scale  # [B, Hkv, G, S]
    scores = scores.masked_fill(~attn_mask.view(num_seqs, 1, 1, -1), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    out = torch.einsum("bkgs,bskd->bkgd", probs, values)  # [B, Hkv, G, D]
    return out.reshape(num_seqs, num_heads, head_dim)
