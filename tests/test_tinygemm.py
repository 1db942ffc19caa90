"""The tinygemm candidate's host side (kernels/gpu/tinygemm.py): the bytes and the scales and zeros
handed to PyTorch's CUDA int4 kernel, and the weights its arithmetic makes of them, checked against
kvserve's own weights (scale * code + min per group of 32). The kernel itself runs only on a CUDA GPU:
tests/test_cuda.py times nothing but checks it there against `dequantized` and for R7."""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels.gpu import tinygemm


def _weight(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    # scales exact in bfloat16, so that Q4_0's form (min = -8 scale, zero 0) is exact as well
    scales = (torch.rand(n, k // 32, generator=gen) * 0.05 + 0.001).to(torch.bfloat16).float()
    return codes, scales, -8 * scales


def test_code_pairs_put_each_even_input_in_the_high_nibble():
    codes, _, _ = _weight(8, 64)
    pairs = tinygemm.code_pairs(codes)
    assert pairs.shape == (8, 32) and pairs.dtype == torch.uint8
    for row in range(8):
        for i in range(32):
            assert pairs[row, i].item() == codes[row, 2 * i].item() * 16 + codes[row, 2 * i + 1].item()


def test_q4_0_weights_are_kvserves_rounded_to_bfloat16():
    """With min = -8 scale (GGUF's Q4_0) the zero is 0 and each weight is (code - 8) * scale rounded
    once: kvserve's weight (exact here in float32) rounded to bfloat16, input for input."""
    codes, scales, mins = _weight(24, 128)
    pairs, scales_zeros = tinygemm.code_pairs(codes), tinygemm.scales_and_zeros(scales, mins)
    assert scales_zeros.shape == (128 // 32, 24, 2) and scales_zeros.dtype == torch.bfloat16
    assert torch.all(scales_zeros[..., 1] == 0)
    exact = scales.repeat_interleave(32, dim=1) * codes.float() + mins.repeat_interleave(32, dim=1)
    assert torch.equal(tinygemm.dequantized(pairs, scales_zeros), exact.to(torch.bfloat16).float())


def test_weights_with_a_min_are_kvserves_within_bfloat16s_rounding():
    """Q4_1 and Q4_K: w = scale * code + min as (code - 8) * scale + (min + 8 scale), the zero rounded to
    bfloat16 and the weight once more: within a few bfloat16 steps of the group's largest weight."""
    codes, scales, _ = _weight(16, 256, seed=1)
    mins = -torch.rand(scales.shape, generator=torch.Generator().manual_seed(2)) * 0.3
    exact = scales.repeat_interleave(32, dim=1) * codes.float() + mins.repeat_interleave(32, dim=1)
    got = tinygemm.dequantized(tinygemm.code_pairs(codes), tinygemm.scales_and_zeros(scales, mins))
    largest = exact.abs().view(16, -1, 32).amax(dim=-1).repeat_interleave(32, dim=1)
    assert torch.all((got - exact).abs() <= largest * 2**-7)
    assert not torch.equal(got, exact.to(torch.bfloat16).float())  # the zero's rounding shows somewhere


@pytest.mark.parametrize("k, tiles", [(2048, 8), (8192, 8), (576, 4), (1536, 8), (96, 2), (32, 2)])
def test_inner_k_tiles_take_the_widest_load_k_allows(k, tiles):
    assert tinygemm.inner_k_tiles(k) == tiles and k % (16 * tiles) == 0


def test_only_multiples_of_eight_outputs_and_32_inputs_are_taken():
    assert tinygemm.takes(3072, 2048) and tinygemm.takes(8, 32)
    assert not tinygemm.takes(300, 64) and not tinygemm.takes(224, 112)
    with pytest.raises(ValueError, match="multiple of 8 outputs"):
        tinygemm.pack(torch.zeros(300, 64, dtype=torch.uint8), torch.ones(300, 2), torch.zeros(300, 2))


def test_the_candidate_refuses_a_device_without_the_kernel(monkeypatch):
    """Asked for on a CPU (or a GPU older than compute capability 8.0), a clear error at load, not a
    failure in the first step."""
    pytest.importorskip("triton")
    from kvserve.layers.gpu import GpuInt4Linear
    from kvserve.layers.quantized import Int4Groups

    codes, scales, mins = _weight(16, 64)
    weight = Int4Groups(codes, scales, mins, 32)
    assert not GpuInt4Linear(weight, "cpu").tinygemm
    monkeypatch.setattr(GpuInt4Linear, "tinygemm", True)
    with pytest.raises(ValueError, match=r"compute capability 8\.0"):
        GpuInt4Linear(weight, "cpu")
    # a layer of float32 outputs (a 4-bit lm_head's logits) keeps kvserve's kernel: never rounded to bfloat16
    assert not GpuInt4Linear(weight, "cpu", out_dtype=torch.float32).tinygemm
