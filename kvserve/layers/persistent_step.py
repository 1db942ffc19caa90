"""A 4-bit model's one-row decode step in one kernel (kernels/gpu/persistent.py), for the decode graph of one
row (engine/cuda_graphs.py): off until a GPU measures it (`PERSISTENT_STEP`, KVSERVE_PERSISTENT_STEP=1;
bench/gpu.py's `q4-persistent` run). The graphs of more rows, and every eager step, launch a kernel a phase.

`PersistentStep.unsupported(model)` says why a model cannot take it; `PersistentStep(model)` puts each kind
of the layers' weights into one [layers, ...] buffer (each layer's tensors become views of it, so nothing is
held twice), and a call runs the step's layers for the graph's static buffers: the embedding before, the
final norm after, as the model's own forward does. The same tile code as the launched kernels, so the same
bits (R7): tests/test_gpu_path.py compares the tokens and logprobs with the launched step's.
"""

from __future__ import annotations

import os

import torch
from torch import nn

# Off until a GPU measures it (docs/performance.md, "What the next GPU run decides").
PERSISTENT_STEP = os.environ.get("KVSERVE_PERSISTENT_STEP") == "1"
# Programs a multiprocessor, all resident: the kernel's registers are capped for them (`registers_cap`, 128 a
# thread at its 8 warps; for sm_90 it takes 116 so with Triton 3.9 and 128 with 3.6, no spills, where uncapped
# 3.6 took 177 and only one program would fit). The interpreter runs one program.
PROGRAMS_PER_SM = 2
REGISTERS_PER_SM = 65536  # compute capability 7.0 to 12.x


def registers_cap(programs_per_sm: int = PROGRAMS_PER_SM) -> int:
    """The registers a thread of the kernel may take for `programs_per_sm` programs of its warps to fit on a
    multiprocessor at once (a warp's taken 256 at a time, so a multiple of 8)."""
    from kvserve.kernels.gpu.attention import NUM_WARPS

    return REGISTERS_PER_SM // (programs_per_sm * 32 * NUM_WARPS) // 8 * 8


class PersistentStep:
    """The decoder layers of `model` for one row in one kernel; a call gives the final norm's output [1, H]."""

    @staticmethod
    def unsupported(model: nn.Module) -> str | None:
        """Why `model` cannot take the persistent step, or None where it can."""
        from kvserve.kernels.gpu import next_power_of_2
        from kvserve.layers.gpu import GpuInt4Linear, GpuRMSNorm
        from kvserve.models.decoder import DecoderLayer

        config = getattr(model, "config", None)
        if config is None or not (model.has_embedding and model.has_head) or not len(model.layers):
            return "not a whole decoder model"
        if next(model.parameters()).dtype != torch.bfloat16:
            return "its compute dtype is not bfloat16"
        for layer in model.layers:
            if not isinstance(layer, DecoderLayer):
                return "a layer is not a DecoderLayer"
            attn, mlp = layer.self_attn, layer.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if not all(
                isinstance(p, GpuInt4Linear)
                and p.packed_bf16
                and not (p.tinygemm or p.group_major or p.int8_activations)
                and p.bias is None
                and p.out_dtype is None
                for p in linears
            ):
                return "its projections are not all 4-bit in kvserve's kernel (packed bfloat16, float inputs, no bias)"
            if attn.qkv_rope is None or not mlp.activation_in_gate_up:
                return "RoPE or the gated activation is not in its projection's epilogue"
            norms = (layer.attn_norm, layer.ffn_norm)
            if not all(
                isinstance(n, GpuRMSNorm)
                and n.batch_invariant
                and not n.int8_output
                and n.weight.dtype == torch.bfloat16
                for n in norms
            ):
                return "its norms are not batch invariant GPU norms of bfloat16 weights"
            if layer.attn_out_norm is not None or attn.q_norm is not None:
                return "it has sandwich norms or q/k norms"
            if attn.window or attn.rope_table or attn.k_cache is None:
                return "a layer has a sliding window, a second RoPE table, or no cache"
            if attn.k_cache.dtype != torch.bfloat16 or attn.head_dim != next_power_of_2(attn.head_dim):
                return "its cache is not bfloat16, or its head dimension not a power of two"
        caches = [(layer.self_attn.k_cache, layer.self_attn.v_cache) for layer in model.layers]
        k0, v0 = caches[0]
        step = k0.numel() * k0.element_size()  # each kind one [layers, ...] tensor (kv_cache.allocate_kv_cache)
        for i, (k, v) in enumerate(caches):
            same = k.shape == v.shape == k0.shape and k.is_contiguous() and v.is_contiguous()
            same = same and _storage(k) == _storage(k0) and _storage(v) == _storage(v0)
            if not (same and k.data_ptr() == k0.data_ptr() + i * step and v.data_ptr() == v0.data_ptr() + i * step):
                return "its layers' caches are not one tensor of each kind"
        if not isinstance(model.norm, GpuRMSNorm):
            return "its final norm is not a GPU norm"
        return None

    def __init__(self, model: nn.Module) -> None:
        from kvserve.kernels.gpu.persistent import Shapes, Workspace

        reason = self.unsupported(model)
        assert reason is None, reason
        self.model = model
        layers = model.layers
        first = layers[0].self_attn
        self.device = first.k_cache.device
        inter = layers[0].mlp.gate_up_proj.out_features // 2
        self.shapes = Shapes(model.config.hidden_size, inter, first.num_heads, first.num_kv_heads, first.head_dim)
        self.gated = 2 if layers[0].mlp.gelu else 1
        self.eps, self.scale = layers[0].attn_norm.eps, first.scale
        self.weights = {}
        for kind, of in (
            ("qkv", lambda layer: layer.self_attn.qkv_proj),
            ("o", lambda layer: layer.self_attn.o_proj),
            ("gate_up", lambda layer: layer.mlp.gate_up_proj),
            ("down", lambda layer: layer.mlp.down_proj),
        ):
            self.weights[kind] = tuple(
                _stacked([of(layer) for layer in layers], t) for t in ("packed", "scales", "mins")
            )
        norms = [norm for layer in layers for norm in (layer.attn_norm, layer.ffn_norm)]
        self.norm_weights = _stacked(norms, "weight").view(len(layers), 2, self.shapes.hidden)
        # every layer's cache, as the one [layers, ...] tensor of each kind they are views of
        self.k_cache, self.v_cache = (_layers_of(getattr(first, name), len(layers)) for name in ("k_cache", "v_cache"))
        self.work = Workspace(self.shapes, self.device)

    def programs(self) -> int:
        """The grid: PROGRAMS_PER_SM a multiprocessor, all resident; one in the interpreter."""
        if self.device.type != "cuda":
            return 1
        return PROGRAMS_PER_SM * torch.cuda.get_device_properties(self.device).multi_processor_count

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, metadata) -> torch.Tensor:
        """The hidden state [1, H] after the final norm for one row (ids, positions [1]) with `metadata`'s
        slots, block table and key splits (layers/attention_triton.TritonAttentionMetadata)."""
        from kvserve.kernels.gpu.persistent import decode_layers

        model = self.model
        x = model.embed(ids)  # [1, H]
        cos, sin_signed = model.rotary.tables(positions, x.dtype)[0]  # [1, 1, D]
        stream, delta = decode_layers(
            x, list(self.weights.values()), self.norm_weights, self.eps, self.gated, cos, sin_signed, self.k_cache,
            self.v_cache, metadata, self.scale, self.shapes, self.work, self.programs(),
            registers_cap() if self.device.type == "cuda" else None,
        )  # fmt: skip
        return model.norm.add_and_norm(stream, delta)[1]


def _stacked(modules: list[nn.Module], name: str) -> torch.Tensor:
    """The modules' tensors `name` as one [len(modules), ...] buffer, each module's becoming a view of it."""
    tensors = [getattr(m, name) for m in modules]
    stacked = torch.stack([t.data for t in tensors])
    for i, (module, t) in enumerate(zip(modules, tensors, strict=True)):
        view = stacked[i]
        setattr(module, name, nn.Parameter(view, requires_grad=False) if isinstance(t, nn.Parameter) else view)
    return stacked


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _layers_of(first: torch.Tensor, layers: int) -> torch.Tensor:
    """The [layers, ...] tensor whose first element `first` is (a layer's cache, the others after it)."""
    return first.as_strided((layers, *first.shape), (first.numel(), *first.stride()), first.storage_offset())
