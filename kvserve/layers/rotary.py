"""Rotary position embedding (the rotate-half convention of Hugging Face checkpoints).

cos/sin are tabulated for the positions in use and indexed by the flattened positions of a step,
so a batch of sequences at different offsets costs one gather. On the CPU the table grows in fixed
chunks of TABLE_CHUNK positions as sequences reach them (Gemma 3's 32k context in two tables would
be 64 MB, a quarter of its weights); each chunk is computed alike, so a position's values never
depend on when its chunk was made.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from kvserve.errors import UnsupportedModelError

if TYPE_CHECKING:  # (kvserve.models' __init__ imports the decoder, which imports this module)
    from kvserve.models.config import ModelConfig

TABLE_CHUNK = 4096


def inverse_frequencies(config: ModelConfig, freq_factors: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim / 2], the factor cos and sin are multiplied by) of the model's
    RoPE, its scaling applied."""
    dim = config.rotary_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if freq_factors is not None:  # llama.cpp stores llama3 scaling as per-frequency divisors
        return inv_freq / freq_factors.float(), 1.0
    scaling = config.rope_scaling or {}
    if config.rope_type == "linear":
        return inv_freq / scaling["factor"], 1.0
    if config.rope_type == "longrope":
        return _longrope(config, scaling, inv_freq)
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
        return torch.where(is_medium, smoothed, scaled), 1.0
    return inv_freq, 1.0


def _longrope(config: ModelConfig, scaling: dict, inv_freq: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE: per-frequency divisors, the long ones where the model serves contexts past
    its original one (as llama.cpp decides, by the context and not by each sequence's length: the
    cached keys of a sequence then never change rotation as it grows), and cos/sin scaled by
    sqrt(1 + ln(factor) / ln(original context))."""
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or config.max_position_embeddings / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    long = config.max_position_embeddings > original
    divisors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
    if divisors.shape != inv_freq.shape:
        raise UnsupportedModelError(
            f"LongRoPE factors have {divisors.numel()} entries; the model rotates {2 * inv_freq.numel()} dimensions "
            "per head, which need half as many."
        )
    return inv_freq / divisors, attention_factor


class RotaryEmbedding(nn.Module):
    """cos/sin tables: the model's RoPE (table 0) and, for a model whose sliding layers have their
    own base (Gemma 3), theirs (table 1)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.max_positions = config.max_position_embeddings
        # [tables, 2 (cos, sin), positions so far, rotary_dim / 2]: both halves of rotate-half RoPE
        # have the same values
        self.register_buffer("cos_sin", torch.empty(0), persistent=False)
        self.freq_factors: torch.Tensor | None = None
        self._frequencies: list[tuple[torch.Tensor, float]] = []

    def build(self, device: torch.device, freq_factors: torch.Tensor | None = None) -> None:
        """Prepare the tables on `device` (on a GPU all positions at once). Called once after the
        weights are loaded."""
        self.freq_factors = freq_factors
        self._frequencies = [inverse_frequencies(self.config, freq_factors)]
        if self.config.local_rope_theta is not None:
            local = dataclasses.replace(self.config, rope_theta=self.config.local_rope_theta, rope_scaling=None)
            self._frequencies.append(inverse_frequencies(local))
        half = self.config.rotary_dim // 2
        self.cos_sin = torch.empty(len(self._frequencies), 2, 0, half, device=device)
        if torch.device(device).type != "cpu":  # no growing (and no sync to learn the largest position)
            self._extend(self.max_positions)

    def _extend(self, positions: int) -> None:
        """Grow the tables, a whole chunk at a time, to cover `positions` positions."""
        while self.cos_sin.shape[2] < positions:
            start = self.cos_sin.shape[2]
            t = torch.arange(start, start + TABLE_CHUNK, dtype=torch.float32)
            rows = []
            for inv_freq, factor in self._frequencies:
                freqs = torch.outer(t, inv_freq)  # [chunk, rotary_dim / 2]
                rows.append(torch.stack((freqs.cos() * factor, freqs.sin() * factor)))
            self.cos_sin = torch.cat((self.cos_sin, torch.stack(rows).to(self.cos_sin.device)), dim=2)

    def stacked(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin_signed), each [tables, T, rotary_dim] in `dtype`, for the flattened positions [T]
        of one step (the C++ layer loop's operands)."""
        if positions.device.type == "cpu" and len(positions):
            self._extend(int(positions.max()) + 1)
        cos, sin = self.cos_sin[:, :, positions].to(dtype).unbind(1)  # each [tables, T, rotary_dim / 2]
        return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per table, (cos, sin_signed) [T, 1, rotary_dim] in `dtype` for the flattened positions [T]
        of one step; looked up once per step and shared by every layer."""
        cos, sin_signed = self.stacked(positions, dtype)
        return [(c.unsqueeze(1), s.unsqueeze(1)) for c, s in zip(cos, sin_signed, strict=True)]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: x * cos + [-x2, x1] * sin, written as x * cos + roll(x) * [-sin, sin]."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin_signed)
