"""FusedDecoder: a model's step through the C++ layer loop (kvserve/kernels/csrc).

A step of a model on the CPU runs its whole layer loop in one C++ call: any mix of decode
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
from kvserve.layers.quantized import Int4Linear, Int8GroupLinear, Int8Linear, StoredQuadsLinear

logger = logging.getLogger("kvserve.fused_decode")


class FusedDecoder:
    """Runs steps of one DecoderForCausalLM (any supported family) through the C++ layer loop.

    Holds references to the model's tensors (no copies), among them the KV caches bound to the model
    when it is made (`bind_kv_cache` first; a model bound to other caches needs a new FusedDecoder).
    Needs the C++ kernels loaded. `supports(model)` tells whether the model's layers are all of a kind
    the C++ loop knows.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        config = model.config
        int4 = [m for m in model.modules() if isinstance(m, Int4Linear)]
        groups = {m.group_size for m in int4}
        # The C++ loop takes one setting for all its int4 and int8-group layers (set_activations sets
        # them together).
        layers = [m for m in model.layers.modules() if isinstance(m, Int4Linear | Int8GroupLinear | StoredQuadsLinear)]
        if layers and all(m.int8_activations for m in layers) and not ops.int8_activations():
            logger.warning("activations=int8 needs a CPU with AVX2, F16C and FMA; the layers take float inputs")
        self.int8_activations = bool(layers) and all(m.takes_int8() for m in layers)
        # Batch invariance (quantized.set_batch_invariant, before this is made): int4_mm for every
        # number of rows, never the GEMM over the dequantized weight.
        self.batch_invariant = all(m.batch_invariant for m in int4)
        dtype = model.layers[0].attn_norm.weight.dtype  # the compute dtype: the C++ loop takes x in its norms' dtype
        int4_policy = ops.Int4Policy(
            group_size=groups.pop() if groups else 32,
            few_rows=2**62 if self.batch_invariant else quantized.int4_few_rows(dtype),
            block_rows=quantized.int4_block_rows() or 0,
            int8_activations=self.int8_activations,
        )
        norms: list[torch.Tensor] = []
        self.linears: list[ops.Linear] = []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            norms += [layer.attn_norm.weight, layer.ffn_norm.weight]  # the LayerStack's order
            if config.sandwich_norms:
                norms += [layer.attn_out_norm.weight, layer.ffn_out_norm.weight]
            if config.qk_norm:
                norms += [attn.q_norm.weight, attn.k_norm.weight]
            self.linears += [_linear(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        if model.norm is not None:  # a pipeline stage short of the last has no final norm
            norms.append(model.norm.weight)
        self._k_cache = model.layers[0].self_attn.k_cache  # to tell a later bind_kv_cache (which rebinds every layer)
        activations = ops.activations()
        shape = ops.LayerShape(
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            intermediate_size=config.intermediate_size,
            rms_norm_eps=config.rms_norm_eps,
            scale=config.attention_scale,
            rotary_dim=config.rotary_dim,
            activation=activations.GeluTanh if config.hidden_act == "gelu_tanh" else activations.SiLU,
            qk_norm=config.qk_norm,
            sandwich_norms=config.sandwich_norms,
        )
        self.stack = ops.LayerStack(
            norms,
            self.linears,
            [layer.self_attn.k_cache for layer in model.layers],
            [layer.self_attn.v_cache for layer in model.layers],
            shape,
            int4_policy,
            windows=[layer.self_attn.window for layer in model.layers],
            rope_tables=[layer.self_attn.rope_table for layer in model.layers],
            final_norm=model.norm is not None,
        )

    @staticmethod
    def supports(model: nn.Module) -> bool:
        param = next(model.parameters())
        if param.device.type != "cpu" or param.dtype not in (torch.float32, torch.bfloat16):
            return False
        groups = {m.group_size for m in model.modules() if isinstance(m, Int4Linear)}
        linears = (nn.Linear, Int4Linear, Int8Linear, Int8GroupLinear, StoredQuadsLinear)
        return len(groups) <= 1 and all(
            # StoredQuadsLinear: int8 inputs asked for (as the loader made it), not takes_int8(): the runner
            # asks before the C++ kernels have loaded
            isinstance(m, linears) and (not isinstance(m, StoredQuadsLinear) or m.int8_activations)
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
        x = self.model.embed(input_ids)  # [B, hidden]
        return self.forward_hidden(x, positions, slot_mapping, block_tables, seq_lens, prefill_starts)

    def forward_hidden(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        prefill_starts: list[int] | None = None,
    ) -> torch.Tensor:
        """`forward` from x [T, hidden] (embeddings, or the previous pipeline stage's residual stream);
        a stage without the final norm returns the residual stream after its layers."""
        model = self.model
        if model.layers[0].self_attn.k_cache is not self._k_cache:
            raise RuntimeError("the model's KV caches were rebound after its FusedDecoder was made; make a new one")
        cos, sin_signed = model.rotary.stacked(positions, x.dtype)  # each [tables, B, rotary_dim]
        return self.stack.forward(
            x.contiguous(),
            cos.contiguous(),
            sin_signed.contiguous(),
            slot_mapping,
            block_tables,
            seq_lens,
            prefill_starts or [],
        )

    def prefill(
        self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor, starts: list[int]
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm for the whole prompts of fresh sequences
        (no earlier context), flattened: sequence s is rows starts[s]:starts[s + 1]. Writes their K/V
        at `slot_mapping`, as the model's forward would."""
        return self.prefill_hidden(self.model.embed(input_ids), positions, slot_mapping, starts)

    def prefill_hidden(
        self, x: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor, starts: list[int]
    ) -> torch.Tensor:
        """`prefill` from x [T, hidden] (embeddings, or the previous pipeline stage's residual stream)."""
        empty = torch.empty(0, 0, dtype=torch.long)
        return self.forward_hidden(x, positions, slot_mapping, empty, empty, starts)


def _linear(linear: nn.Module) -> ops.Linear:
    """The layer loop's view of a linear layer: its kind, weight and the scales its kind needs."""
    kinds = ops.linear_kinds()
    if isinstance(linear, Int4Linear):
        return ops.Linear(kinds.Int4, linear.weight_packed, linear.scales_mins, linear.bias)
    if isinstance(linear, Int8Linear):
        return ops.Linear(kinds.Int8, linear.weight_int8, linear.scales, linear.bias)
    if isinstance(linear, StoredQuadsLinear):  # made only where the quads kernel runs (int8 inputs, AVX2 and up)
        return ops.Linear(kinds.Int8Quads, linear.quads, linear.scales(), linear.bias)
    if isinstance(linear, Int8GroupLinear) and linear.uses_quads():
        linear.arrange_quads()
        return ops.Linear(kinds.Int8Quads, linear.quads, linear.quad_scales, linear.bias)
    if isinstance(linear, Int8GroupLinear):
        linear.arrange_row_major()
        return ops.Linear(kinds.Int8Groups, linear.codes, linear.scales, linear.bias)
    return ops.Linear(kinds.Float, linear.weight, None, linear.bias)


def make_fused_decoder(model: nn.Module, wait: bool = True) -> FusedDecoder | None:
    """A FusedDecoder for `model` when the kernels are enabled, the model supported and the
    extension built (waiting for the build, or, with wait=False, only if it is loaded already);
    else None."""
    if not build.is_enabled() or not FusedDecoder.supports(model):
        return None
    extension = build.load() if wait else build.loaded()
    return None if extension is None else FusedDecoder(model)
