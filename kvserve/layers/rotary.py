"""Rotary position embedding (the rotate-half convention of Hugging Face checkpoints).

cos/sin are tabulated once for every position up to max_position_embeddings and indexed by the
flattened positions of a step, so a batch of sequences at different offsets costs one gather.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kvserve.models.config import ModelConfig


def inverse_frequencies(config: ModelConfig, freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if freq_factors is not None:  # llama.cpp stores llama3 scaling as per-frequency divisors
        return inv_freq / freq_factors.float()
    scaling = config.rope_scaling or {}
    if config.rope_type == "linear":
        return inv_freq / scaling["factor"]
    if config.rope_type == "llama3":
        factor = scaling["factor"]
        low_freq_factor = scaling.get("low_freq_factor", 1.0)
        high_freq_factor = scaling.get("high_freq_factor", 4.0)
        old_context_len = scaling.get("original_max_position_embeddings", 8192)
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.max_positions = config.max_position_embeddings
        self.register_buffer("cos_sin", torch.empty(0), persistent=False)
        self.freq_factors: torch.Tensor | None = None

    def build(self, device: torch.device, freq_factors: torch.Tensor | None = None) -> None:
        """Tabulate cos/sin on `device`. Called once after the weights are loaded."""
        self.freq_factors = freq_factors
        inv_freq = inverse_frequencies(self.config, freq_factors).to(device)
        t = torch.arange(self.max_positions, device=device, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.cos_sin = torch.stack((emb.cos(), emb.sin()))  # [2, P, D]

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin_signed), each [T, 1, D] in `dtype`, for the flattened positions [T] of one step;
        looked up once per step and shared by every layer."""
        cos, sin = self.cos_sin[:, positions].to(dtype).unsqueeze(2)
        half = sin.shape[-1] // 2
        return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T]; q: [T, H, D]; k: [T, Hkv, D]
        cos, sin_signed = self.table(positions, q.dtype)
        return rotate(q, cos, sin_signed), rotate(k, cos, sin_signed)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: x * cos + [-x2, x1] * sin, written as x * cos + roll(x) * [-sin, sin]."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin_signed)
