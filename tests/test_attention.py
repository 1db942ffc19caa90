"""The layer loop's attention kernel (kernels/csrc/attention.cpp, `ops.decode_attention`) on its own:
each row over its own keys through its block table, against a float64 softmax(q k^T) v, and each row
the same bits alone as beside other rows (batch invariance). In bfloat16 on a CPU with AVX512-BF16
this runs the vdpbf16ps kernel; elsewhere the FMA kernel."""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels import build, ops

pytestmark = [pytest.mark.skipif(build.load() is None, reason="the C++ kernels did not build"), pytest.mark.threaded]

BLOCK_SIZE = 16


def _shape(num_heads: int, num_kv_heads: int, head_dim: int) -> ops.LayerShape:
    return ops.LayerShape(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=4 * head_dim,
        rms_norm_eps=1e-5,
        scale=head_dim**-0.5,
        rotary_dim=head_dim,
        activation=ops.activations().SiLU,
    )


def _case(seq_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0):
    """qkv rows and a cache whose blocks are scattered at random over a larger pool, as the block pool
    hands them out."""
    gen = torch.Generator().manual_seed(seed)
    widest = -(-max(seq_lens) // BLOCK_SIZE)
    num_blocks = 4 * widest * len(seq_lens)
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen)
    tables = order[: len(seq_lens) * widest].view(len(seq_lens), widest).contiguous()
    qkv = torch.randn(len(seq_lens), (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    return qkv, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.long)


def _reference(qkv, k_cache, v_cache, tables, seq_lens, shape: ops.LayerShape, window: int) -> torch.Tensor:
    heads, kv_heads, dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
    out = torch.empty(qkv.shape[0], heads * dim, dtype=torch.float64)
    for b, length in enumerate(seq_lens.tolist()):
        positions = torch.arange(max(0, length - window) if window else 0, length)
        slots = tables[b, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
        keys = k_cache.flatten(0, 1)[slots].double()  # [len, Hkv, D]
        values = v_cache.flatten(0, 1)[slots].double()
        q = qkv[b, : heads * dim].double().view(kv_heads, heads // kv_heads, dim)
        scores = torch.einsum("hgd,khd->hgk", q, keys) * shape.scale
        out[b] = torch.einsum("hgk,khd->hgd", scores.softmax(-1), values).reshape(-1)
    return out


# lengths: a tail of fewer than 16 keys, odd counts (a value pair padded), several passes of 16
LENGTHS = [1, 2, 7, 16, 17, 33, 40, 64, 95, 130]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "window"),
    [(9, 3, 64, 0), (9, 3, 64, 20), (4, 4, 96, 0), (8, 2, 128, 0), (6, 1, 32, 0)],
)
def test_each_row_attends_over_its_own_keys(dtype, num_heads, num_kv_heads, head_dim, window):
    shape = _shape(num_heads, num_kv_heads, head_dim)
    case = _case(LENGTHS, num_heads, num_kv_heads, head_dim, dtype)
    got = ops.decode_attention(*case, shape, window)
    want = _reference(*case, shape, window)
    assert got.dtype == dtype and got.shape == want.shape
    # bfloat16: the output rounded to 8 bits, the probabilities too; float32: sums in another order
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.double(), want, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_row_is_the_same_bits_alone_and_beside_other_rows(dtype):
    shape = _shape(9, 3, 64)
    qkv, k_cache, v_cache, tables, seq_lens = _case(LENGTHS, 9, 3, 64, dtype, seed=1)
    together = ops.decode_attention(qkv, k_cache, v_cache, tables, seq_lens, shape)
    for b in range(len(LENGTHS)):
        alone = ops.decode_attention(qkv[b : b + 1], k_cache, v_cache, tables[b : b + 1], seq_lens[b : b + 1], shape)
        assert torch.equal(alone[0], together[b]), f"row {b} ({LENGTHS[b]} keys)"


def _prompts(lengths: list[int], num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 2):
    """The rows of whole prompts, as a prefill step lays them out: prompt p's rows share one block table
    and attend over 1, 2, ... lengths[p] keys. The prompts' rows are interleaved in runs (part of one,
    another, the rest of the first) so that runs of rows with the same table start and stop anywhere."""
    gen = torch.Generator().manual_seed(seed)
    widths = [-(-n // BLOCK_SIZE) for n in lengths]
    num_blocks = 3 * sum(widths)
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for width in widths:
        table = torch.zeros(max(widths), dtype=torch.long)
        table[:width] = torch.tensor(order[:width])
        del order[:width]
        tables.append(table)
    rows = []  # (prompt, keys)
    for p, n in enumerate(lengths):
        rows += [(p, keys) for keys in range(1, n + 1)]
    half = lengths[0] // 2
    rows = rows[:half] + rows[lengths[0] :] + rows[half : lengths[0]]
    qkv = torch.randn(len(rows), (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    block_tables = torch.stack([tables[p] for p, _ in rows]).contiguous()
    return qkv, k_cache, v_cache, block_tables, torch.tensor([keys for _, keys in rows], dtype=torch.long)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "window"),
    [(4, 1, 256, 0), (4, 1, 256, 50), (9, 3, 64, 0), (4, 2, 80, 0)],
)
def test_a_prompts_rows_together_are_each_the_same_bits_as_alone(dtype, num_heads, num_kv_heads, head_dim, window):
    """A prompt's rows share their block table, and the kernel reads their keys once for a tile of them:
    each row is still its own arithmetic (the same bits as alone) and right (against float64)."""
    shape = _shape(num_heads, num_kv_heads, head_dim)
    case = _prompts([70, 45], num_heads, num_kv_heads, head_dim, dtype)
    together = ops.decode_attention(*case, shape, window)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(together.double(), _reference(*case, shape, window), atol=tolerance, rtol=tolerance)
    qkv, k_cache, v_cache, tables, seq_lens = case
    for b in range(len(seq_lens)):
        alone = ops.decode_attention(
            qkv[b : b + 1], k_cache, v_cache, tables[b : b + 1], seq_lens[b : b + 1], shape, window
        )
        assert torch.equal(alone[0], together[b]), f"row {b} ({seq_lens[b]} keys)"
