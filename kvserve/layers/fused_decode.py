"""FusedDecoder: a Llama model's step through the C++ layer loop (kvserve/kernels/csrc).

A step of a Llama model on the CPU runs its whole layer loop in one C++ call: any mix of decode
tokens, prompts, chunks and prompts behind a cached prefix (`forward`), or, faster but not batch
invariant, fresh prompts only (`prefill`). The model's Python forward remains the reference and
serves where the C++ kernels cannot (CUDA, no compiler, KVSERVE_FUSED_DECODE=0; see
kvserve.kernels.build).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from kvserve.kernels import build, ops
from kvserve.layers import quantized
from kvserve.layers.quantized import Int4Linear, Int8Linear

logger = logging.getLogger("kvserve.fused_decode")


class FusedDecoder:
    """Runs steps of one LlamaForCausalLM through the C++ layer loop.

    Holds references to the model's tensors (no copies). `supports(model)` tells whether the
    model's layers are all of a kind the C++ loop knows.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        config = model.config
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim, self.intermediate = config.head_dim, config.intermediate_size
        self.eps = config.rms_norm_eps
        self.scale = config.head_dim**-0.5
        self.norms: list[torch.Tensor] = []
        self.kinds: list[int] = []
        self.weights: list[torch.Tensor] = []
        self.scales: list[torch.Tensor | None] = []
        self.biases: list[torch.Tensor | None] = []
        for layer in model.layers:
            self.norms += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            attn, mlp = layer.self_attn, layer.mlp
            for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                self._add(linear)
        self.norms.append(model.norm.weight)
        int4 = [m for m in model.modules() if isinstance(m, Int4Linear)]
        groups = {m.group_size for m in int4}
        self.group_size = groups.pop() if groups else 32
        # The C++ loop takes one setting for all its int4 layers (set_activations sets them together).
        if int4 and all(m.int8_activations for m in int4) and not ops.int8_activations():
            logger.warning("activations=int8 needs a CPU with AVX2, F16C and FMA; the int4 layers take float inputs")
        self.int8_activations = bool(int4) and all(m.takes_int8() for m in int4)
        # Batch invariance (quantized.set_batch_invariant, before this is made): int4_mm for every
        # number of rows, never the GEMM over the dequantized weight.
        self.batch_invariant = all(m.batch_invariant for m in int4)

    def _add(self, linear: nn.Module) -> None:
        if isinstance(linear, Int4Linear):
            self.kinds.append(1)
            self.weights.append(linear.weight_packed)
            self.scales.append(linear.scales_mins)
        elif isinstance(linear, Int8Linear):
            self.kinds.append(2)
            self.weights.append(linear.weight_int8)
            self.scales.append(linear.scales)
        else:
            self.kinds.append(0)
            self.weights.append(linear.weight)
            self.scales.append(None)
        self.biases.append(linear.bias)

    @staticmethod
    def supports(model: nn.Module) -> bool:
        param = next(model.parameters())
        if param.device.type != "cpu" or param.dtype not in (torch.float32, torch.bfloat16):
            return False
        groups = {m.group_size for m in model.modules() if isinstance(m, Int4Linear)}
        linears = (nn.Linear, Int4Linear, Int8Linear)
        return len(groups) <= 1 and all(
            isinstance(m, linears)
            for layer in model.layers
            for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        prefill_starts: list[int] | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm for T tokens, each at its position with its
        sequence's block table (block_tables [T, max_blocks]) attending to its first seq_lens keys
        (see `prefill` for prefill_starts). Writes each layer's K/V at `slot_mapping` before any
        attention reads it, as the model's forward would."""
        model = self.model
        x = model.embed_tokens(input_ids)  # [B, hidden]
        cos, sin_signed = model.rotary.table(positions, x.dtype)  # each [B, 1, D]
        k_caches = [layer.self_attn.k_cache for layer in model.layers]
        v_caches = [layer.self_attn.v_cache for layer in model.layers]
        return ops.decode_forward(
            x.contiguous(),
            cos.reshape(len(positions), -1).contiguous(),
            sin_signed.reshape(len(positions), -1).contiguous(),
            slot_mapping,
            block_tables,
            seq_lens,
            self.norms,
            self.kinds,
            self.weights,
            self.scales,
            self.biases,
            k_caches,
            v_caches,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.intermediate,
            self.eps,
            self.scale,
            self.group_size,
            2**62 if self.batch_invariant else quantized.int4_few_rows(x.dtype),
            quantized.int4_block_rows() or 0,
            self.int8_activations,
            prefill_starts or [],
        )

    def prefill(
        self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor, starts: list[int]
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm for the whole prompts of fresh sequences
        (no earlier context), flattened: sequence s is rows starts[s]:starts[s + 1]. Writes their K/V
        at `slot_mapping`, as the model's forward would."""
        empty = torch.empty(0, 0, dtype=torch.long)
        return self.forward(input_ids, positions, slot_mapping, empty, empty, starts)


def make_fused_decoder(model: nn.Module, wait: bool = True) -> FusedDecoder | None:
    """A FusedDecoder for `model` when the kernels are enabled, the model supported and the
    extension built (waiting for the build, or, with wait=False, only if it is loaded already);
    else None."""
    if not build.is_enabled() or not FusedDecoder.supports(model):
        return None
    extension = build.load() if wait else build.loaded()
    return None if extension is None else FusedDecoder(model)
