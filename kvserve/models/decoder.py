"""The Llama family (Llama 2/3, SmolLM2, Mistral-style GQA) over a flattened batch with paged KV.

Parameter names follow Hugging Face's, with q/k/v and gate/up fused into one projection each
(`qkv_proj`, `gate_up_proj`) so that a layer makes four matmul calls instead of seven.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.layers.attention import AttentionMetadata, paged_attention
from kvserve.layers.norm import RMSNorm
from kvserve.layers.quantized import float32_linear
from kvserve.layers.rotary import RotaryEmbedding, rotate
from kvserve.models.config import ModelConfig


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.attention_bias)
        self.k_cache: torch.Tensor | None = None  # [num_blocks, block_size, Hkv, D], bound by the runner
        self.v_cache: torch.Tensor | None = None

    def forward(
        self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        assert self.k_cache is not None and self.v_cache is not None, "bind_kv_cache() first"
        num_tokens = x.shape[0]
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # q and k are rotated together: [T, H + Hkv, D]
        qk = rotate(qk.view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim), *rope)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # [T, H, D], [T, Hkv, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, self.k_cache, self.v_cache, metadata, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        x = x + self.self_attn(rope, self.input_layernorm(x), metadata)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.rotary = RotaryEmbedding(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def bind_kv_cache(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Point every layer at its (k_cache, v_cache) pair. The tensors are written in place by forward."""
        assert len(kv_caches) == len(self.layers)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            layer.self_attn.k_cache, layer.self_attn.v_cache = k_cache, v_cache

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        """input_ids, positions: [T] (a flattened batch). Returns hidden states [T, hidden_size]."""
        x = self.embed_tokens(input_ids)
        rope = self.rotary.table(positions, x.dtype)  # one lookup per step, shared by every layer
        for layer in self.layers:
            x = layer(rope, x, attn_metadata)
        return self.norm(x)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden_size] -> float32 logits [N, vocab_size], multiplied in float32 whatever the compute dtype."""
        if isinstance(self.lm_head, nn.Linear):
            return float32_linear(hidden_states, self.lm_head)
        return self.lm_head(hidden_states).float()
