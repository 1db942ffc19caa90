"""Paged attention over a block-table KV cache, batch invariant (R7), and the cache writes.

The KV cache of one layer is `k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]`; the
token at position p of a sequence lives at slot `block_table[p // block_size] * block_size +
p % block_size`. The caller cuts a step's query tokens into tiles of up to `tokens_per_tile`
consecutive tokens of one sequence.

One program attends one tile x one KV head (x one split of the keys): its rows are the tile's tokens x
the query heads of that KV head, padded to a fixed `ROWS`, so a block of K/V is read once for all of
them. Keys go in chunks of `BLOCK_N` aligned to absolute positions, in increasing order, with an
online softmax in float32. A row's running max starts at a large finite negative and its masked
scores are -inf, so a chunk whose keys are all masked for the row leaves it unchanged bit for bit:
a token's arithmetic never depends on the tile's other tokens, which is what makes a decode step, a
prefill and a chunk behind a cached prefix give the same bits.

Keys are also cut into splits of `SPLIT_KEYS` absolute positions. Each split is attended from a fresh
state, and a token's result is the merge of its splits' states in increasing order (`_merge`), the
same arithmetic whichever program does it: with num_splits > 1 one program per split writes its
state to a workspace and the last of a (tile, KV head)'s programs to finish merges them (counted by
an atomic add; a combine kernel does it where there are no counters); with num_splits = 1 each
program walks all the tile's splits and merges them itself (no workspace: what a long prefill wants).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.kernels.gpu import INTERPRET, launch_options, next_power_of_2
from kvserve.kernels.gpu.common import cast, dot, quantize_groups, store_groups, tile_count, tile_index, wait_for_prior

ROWS = 16  # query rows (tokens x query heads of a KV head) per program, padded; the same for decode and prefill
BLOCK_N = 64  # keys per chunk, aligned to absolute positions (chunk c holds keys c * BLOCK_N ...)
SPLIT_KEYS = 512  # keys per split (a multiple of BLOCK_N): a decode of L keys gets ceil(L / 512) programs per head
NUM_WARPS = 8  # at head_dim 128: 80 registers a thread, no spills up to head_dim 256 (4 warps spill there)
NUM_STAGES = 2  # pipelining depth of the chunk loop
STORE_NUM_WARPS = 1  # store_kv moves one token's Hkv x D values per program: a warp's worth
# a row's running max before its first key: finite, so exp(EMPTY_MAX - m) is 0 or 1, never NaN
EMPTY_MAX: tl.constexpr = tl.constexpr(-1e30)

_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


# (tile, KV head) counters for merging splits in the attention kernel (`attention_counters`): a step of
# MAX_SPLIT_BATCH decodes (layers/attention_triton.py) has that many tiles; a call of more tiles than
# this launches `_combine_kernel` instead.
ATTENTION_COUNTERS = 1024


def attention_counters(device: torch.device | str) -> torch.Tensor:
    """The counters with which each (tile, KV head)'s last split merges the splits (`paged_attention`'s
    `counters`), all 0 between calls: one set serves every layer of a step, as calls on one stream
    are ordered."""
    return torch.zeros(ATTENTION_COUNTERS, dtype=torch.int32, device=device)


def _rows(group: int) -> int:
    """Rows of a program: ROWS, or the next power of two >= the query heads per KV head."""
    return max(ROWS, next_power_of_2(group))


def tokens_per_tile(num_heads: int, num_kv_heads: int) -> int:
    """Consecutive query tokens of one sequence that one program attends (a tile holds at most this)."""
    group = num_heads // num_kv_heads
    return _rows(group) // group


def num_splits_for(max_position: int) -> int:
    """Splits of SPLIT_KEYS that cover the keys of a token at `max_position` (its keys 0..max_position)."""
    return max_position // SPLIT_KEYS + 1


@triton.jit(do_not_specialize=["slot_mapping"])
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache,
    v_cache,
    slot_mapping,
    num_kv_heads,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_prior(PDL)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping + token).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    width = tl.where(slot >= 0, HEAD_DIM, 0)  # a negative slot is a padding row: nothing written
    mask = (h < num_kv_heads) & (d < width)
    block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    k = tl.load(k_ptr + token * stride_kt + h * stride_kh + d, mask=mask, other=0.0)  # [BLOCK_H, BLOCK_D]
    v = tl.load(v_ptr + token * stride_vt + h * stride_vh + d, mask=mask, other=0.0)
    k = cast(k.to(tl.float32), k_cache.dtype.element_ty, INTERPRET)
    v = cast(v.to(tl.float32), v_cache.dtype.element_ty, INTERPRET)
    tl.store(k_cache + block * stride_kcb + offset * stride_kcs + h * stride_kch + d, k, mask=mask)
    tl.store(v_cache + block * stride_vcb + offset * stride_vcs + h * stride_vch + d, v, mask=mask)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write k, v [T, Hkv, D] into the caches at slot_mapping [T] (int32 or int64), converted to the
    cache's dtype (rounded to nearest even). Tokens whose slot is negative are skipped."""
    num_tokens, num_kv_heads, head_dim = k.shape
    assert v.shape == k.shape and slot_mapping.shape == (num_tokens,), (k.shape, v.shape, slot_mapping.shape)
    assert k_cache.shape[2:] == (num_kv_heads, head_dim) and v_cache.shape == k_cache.shape, k_cache.shape
    assert k.stride(-1) == v.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        num_kv_heads,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        BLOCK_SIZE=k_cache.shape[1],
        HEAD_DIM=head_dim,
        BLOCK_H=next_power_of_2(num_kv_heads),
        BLOCK_D=next_power_of_2(head_dim),
        INTERPRET=INTERPRET,
        num_warps=STORE_NUM_WARPS,
        **launch_options(k.device),
    )


@triton.jit
def _merge(m, denom, acc, m_split, denom_split, acc_split):
    """The online-softmax state (running max m [R], sum denom [R], unnormalized output acc [R, D]) merged
    with a split's; merging an empty state (EMPTY_MAX, 0, 0) changes nothing, bit for bit. The FMAs
    are spelled out so that every kernel that merges does the same roundings."""
    m_new = tl.maximum(m, m_split)
    a = tl.exp(m - m_new)
    b = tl.exp(m_split - m_new)
    denom = tl.fma(denom, a, denom_split * b)
    acc = tl.fma(acc, a[:, None], acc_split * b[:, None])
    return m_new, denom, acc


@triton.jit
def _attend_split(
    q,
    pos,
    first_key,
    key_begin,
    key_end,
    split,
    table,
    k_head,
    v_head,
    scale,
    stride_kb,
    stride_ks,
    stride_vb,
    stride_vs,
    DOT_DTYPE: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_KEYS: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """The online-softmax state of rows q [ROWS, BLOCK_D] (positions pos [ROWS], first visible key
    first_key [ROWS]) over the keys of split `split` within the tile's [key_begin, key_end)."""
    m = tl.full((ROWS,), EMPTY_MAX, tl.float32)
    denom = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, BLOCK_D), tl.float32)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    chunk_begin = tl.maximum(split * SPLIT_KEYS, key_begin) // BLOCK_N
    chunk_end = tl.cdiv(tl.minimum((split + 1) * SPLIT_KEYS, key_end), BLOCK_N)
    for chunk in range(chunk_begin, chunk_end):
        keys = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
        in_tile = keys < key_end  # keys past the tile's last token are not read (their blocks may not exist)
        block = tl.load(table + keys // BLOCK_SIZE, mask=in_tile, other=0).to(tl.int64)
        offset = keys % BLOCK_SIZE
        kv_mask = in_tile[:, None] & d_mask[None, :]  # [BLOCK_N, BLOCK_D]
        kv_mask_t = d_mask[:, None] & in_tile[None, :]  # [BLOCK_D, BLOCK_N], as K is read
        k = tl.load(k_head + (block * stride_kb + offset * stride_ks)[None, :] + d[:, None], mask=kv_mask_t, other=0.0)
        scores = dot(q, k.to(DOT_DTYPE), tl.zeros((ROWS, BLOCK_N), tl.float32), INTERPRET) * scale  # [ROWS, BLOCK_N]
        visible = (keys[None, :] <= pos[:, None]) & (keys[None, :] >= first_key[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)  # 1 where the chunk has no visible key for the row
        p = tl.exp(scores - m_new[:, None])  # 0 at masked keys
        denom = tl.fma(denom, alpha, tl.sum(p, axis=1))
        v = tl.load(v_head + (block * stride_vb + offset * stride_vs)[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc = dot(cast(p, DOT_DTYPE, INTERPRET), v.to(DOT_DTYPE), acc * alpha[:, None], INTERPRET)
        m = m_new
    return m, denom, acc


@triton.jit
def _tile_rows(positions, tile_first, tile, num_tokens, window, GROUP: tl.constexpr, ROWS: tl.constexpr):
    """A tile's rows (token x query head of the program's KV head), whether each is real, its position
    and first visible key, and the tile's keys [key_begin, key_end)."""
    first = tl.load(tile_first + tile)
    r = tl.arange(0, ROWS)
    is_row = r < num_tokens * GROUP
    token = (first + r // GROUP).to(tl.int64)  # [ROWS] row of q
    pos = tl.load(positions + token, mask=is_row, other=-1)  # [ROWS]; a padding row sees no key
    first_key = tl.where(window > 0, tl.maximum(pos - window + 1, 0), 0)
    first_pos = tl.load(positions + first)  # the tile's positions are consecutive
    key_begin = tl.where(window > 0, tl.maximum(first_pos - window + 1, 0), 0)
    key_end = tl.load(positions + first + num_tokens - 1) + 1
    return r, is_row, token, pos, first_key, key_begin, key_end


@triton.jit
def _store_rows(
    out_ptr,
    acc,
    denom,
    is_row,
    token,
    head,
    stride_ot,
    stride_oh,
    words_ptr,
    dq_ptr,
    sq_ptr,
    num_heads,
    HEAD_DIM: tl.constexpr,
    QUANTIZE: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """out[token, head] = acc / denom for the real rows, rounded to out's dtype. QUANTIZE (out [T, H, D]
    contiguous, D a power of two and a multiple of 32): also each row as stored, per group of 32, in
    `quantize_groups`'s int8 form at [token, head * D / 32 + group] of [T, H * D / 32] groups: o_proj's
    inputs as matmul.quantize_int8 makes them from out viewed as [T, H * D]."""
    d = tl.arange(0, acc.shape[1])
    out = acc / tl.where(is_row, denom, 1.0)[:, None]
    offsets = token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    mask = is_row[:, None] & (d < HEAD_DIM)[None, :]
    out = cast(out, out_ptr.dtype.element_ty, INTERPRET)
    tl.store(out_ptr + offsets, out, mask=mask)
    if QUANTIZE:
        GROUPS: tl.constexpr = HEAD_DIM // 32  # per row
        ROWS: tl.constexpr = acc.shape[0]
        words, dq, sq = quantize_groups(tl.reshape(out.to(tl.float32), (ROWS * GROUPS, 32)), INTERPRET)
        group = (token * num_heads + head)[:, None] * GROUPS + tl.arange(0, GROUPS)[None, :]  # [ROWS, GROUPS]
        g_mask = is_row[:, None] & (tl.arange(0, GROUPS) < GROUPS)[None, :]
        store_groups(words, dq, sq, group, g_mask, words_ptr, dq_ptr, sq_ptr)


# one binary for every batch: no specialization on the batch's sizes, nor on where its metadata lies
_BATCH_ARGS = ["block_tables", "positions", "tile_seq", "tile_first", "tile_len", "part_stride"]


@triton.jit
def _attention_tile(
    q_ptr,
    k_cache,
    v_cache,
    out_ptr,
    part_m,
    part_denom,
    part_acc,
    counters_ptr,
    block_tables,
    positions,
    tile_seq,
    tile_first,
    tile_len,
    scale,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_table,
    num_heads,
    part_stride,
    words_ptr,
    dq_ptr,
    sq_ptr,
    DOT_DTYPE: tl.constexpr,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_KEYS: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    COMBINE_IN_TILE: tl.constexpr,
    QUANTIZE: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr = False,
    tile_at=None,  # the (tile, KV head) and key split `split_at` of `splits`, `kv_heads` KV heads; None: this
    kv_head_at=None,  # program's (a program a tile, KV head and split: `_attention_kernel`)
    split_at=None,
    kv_heads=None,
    splits=None,
):
    """A (tile, KV head, key split) of the attention: `_attention_kernel`'s program, for any program that takes
    one (a kernel that loops over them gives their indices)."""
    wait_for_prior(PDL)
    tile = tile_index(tile_at, 0)
    kv_head = tile_index(kv_head_at, 1)
    num_tokens = tl.load(tile_len + tile)
    if num_tokens > 0:  # a tile of length 0 pads a CUDA graph's batch
        r, is_row, token, pos, first_key, key_begin, key_end = _tile_rows(
            positions, tile_first, tile, num_tokens, window, GROUP, ROWS
        )
        head = kv_head * GROUP + r % GROUP  # [ROWS] query head
        d = tl.arange(0, BLOCK_D)
        row_mask = is_row[:, None] & (d < HEAD_DIM)[None, :]
        q = tl.load(
            q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=row_mask, other=0.0
        )
        q = q.to(DOT_DTYPE)
        table = block_tables + tl.load(tile_seq + tile).to(tl.int64) * stride_table
        k_head = k_cache + kv_head * stride_kh
        v_head = v_cache + kv_head * stride_vh
        if IS_SPLIT:
            split = tile_index(split_at, 2)
            if (split * SPLIT_KEYS < key_end) & ((split + 1) * SPLIT_KEYS > key_begin):  # else: no key of the tile
                m, denom, acc = _attend_split(
                    q, pos, first_key, key_begin, key_end, split, table, k_head, v_head, scale,
                    stride_kb, stride_ks, stride_vb, stride_vs,
                    DOT_DTYPE, ROWS, BLOCK_SIZE, HEAD_DIM, BLOCK_D, BLOCK_N, SPLIT_KEYS, INTERPRET,
                )  # fmt: skip
                state = split * part_stride + token * num_heads + head  # [ROWS] into [splits, T, H]
                tl.store(part_m + state, m, mask=is_row)
                tl.store(part_denom + state, denom, mask=is_row)
                tl.store(part_acc + state[:, None] * HEAD_DIM + d[None, :], acc, mask=row_mask)
            if COMBINE_IN_TILE:  # the (tile, KV head)'s last split to finish merges them all
                tl.debug_barrier()  # every thread's state stored before the count (released with it)
                counter = counters_ptr + tile * tile_count(kv_heads, 1) + kv_head
                if tl.atomic_add(counter, 1, sem="acq_rel") == tile_count(splits, 2) - 1:
                    _combine_splits(
                        out_ptr, part_m, part_denom, part_acc, r, is_row, token, pos, first_key, key_begin,
                        key_end, kv_head, stride_ot, stride_oh, num_heads, part_stride, words_ptr, dq_ptr, sq_ptr,
                        GROUP, ROWS, HEAD_DIM, BLOCK_D, SPLIT_KEYS, QUANTIZE, INTERPRET,
                    )  # fmt: skip
                    tl.store(counter, 0)  # for the next call
        else:
            m = tl.full((ROWS,), EMPTY_MAX, tl.float32)
            denom = tl.zeros((ROWS,), tl.float32)
            acc = tl.zeros((ROWS, BLOCK_D), tl.float32)
            for split in range(key_begin // SPLIT_KEYS, tl.cdiv(key_end, SPLIT_KEYS)):
                m_split, denom_split, acc_split = _attend_split(
                    q, pos, first_key, key_begin, key_end, split, table, k_head, v_head, scale,
                    stride_kb, stride_ks, stride_vb, stride_vs,
                    DOT_DTYPE, ROWS, BLOCK_SIZE, HEAD_DIM, BLOCK_D, BLOCK_N, SPLIT_KEYS, INTERPRET,
                )  # fmt: skip
                m, denom, acc = _merge(m, denom, acc, m_split, denom_split, acc_split)
            _store_rows(
                out_ptr, acc, denom, is_row, token, head, stride_ot, stride_oh, words_ptr, dq_ptr, sq_ptr, num_heads,
                HEAD_DIM, QUANTIZE, INTERPRET,
            )  # fmt: skip


@triton.jit(do_not_specialize=[*_BATCH_ARGS, "stride_table"])  # a step's block tables are as wide as its longest
def _attention_kernel(
    q_ptr, k_cache, v_cache, out_ptr, part_m, part_denom, part_acc, counters_ptr,
    block_tables, positions, tile_seq, tile_first, tile_len, scale, window,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_table, num_heads, part_stride, words_ptr, dq_ptr, sq_ptr,
    DOT_DTYPE: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_KEYS: tl.constexpr,
    IS_SPLIT: tl.constexpr, COMBINE_IN_TILE: tl.constexpr, QUANTIZE: tl.constexpr, INTERPRET: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """`_attention_tile` (whose parameters these are), a program a (tile, KV head, key split): the grid's
    axes 0, 1, 2."""
    _attention_tile(
        q_ptr, k_cache, v_cache, out_ptr, part_m, part_denom, part_acc, counters_ptr,
        block_tables, positions, tile_seq, tile_first, tile_len, scale, window,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        stride_table, num_heads, part_stride, words_ptr, dq_ptr, sq_ptr,
        DOT_DTYPE, GROUP, ROWS, BLOCK_SIZE, HEAD_DIM, BLOCK_D, BLOCK_N, SPLIT_KEYS,
        IS_SPLIT, COMBINE_IN_TILE, QUANTIZE, INTERPRET, PDL,
    )  # fmt: skip


@triton.jit
def _combine_splits(
    out_ptr,
    part_m,
    part_denom,
    part_acc,
    r,
    is_row,
    token,
    pos,
    first_key,
    key_begin,
    key_end,
    kv_head,
    stride_ot,
    stride_oh,
    num_heads,
    part_stride,
    words_ptr,
    dq_ptr,
    sq_ptr,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT_KEYS: tl.constexpr,
    QUANTIZE: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Merge each row's splits (only those holding its keys) in increasing order, as the attention
    kernel does in registers with num_splits = 1, and normalize. The states are read from L2 (".cg"):
    other multiprocessors stored them."""
    head = kv_head * GROUP + r % GROUP
    first_split = first_key // SPLIT_KEYS  # [ROWS] the splits holding the row's keys
    last_split = pos // SPLIT_KEYS
    d = tl.arange(0, BLOCK_D)
    row_mask = is_row[:, None] & (d < HEAD_DIM)[None, :]
    m = tl.full((ROWS,), EMPTY_MAX, tl.float32)
    denom = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, BLOCK_D), tl.float32)
    for split in range(key_begin // SPLIT_KEYS, tl.cdiv(key_end, SPLIT_KEYS)):
        # a split without keys of the row holds the empty state: taken as such, not read
        has = is_row & (first_split <= split) & (split <= last_split)
        state = split * part_stride + token * num_heads + head
        m_split = tl.load(part_m + state, mask=has, other=EMPTY_MAX, cache_modifier=".cg")
        denom_split = tl.load(part_denom + state, mask=has, other=0.0, cache_modifier=".cg")
        acc_split = tl.load(
            part_acc + state[:, None] * HEAD_DIM + d[None, :],
            mask=has[:, None] & row_mask,
            other=0.0,
            cache_modifier=".cg",
        )
        m, denom, acc = _merge(m, denom, acc, m_split, denom_split, acc_split)
    _store_rows(
        out_ptr, acc, denom, is_row, token, head, stride_ot, stride_oh, words_ptr, dq_ptr, sq_ptr, num_heads,
        HEAD_DIM, QUANTIZE, INTERPRET,
    )  # fmt: skip


@triton.jit(do_not_specialize=_BATCH_ARGS)
def _combine_kernel(
    out_ptr,
    part_m,
    part_denom,
    part_acc,
    positions,
    tile_first,
    tile_len,
    window,
    stride_ot,
    stride_oh,
    num_heads,
    part_stride,
    words_ptr,
    dq_ptr,
    sq_ptr,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT_KEYS: tl.constexpr,
    QUANTIZE: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """`_combine_splits` for each (tile, KV head): where the attention kernel has no counters."""
    wait_for_prior(PDL)
    tile = tl.program_id(0)
    num_tokens = tl.load(tile_len + tile)
    if num_tokens > 0:
        r, is_row, token, pos, first_key, key_begin, key_end = _tile_rows(
            positions, tile_first, tile, num_tokens, window, GROUP, ROWS
        )
        _combine_splits(
            out_ptr, part_m, part_denom, part_acc, r, is_row, token, pos, first_key, key_begin, key_end,
            tl.program_id(1), stride_ot, stride_oh, num_heads, part_stride, words_ptr, dq_ptr, sq_ptr,
            GROUP, ROWS, HEAD_DIM, BLOCK_D, SPLIT_KEYS, QUANTIZE, INTERPRET,
        )  # fmt: skip


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    positions: torch.Tensor,
    tile_seq: torch.Tensor,
    tile_first: torch.Tensor,
    tile_len: torch.Tensor,
    scale: float,
    window: int = 0,
    num_splits: int = 1,
    out: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
    quantized: list | None = None,
) -> torch.Tensor:
    """Attention of q [T, H, D] over the paged caches [num_blocks, block_size, Hkv, D] -> out [T, H, D]
    in q's dtype.

    Token t (a row of q, in tile i) attends to the keys of sequence `block_tables[tile_seq[i]]`
    (int32 block ids) at positions max(0, positions[t] - window + 1) ..= positions[t] (from 0 where
    window is 0), already written by `store_kv`; query head h reads KV head h // (H // Hkv). Tile i
    covers rows tile_first[i] .. tile_first[i] + tile_len[i] - 1 of q: consecutive positions of one
    sequence, tile_len[i] <= tokens_per_tile(H, Hkv); a tile of length 0 does nothing, and rows in
    no tile are left untouched. Scores are q.k * scale in float32, with q.k products in the cache's
    dtype (in float32 where q's dtype differs).

    num_splits = 1: each (tile, KV head) program walks its keys' splits and merges them itself.
    num_splits > 1: one program per split, merged by a second kernel, or with `counters` (int32 zeros,
    at least tiles x Hkv of them, left zero: `attention_counters`) by the last split program of each
    (tile, KV head) to finish, with the same arithmetic; then num_splits must cover
    every position of the call (>= num_splits_for(max position)), as splits past it are not run. A
    token's result is the same bits for 1 and for any such num_splits, and whatever the tiling of
    its sequence's tokens and the other sequences of the call. The grid depends only on
    (num_tiles, Hkv, num_splits), as a CUDA graph needs.

    `quantized`: where D is a power of two and a multiple of 32, the same kernels also make out's
    int8 form (out viewed as [T, H * D]: matmul.quantize_int8's words, d and s, the same bits) and
    append it; elsewhere nothing is appended."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert v_cache.shape == k_cache.shape and k_cache.shape[3] == head_dim, (q.shape, k_cache.shape)
    assert num_heads % num_kv_heads == 0 and num_splits >= 1, (num_heads, num_kv_heads, num_splits)
    assert q.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1 and block_tables.stride(-1) == 1
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(-1) == 1, out.shape
    num_tiles = tile_len.shape[0]
    if num_tiles == 0 or num_tokens == 0:
        return out
    dot_dtype = _TL_DTYPES[k_cache.dtype] if k_cache.dtype == q.dtype else tl.float32
    is_split = num_splits > 1
    # per split, token and query head: the running max, the sum, and the unnormalized output
    part_shape = (num_splits, num_tokens, num_heads) if is_split else (1,)
    part_m = torch.empty(part_shape, dtype=torch.float32, device=q.device)
    part_denom = torch.empty(part_shape, dtype=torch.float32, device=q.device)
    part_acc = torch.empty((*part_shape, head_dim) if is_split else (1,), dtype=torch.float32, device=q.device)
    part_stride = num_tokens * num_heads
    quantize = quantized is not None and head_dim % 32 == 0 and head_dim == next_power_of_2(head_dim)
    if quantize:  # o_proj's int8 inputs, written with the output
        assert out.is_contiguous(), "the int8 form is of out viewed as [T, H * D]"
        groups = num_heads * head_dim // 32
        dq = torch.empty(num_tokens, groups, dtype=torch.float32, device=q.device)
        quantized.append(
            (torch.empty(num_tokens, groups * 8, dtype=torch.int32, device=q.device), dq, torch.empty_like(dq))
        )
    words, dq, sq = quantized[-1] if quantize else (part_m, part_m, part_m)  # (not written without QUANTIZE)
    combine_in_tile = is_split and counters is not None and counters.numel() >= num_tiles * num_kv_heads
    meta = dict(
        GROUP=group,
        ROWS=_rows(group),
        HEAD_DIM=head_dim,
        BLOCK_D=next_power_of_2(head_dim),
        SPLIT_KEYS=SPLIT_KEYS,
        QUANTIZE=quantize,
        INTERPRET=INTERPRET,
        **launch_options(q.device),
    )
    _attention_kernel[(num_tiles, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        out,
        part_m,
        part_denom,
        part_acc,
        counters if combine_in_tile else part_m,
        block_tables,
        positions,
        tile_seq,
        tile_first,
        tile_len,
        scale,
        window,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        block_tables.stride(0),
        num_heads,
        part_stride,
        words,
        dq,
        sq,
        DOT_DTYPE=dot_dtype,
        BLOCK_SIZE=block_size,
        BLOCK_N=BLOCK_N,
        IS_SPLIT=is_split,
        COMBINE_IN_TILE=combine_in_tile,
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
        **meta,
    )
    if is_split and not combine_in_tile:
        _combine_kernel[(num_tiles, num_kv_heads)](
            out,
            part_m,
            part_denom,
            part_acc,
            positions,
            tile_first,
            tile_len,
            window,
            out.stride(0),
            out.stride(1),
            num_heads,
            part_stride,
            words,
            dq,
            sq,
            num_warps=NUM_WARPS,
            **meta,
        )
    return out
