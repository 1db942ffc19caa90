"""The decoder every supported family runs (Llama, Mistral, Qwen2/2.5, Qwen3, Gemma 3, Phi-3), over a
flattened batch with paged KV. The families' differences are named in ModelConfig
(kvserve/models/config.py) and switched on here.

q/k/v and gate/up are fused into one projection each (`qkv_proj`, `gate_up_proj`), so that a layer
makes four matmul calls instead of seven. The norms are named by role, as GGUF names them:
`attn_norm` and `ffn_norm` feed the attention and the MLP; `attn_out_norm` and `ffn_out_norm` (only
with `sandwich_norms`) normalize their outputs before the residual add.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.layers.attention import StepMetadata, paged_attention
from kvserve.layers.attention_triton import TritonAttentionMetadata
from kvserve.layers.int8_form import with_int8_form
from kvserve.layers.norm import RMSNorm
from kvserve.layers.quantized import float32_linear
from kvserve.layers.rotary import RotaryEmbedding, rotate
from kvserve.models.config import ModelConfig


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, window: int, rope_table: int) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.rotary_dim = config.rotary_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = config.attention_scale
        self.window = window  # positions a query sees, its own included; 0: all
        self.rope_table = rope_table
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.attention_out_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_cache: torch.Tensor | None = None  # [num_blocks, block_size, Hkv, D], bound by the runner
        self.v_cache: torch.Tensor | None = None
        self.rotate = rotate  # RoPE; on a GPU one kernel for q and k (layers/gpu.use_triton_forms)
        # on a GPU, RoPE of whole heads with the new K/V written into the cache, one kernel
        self.rotate_and_store = None
        # on a GPU, the same in qkv_proj's kernel: (qkv_proj, x, cos, sin, k_cache, v_cache, slots) -> q
        # (layers/gpu.fuse_rope_into_qkv)
        self.qkv_rope = None
        # on a GPU with int8 inputs to o_proj, the attention also makes its output's int8 form
        # (layers/gpu.set_int8_inputs)
        self.int8_output = False

    def forward(
        self, ropes: list[tuple[torch.Tensor, torch.Tensor]], x: torch.Tensor, metadata: StepMetadata
    ) -> torch.Tensor:
        assert self.k_cache is not None and self.v_cache is not None, "bind_kv_cache() first"
        num_tokens = x.shape[0]
        if self.qkv_rope is not None and isinstance(metadata, TritonAttentionMetadata):
            caches = (self.k_cache, self.v_cache, metadata.slot_mapping)
            q = self.qkv_rope(self.qkv_proj, x, *ropes[self.rope_table], *caches)  # k and v are in the cache
            return self._attend_and_project(q, None, None, metadata)
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)  # [T, H + Hkv, D]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if (
            self.rotate_and_store is not None
            and self.rotary_dim == self.head_dim
            and isinstance(metadata, TritonAttentionMetadata)  # (GPU forms may run PyTorch's attention too)
        ):
            caches = (self.k_cache, self.v_cache, metadata.slot_mapping)
            q = self.rotate_and_store(qk, v, *ropes[self.rope_table], *caches)  # k and v are in the cache
            return self._attend_and_project(q, None, None, metadata)
        # q and k are rotated together, their first rotary_dim dimensions
        rotated = self.rotate(qk[..., : self.rotary_dim], *ropes[self.rope_table])
        qk = rotated if self.rotary_dim == self.head_dim else torch.cat((rotated, qk[..., self.rotary_dim :]), -1)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # [T, H, D], [T, Hkv, D]
        return self._attend_and_project(q, k, v, metadata)

    def _attend_and_project(
        self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, metadata: StepMetadata
    ) -> torch.Tensor:
        quantized = [] if self.int8_output else None
        out = paged_attention(q, k, v, self.k_cache, self.v_cache, metadata, self.scale, self.window, quantized)
        return self.o_proj(with_int8_form(out.reshape(q.shape[0], self.q_size), quantized))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gelu = config.hidden_act == "gelu_tanh"
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.gated_activation = gated_activation  # on a GPU one kernel (layers/gpu.use_triton_forms)
        # on a GPU, gate_up_proj's kernel applies the activation itself (layers/gpu.fuse_gated_activations)
        self.activation_in_gate_up = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation_in_gate_up:
            return self.down_proj(self.gate_up_proj(x))
        return self.down_proj(self.gated_activation(self.gate_up_proj(x), self.gelu))


def gated_activation(gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:
    """act(gate) * up for gate_up = [gate | up] on its last axis, act tanh-GELU or SiLU."""
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    act = F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)
    return act * up


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, window: int, rope_table: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, window, rope_table)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)
        sandwich = config.sandwich_norms
        self.attn_out_norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if sandwich else None
        self.ffn_out_norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if sandwich else None

    def forward(
        self,
        ropes: list[tuple[torch.Tensor, torch.Tensor]],
        x: torch.Tensor,
        metadata: StepMetadata,
        delta: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual stream, this layer's MLP output): the stream is x + delta (the previous layer's
        output, added here by this layer's first norm: one kernel on a GPU) plus the attention's output;
        the caller adds the MLP's output to it, in the next layer's first norm or the final one."""
        if delta is None:
            normed = self.attn_norm(x)
        else:
            x, normed = self.attn_norm.add_and_norm(x, delta)
        attn = self.self_attn(ropes, normed, metadata)
        x, normed = self.ffn_norm.add_and_norm(x, attn if self.attn_out_norm is None else self.attn_out_norm(attn))
        mlp = self.mlp(normed)
        return x, (mlp if self.ffn_out_norm is None else self.ffn_out_norm(mlp))


class DecoderForCausalLM(nn.Module):
    """The model, or with `stage` (first, end) a pipeline stage's share of it: layers [first, end) as
    `layers[0 ..]`, the token embedding only if first is 0, the final norm and lm_head only if end is
    the last layer (`has_embedding`, `has_head`)."""

    def __init__(self, config: ModelConfig, stage: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.config = config
        self.first_layer, self.end_layer = stage or (0, config.num_hidden_layers)
        if not 0 <= self.first_layer < self.end_layer <= config.num_hidden_layers:
            raise ValueError(f"a stage holds layers [first, end) of {config.num_hidden_layers}, got {stage}")
        self.rotary = RotaryEmbedding(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size) if self.has_embedding else None
        layers = slice(self.first_layer, self.end_layer)
        self.layers = nn.ModuleList(
            DecoderLayer(config, window, table)
            for window, table in zip(config.layer_windows[layers], config.layer_rope_tables[layers], strict=True)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if self.has_head else None
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False) if self.has_head else None
        if config.tie_word_embeddings and self.embed_tokens is not None and self.lm_head is not None:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def has_embedding(self) -> bool:
        return self.first_layer == 0

    @property
    def has_head(self) -> bool:
        return self.end_layer == self.config.num_hidden_layers

    @property
    def reads_embedding(self) -> bool:
        """Whether loading reads the checkpoint's embedding: for the embedding, or as the tied lm_head."""
        return self.has_embedding or (self.config.tie_word_embeddings and self.has_head)

    def bind_kv_cache(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Point every layer at its (k_cache, v_cache) pair. The tensors are written in place by forward."""
        assert len(kv_caches) == len(self.layers)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            layer.self_attn.k_cache, layer.self_attn.v_cache = k_cache, v_cache

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings [T, hidden], times the family's multiplier (Gemma: sqrt(hidden),
        rounded to the compute dtype as Gemma's own code rounds it)."""
        x = self.embed_tokens(input_ids)
        multiplier = self.config.embedding_multiplier
        return x if multiplier == 1.0 else x * torch.tensor(multiplier, dtype=x.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: StepMetadata) -> torch.Tensor:
        """input_ids, positions: [T] (a flattened batch). Returns hidden states [T, hidden_size]."""
        return self.run_layers(self.embed(input_ids), positions, attn_metadata)

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, attn_metadata: StepMetadata) -> torch.Tensor:
        """x [T, hidden] (embeddings, or the previous stage's residual stream) through this model's
        layers, then the final norm where it has one (else the residual stream for the next stage)."""
        ropes = self.rotary.tables(positions, x.dtype)  # one lookup per step, shared by every layer
        delta = None
        for layer in self.layers:
            x, delta = layer(ropes, x, attn_metadata, delta)
        if self.norm is None:
            return x + delta
        return self.norm.add_and_norm(x, delta)[1]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden_size] -> float32 logits [N, vocab_size], multiplied in float32 whatever the compute dtype."""
        if isinstance(self.lm_head, nn.Linear):
            return float32_linear(hidden_states, self.lm_head)
        return self.lm_head(hidden_states).float()
