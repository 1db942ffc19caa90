"""Paged attention in plain PyTorch, with a cost that follows each sequence's own length.

The KV cache of one layer is two tensors `[num_blocks, block_size, num_kv_heads, head_dim]`.
A token's K/V lives at slot `block_id * block_size + offset`; a sequence's blocks are listed,
in order, in its row of a block table. One step processes a flattened batch of T new tokens
belonging to B sequences (prefill chunks and decodes alike); the new K/V are written through
`slot_mapping` first.

Attention then runs per *group* of sequences. `build_batch` sorts the sequences by context length
and cuts them into groups whose padded size (members x longest context x longest query) stays
within `PADDING_SLACK` of the sum of their own sizes, keeping decodes (one query each) and prefills
apart. A group gathers its members' blocks once and runs one batched attention: grouped einsums for
decodes, scaled_dot_product_attention for prefills. So one long conversation in a batch of short
ones costs its own length once, not the longest length times the batch size, and a decode never
pays for a prefill's query length. The groups are built once per step and read by every layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvserve.layers.attention_triton import TritonAttentionMetadata, triton_paged_attention

PADDING_SLACK = 1.25  # a group's padded work may exceed its members' own work by this factor


@dataclass(frozen=True)
class AttentionGroup:
    """Sequences attended together. Decode groups have one query per sequence."""

    token_idx: torch.Tensor | None  # [Tg] rows of the flattened batch; None: all rows, in order
    block_tables: torch.Tensor  # [G, max_blocks] block ids (padded with 0)
    key_mask: torch.Tensor  # decode: [G, 1, 1, S]; prefill: [G, 1, Q, S]; True where a query may attend
    query_seq_idx: torch.Tensor | None  # prefill: [Tg] member of each query token
    query_pos_in_seq: torch.Tensor | None  # prefill: [Tg] index among the member's new tokens
    max_query_len: int
    max_seq_len: int
    is_fresh_prefill: bool  # one sequence, no earlier context: attend over the new K/V, causally
    query_positions: torch.Tensor  # [G, Q] position of each (padded) query; decode: [G, 1]
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict, compare=False)

    @property
    def is_decode(self) -> bool:
        return self.max_query_len == 1

    def mask(self, window: int) -> torch.Tensor:
        """key_mask for layers that see only the last `window` positions (0: all), made once per step."""
        if not window or self.max_seq_len <= window:
            return self.key_mask
        if window not in self.window_masks:
            keys = torch.arange(self.max_seq_len, device=self.key_mask.device)
            inside = keys[None, None, :] > self.query_positions[:, :, None] - window  # [G, Q, S]
            self.window_masks[window] = self.key_mask & inside.unsqueeze(1)
        return self.window_masks[window]


@dataclass(frozen=True)
class AttentionMetadata:
    """Everything attention needs about one step's batch. Built once per step, read by every layer."""

    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    groups: tuple[AttentionGroup, ...]
    num_tokens: int


# What a model's forward takes about a step: the PyTorch path's groups or the Triton kernels' tiles.
StepMetadata = AttentionMetadata | TritonAttentionMetadata


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
    seq_lens = [c + n for c, n in zip(num_computed_tokens, num_new_tokens, strict=True)]
    starts, positions, slots = [], [], []
    offset = 0
    for table, computed, new, seq_len in zip(block_tables, num_computed_tokens, num_new_tokens, seq_lens, strict=True):
        assert len(table) * block_size >= seq_len, "block table too short for the sequence"
        starts.append(offset)
        offset += new
        for pos in range(computed, seq_len):
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    groups = tuple(
        _build_group(members, block_tables, num_computed_tokens, num_new_tokens, starts, offset, block_size, device)
        for members in _partition(num_new_tokens, seq_lens)
    )
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device), groups=groups, num_tokens=offset
    )
    return torch.tensor(positions, dtype=torch.int64, device=device), metadata


def _partition(num_new_tokens: Sequence[int], seq_lens: Sequence[int]) -> list[list[int]]:
    """Sequence indices cut into groups (decodes apart from prefills), each group sorted by context
    length, longest first, growing while padded work <= PADDING_SLACK x its members' own work."""
    groups: list[list[int]] = []
    for is_decode in (True, False):
        order = sorted(
            (i for i, n in enumerate(num_new_tokens) if (n == 1) == is_decode),
            key=lambda i: (seq_lens[i], num_new_tokens[i]),
            reverse=True,
        )
        current: list[int] = []
        own_work = longest_query = 0
        for i in order:
            work = num_new_tokens[i] * seq_lens[i]
            query = max(longest_query, num_new_tokens[i])
            if current and (len(current) + 1) * query * seq_lens[current[0]] > PADDING_SLACK * (own_work + work):
                groups.append(current)
                current, own_work, query = [], 0, num_new_tokens[i]
            current.append(i)
            own_work += work
            longest_query = query
        if current:
            groups.append(current)
    return groups


def _build_group(
    members: list[int],
    block_tables: Sequence[Sequence[int]],
    num_computed_tokens: Sequence[int],
    num_new_tokens: Sequence[int],
    starts: list[int],
    num_tokens: int,
    block_size: int,
    device: torch.device | str,
) -> AttentionGroup:
    computed = torch.tensor([num_computed_tokens[i] for i in members], dtype=torch.int64)
    new = torch.tensor([num_new_tokens[i] for i in members], dtype=torch.int64)
    seq_lens = computed + new
    max_seq_len, max_query_len = int(seq_lens.max()), int(new.max())
    num_table_blocks = -(-max_seq_len // block_size)
    tables = torch.zeros(len(members), num_table_blocks, dtype=torch.int64)
    for row, i in enumerate(members):
        table = block_tables[i][:num_table_blocks]
        tables[row, : len(table)] = torch.tensor(table, dtype=torch.int64)
    token_idx = torch.cat([torch.arange(starts[i], starts[i] + num_new_tokens[i]) for i in members])
    is_all_in_order = len(token_idx) == num_tokens and bool((token_idx == torch.arange(num_tokens)).all())

    keys = torch.arange(max_seq_len)
    query_seq_idx = query_pos_in_seq = None
    if max_query_len == 1:
        key_mask = (keys[None, :] < seq_lens[:, None]).view(len(members), 1, 1, max_seq_len)
        query_positions = (seq_lens - 1)[:, None]
    else:
        query_seq_idx = torch.repeat_interleave(torch.arange(len(members)), new)  # [Tg]
        query_pos_in_seq = torch.arange(int(new.sum())) - (torch.cumsum(new, 0) - new)[query_seq_idx]  # [Tg]
        # Query i of member b sits at position computed[b] + i and sees keys 0..that position.
        # Padding rows (i >= new[b]) see key 0 only, so softmax stays finite; their output is dropped.
        query_positions = computed[:, None] + torch.arange(max_query_len)[None, :]  # [G, Q]
        query_positions = torch.where(torch.arange(max_query_len)[None, :] < new[:, None], query_positions, 0)
        key_mask = (keys[None, None, :] <= query_positions[:, :, None]).unsqueeze(1)  # [G, 1, Q, S]
    return AttentionGroup(
        token_idx=None if is_all_in_order else token_idx.to(device),
        block_tables=tables.to(device),
        key_mask=key_mask.to(device),
        query_seq_idx=None if query_seq_idx is None else query_seq_idx.to(device),
        query_pos_in_seq=None if query_pos_in_seq is None else query_pos_in_seq.to(device),
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        is_fresh_prefill=len(members) == 1 and int(computed[0]) == 0 and max_query_len > 1,
        query_positions=query_positions.to(device),
    )


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: StepMetadata,
    scale: float,
    window: int = 0,
    quantized: list | None = None,
) -> torch.Tensor:
    """Write the new K/V into the cache, then attend over each sequence's whole context (each query
    over the last `window` positions, its own included, where window > 0): here in PyTorch, or
    through the Triton kernels for metadata built by `build_triton_batch` (the GPU's path).

    q: [T, H, D]; k, v: [T, Hkv, D], or None on the Triton path where a kernel wrote them already;
    k_cache, v_cache: [num_blocks, block_size, Hkv, D] (mutated in place at `slot_mapping`). Returns
    [T, H, D]. `quantized`: the Triton kernels may append the output's int8 form to it (o_proj's inputs).
    """
    if isinstance(metadata, TritonAttentionMetadata):
        return triton_paged_attention(q, k, v, k_cache, v_cache, metadata, scale, window, quantized)
    assert k is not None and v is not None, "the new keys and values, written here"
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, v.to(v_cache.dtype))
    if len(metadata.groups) == 1 and metadata.groups[0].token_idx is None:
        return _attend(q, k, v, k_cache, v_cache, metadata.groups[0], scale, window)
    out = torch.empty_like(q)
    for group in metadata.groups:
        idx = group.token_idx
        out[idx] = _attend(q[idx], k[idx], v[idx], k_cache, v_cache, group, scale, window)
    return out


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: AttentionGroup,
    scale: float,
    window: int,
) -> torch.Tensor:
    """One group: q [Tg, H, D] (its members' new tokens, in member order) -> [Tg, H, D]."""
    is_gqa = q.shape[1] != k.shape[1]
    key_mask = group.mask(window)
    if group.is_fresh_prefill:  # the new K/V are the whole context
        causal = key_mask is group.key_mask
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),  # [1, H, T, D]
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=None if causal else key_mask,
            is_causal=causal,
            scale=scale,
            enable_gqa=is_gqa,
        )  # [1, H, T, D]
        return out[0].transpose(0, 1)
    keys, values = _gather(k_cache, group), _gather(v_cache, group)  # [G, S, Hkv, D]
    keys, values = keys.to(q.dtype), values.to(q.dtype)
    if group.is_decode:
        return _decode_attention(q, keys, values, key_mask, scale)
    num_seqs = group.block_tables.shape[0]
    padded_q = q.new_zeros(num_seqs, group.max_query_len, q.shape[1], q.shape[2])  # [G, Q, H, D]
    padded_q[group.query_seq_idx, group.query_pos_in_seq] = q
    out = F.scaled_dot_product_attention(
        padded_q.transpose(1, 2),  # [G, H, Q, D]
        keys.transpose(1, 2),  # [G, Hkv, S, D]
        values.transpose(1, 2),
        attn_mask=key_mask,
        scale=scale,
        enable_gqa=is_gqa,
    )  # [G, H, Q, D]
    return out.transpose(1, 2)[group.query_seq_idx, group.query_pos_in_seq]  # [Tg, H, D]


def _gather(cache: torch.Tensor, group: AttentionGroup) -> torch.Tensor:
    """The members' contexts as [G, S, Hkv, D]: one index_select over whole blocks."""
    num_seqs, num_table_blocks = group.block_tables.shape
    rows = cache.view(cache.shape[0], -1).index_select(0, group.block_tables.flatten())
    return rows.view(num_seqs, num_table_blocks * cache.shape[1], *cache.shape[2:])[:, : group.max_seq_len]


def _decode_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, key_mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """One query per sequence. The G query heads that share a KV head become G queries of that
    head, so no K/V is expanded and no causal mask is needed, only the members' key lengths.

    q: [B, H, D]; keys, values: [B, S, Hkv, D]; key_mask: [B, 1, 1, S]. Returns [B, H, D].
    On CPU this is faster than grouped einsums (and than SDPA's own GQA path) for decodes.
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[2]
    grouped = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [B, Hkv, G, D]
    out = F.scaled_dot_product_attention(
        grouped, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=key_mask, scale=scale
    )  # [B, Hkv, G, D]
    return out.reshape(num_seqs, num_heads, head_dim)
