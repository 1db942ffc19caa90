"""The model's layers in their GPU form, over the Triton kernels (kvserve/kernels/gpu).

One model and one engine serve both devices: on a GPU the loader builds these forms instead of the
CPU ones (layers/quantized.py), and `use_triton_forms` turns the float layers and norms of a loaded
model into them. Batch invariant (the default), every matmul and norm runs a Triton kernel of one
fixed configuration, so a row's result never depends on how many rows share the call (cuBLAS picks
its kernels, and split-K, by the shapes); off, float layers multiply through cuBLAS. Quantized
weights stay packed on the device:

- `GpuInt4Linear`: 4-bit codes two per byte with a (scale, min) per 32 inputs: GGUF's Q4_0, Q4_1
  and Q4_K as stored, anything else rounded to nearest (`--weights q4`).
- `GpuInt8GroupLinear`: int8 codes with a scale per 32 inputs: Q8_0 and Q5_0 as stored, the other
  quantized types rounded to nearest (`--weights q8`, and `auto` for them).

`KVSERVE_KERNELS=triton` runs these forms (and the Triton attention) on a CPU through Triton's
interpreter (with TRITON_INTERPRET=1): slow, for tests of the GPU path on machines without one.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.layers.int8_form import INT8_FORM, with_int8_form
from kvserve.layers.norm import RMSNorm
from kvserve.layers.quantized import GROUP_SIZE, Int4Groups


def uses_triton(device: torch.device | str) -> bool:
    """Whether a model on `device` runs the GPU path: on CUDA, or anywhere with KVSERVE_KERNELS=triton."""
    return torch.device(device).type == "cuda" or os.environ.get("KVSERVE_KERNELS") == "triton"


class _RowLayouts(nn.Module):
    """A GPU linear layer whose output rows (weight or code rows, their scales and mins, the bias) its
    kernel's epilogue may want in another order: a gate and up projection's interleaved for the gated
    activation (`activation`, fuse_gated_activations), a q/k/v projection's q and k dimensions paired for
    RoPE (`rope_heads`, (H, Hkv, D): fuse_rope_into_qkv). Each layer names its row tensors."""

    activation: str | None = None
    rope_heads: tuple[int, int, int] | None = None

    def _row_tensors(self) -> dict[str, int]:
        """Each tensor's attribute name and the dimension its rows lie along."""
        raise NotImplementedError

    def _relayout(self, change) -> None:
        for name, dim in self._row_tensors().items():
            t = getattr(self, name)
            if t is None:
                continue
            moved = change(t.data, dim)
            setattr(self, name, nn.Parameter(moved, requires_grad=False) if isinstance(t, nn.Parameter) else moved)

    def interleave_gate_up(self, activation: str | None) -> None:
        """`fuse_gated_activations`' layout (gate j at row 2j, up j at 2j + 1) for `activation`, or (None)
        [gate | up] again."""
        from kvserve.kernels.gpu.matmul import GATED_ACTIVATIONS, deinterleave_gate_up, interleave_gate_up

        assert activation in GATED_ACTIVATIONS and (activation is None or self.rope_heads is None), activation
        if (self.activation is None) != (activation is None):
            self._relayout(interleave_gate_up if activation is not None else deinterleave_gate_up)
        self.activation = activation

    def pair_rope_rows(self, heads: tuple[int, int, int] | None) -> None:
        """`fuse_rope_into_qkv`'s layout (matmul.interleave_rope) for heads (H, Hkv, D), or (None) q's, k's
        and v's rows as the checkpoint has them again."""
        from kvserve.kernels.gpu.matmul import deinterleave_rope, interleave_rope

        assert heads is None or self.activation is None
        if self.rope_heads is not None:
            self._relayout(lambda t, dim: deinterleave_rope(t, *self.rope_heads, dim))
        if heads is not None:
            self._relayout(lambda t, dim: interleave_rope(t, *heads, dim))
        self.rope_heads = heads

    def _rows_in_order(self, out: torch.Tensor, rope) -> torch.Tensor:
        """A kernel's output with q's and k's rows put back in order, where they are paired for RoPE but
        the call asked for none (a caller that attends through PyTorch's attention)."""
        if self.rope_heads is None or rope is not None:
            return out
        from kvserve.kernels.gpu.matmul import deinterleave_rope

        return deinterleave_rope(out, *self.rope_heads, dim=1)

    def _layouts_repr(self) -> str:
        if self.activation is not None:
            return f", then {self.activation} gated (in the kernel)"
        return "" if self.rope_heads is None else ", then RoPE and the KV cache's write (in the kernel)"


class GpuLinear(_RowLayouts):
    """y = x @ W.T (+ bias) for a float weight, given in `out_dtype` (the lm_head: float32 logits,
    summed in float32 and never rounded to the compute dtype)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.bias = bias
        self.out_dtype = out_dtype
        self.batch_invariant = True  # see quantized.set_batch_invariant
        self.register_buffer("split_counters", _split_counters(self.weight.device), persistent=False)

    @classmethod
    def of(cls, linear: nn.Linear, out_dtype: torch.dtype | None = None) -> GpuLinear:
        """The same weight tensor (a tied embedding's stays shared)."""
        return cls(linear.weight, linear.bias, out_dtype)

    def forward(self, x: torch.Tensor, rope=None) -> torch.Tensor:
        """`rope` (a q/k/v projection with `rope_heads`: matmul.RopeStore): q rotated, k and v written."""
        from kvserve.kernels.gpu.matmul import matmul

        x2 = _rows(x, self.in_features, self.batch_invariant)  # [M, K]
        out_dtype = self.out_dtype or x2.dtype
        if self.batch_invariant or out_dtype != x2.dtype:
            out = matmul(x2, self.weight, self.bias, out_dtype, self.split_counters, self.activation, rope)
            out = self._rows_in_order(out, rope)
        else:  # cuBLAS: no epilogue of kvserve's, the layouts undone (fuse_epilogues, by the runner)
            assert self.activation is None and self.rope_heads is None and rope is None, "fuse_epilogues"
            out = F.linear(x2, self.weight, self.bias)
        return out.view(*x.shape[:-1], out.shape[-1])

    def _row_tensors(self) -> dict[str, int]:
        return {"weight": 0, "bias": 0}

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}{self._layouts_repr()}"


def _rows(x, in_features: int, takes_normed: bool):
    """A layer's input as its kernel takes it: x [..., K] as [M, K], or a norm's `NormedRows`
    (GpuRMSNorm's `into_matmul`) as they are where the layer's kernel normalizes them itself
    (`takes_normed`), else made by the norm's kernel first."""
    if isinstance(x, torch.Tensor):  # (every call but a norm's rows: no import on the eager step's path)
        return x.reshape(-1, in_features)
    from kvserve.kernels.gpu.norm import NormedRows

    assert isinstance(x, NormedRows), type(x)
    return x if takes_normed else x.made()


def _split_counters(device: torch.device) -> torch.Tensor:
    """The layer's tile counters, with which its matmul's last K split adds the splits' sums (one launch
    fewer a call: kernels/gpu/matmul.split_counters)."""
    from kvserve.kernels.gpu.matmul import split_counters

    return split_counters(device)


def _group_values(values: torch.Tensor) -> torch.Tensor:
    """A weight's per-group scales or mins: float16 where that holds them exactly (GGUF's Q4_0/Q4_1
    store them so: half the bytes a decode step reads besides the codes), else float32."""
    as_half = values.half()
    return as_half if torch.equal(as_half.float(), values.float()) else values.float()


class GpuInt4Linear(_RowLayouts):
    """y = x @ W.T (+ bias) with W[n, k] = scales[n, k // 32] * code + mins[n, k // 32], the codes packed
    two per byte on the device (kernels/gpu/matmul.pack_int4) and dequantized in registers; given in
    `out_dtype` (float32 for the lm_head's logits), else in x's dtype. One kernel for every row count.

    With `int8_activations` (`--activations int8`, set by set_int8_inputs) x is quantized to
    int8 per group of 32 and each group's products are summed in integers (`int4_int8_matmul`): the
    CPU's int4 x int8 arithmetic, with no float weight ever made; its kernel follows the row count, the
    bits do not."""

    # int4_matmul's packed_bf16 (scales and mins kept as bfloat16, each weight their fma rounded once):
    # None, on for a bfloat16 model with float inputs (the H200 at aead1aa: 4.5% more tokens a second
    # for one stream of the 1B shapes, batched = solo 16 of 16), off for float16 and float32 ones, whose
    # inputs it does not take, and with int8 inputs, whose arithmetic (the CPU's) reads the scales as
    # stored; bench/gpu.py's `q4-fp16` run sets it False (float16 scales, the kernel before).
    packed_bf16: bool | None = None
    # PyTorch's own int4 kernel instead of kvserve's (kernels/gpu/tinygemm.py: bfloat16 scales and zeros,
    # float inputs only), off until a GPU measures it faster; bench/gpu.py's `q4-tinygemm` turns it on.
    tinygemm = False
    # Codes, scales and mins group major (matmul.to_group_major: each group's outputs one after another,
    # so that a warp's threads, an output each, read one block): the same bits, a candidate until a GPU
    # measures it faster; bench/gpu.py's `q4-gm` and `q4-int8-gm` runs turn it on.
    group_major = False

    def __init__(
        self,
        weight: Int4Groups,
        device: torch.device | str,
        bias: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
        dtype: torch.dtype | None = None,
        int8_inputs: bool = False,
    ) -> None:
        """`dtype`: the model's compute dtype (its inputs'), and `int8_inputs`: whether the layer will take
        int8 inputs (`--activations int8`, whose arithmetic reads the scales as stored), which decide
        `packed_bf16` where unset."""
        super().__init__()
        from kvserve.kernels.gpu.matmul import pack_int4, to_group_major

        if weight.group_size != GROUP_SIZE:
            raise ValueError(f"the GPU's int4 kernel takes groups of {GROUP_SIZE}, got {weight.group_size}")
        self.out_features, self.in_features = weight.codes.shape
        self.out_dtype = out_dtype
        self.int8_activations = False
        self.bias = None if bias is None else nn.Parameter(bias.float().to(device), requires_grad=False)
        # fixed at load, with the codes' layout; not for float32 outputs (a 4-bit lm_head's logits), which
        # it would give rounded to bfloat16
        self.tinygemm = type(self).tinygemm and out_dtype in (None, torch.bfloat16)
        if self.tinygemm:
            from kvserve.kernels.gpu import tinygemm

            if not tinygemm.supported(device):
                raise ValueError(
                    "PyTorch's int4 kernel (the tinygemm candidate) needs a CUDA GPU of compute capability 8.0 or later"
                )
            codes = weight.codes.to(device)
            packed, scales_zeros = tinygemm.pack(codes, weight.scales.to(device), weight.mins.to(device))
            self.register_buffer("packed", packed)
            self.register_buffer("scales_zeros", scales_zeros)  # [K / 32, N, 2] bfloat16
            self.packed_bf16 = self.group_major = False
            return
        chosen = type(self).packed_bf16  # fixed at load, with the scales' dtype
        self.packed_bf16 = dtype == torch.bfloat16 and not int8_inputs if chosen is None else chosen
        group_values = (lambda v: v.to(torch.bfloat16)) if self.packed_bf16 else _group_values
        packed = pack_int4(weight.codes.to(device))  # [N, K / 2]
        scales = group_values(weight.scales).to(device)  # [N, K / 32]
        mins = group_values(weight.mins).to(device)
        self.group_major = type(self).group_major  # fixed at load, with the layout
        if self.group_major:  # [K / 32, N, 16] and [K / 32, N]
            packed, scales, mins = to_group_major(packed, scales, mins)
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)
        self.register_buffer("mins", mins)
        self.register_buffer("split_counters", _split_counters(device), persistent=False)

    def forward(self, x: torch.Tensor, rope=None) -> torch.Tensor:
        """`rope` as GpuLinear's."""
        from kvserve.kernels.gpu.matmul import int4_int8_matmul, int4_matmul

        x2 = _rows(x, self.in_features, not (self.tinygemm or self.int8_activations))
        out_dtype = self.out_dtype or x2.dtype
        # PyTorch's int4 kernel has no epilogue of kvserve's; the int8-input ones have RoPE's only
        assert not (self.tinygemm and self.rope_heads), "fuse_rope_into_qkv"
        assert not ((self.tinygemm or self.int8_activations) and self.activation), "fuse_gated_activations"
        if self.tinygemm:
            from kvserve.kernels.gpu import tinygemm

            out = tinygemm.matmul(x2, self.packed, self.scales_zeros)
            out = (out if self.bias is None else out.float() + self.bias).to(out_dtype)
        elif self.int8_activations:
            quantized = getattr(x, INT8_FORM, None)  # made by the kernel that made x, if any
            out = int4_int8_matmul(
                x2, self.packed, self.scales, self.mins, out_dtype, self.bias, quantized, self.split_counters, rope
            )
            out = self._rows_in_order(out, rope)
        else:
            out = int4_matmul(
                x2,
                self.packed,
                self.scales,
                self.mins,
                out_dtype,
                self.bias,
                self.packed_bf16,
                self.split_counters,
                self.activation,
                rope,
            )
            out = self._rows_in_order(out, rope)
        return out.view(*x.shape[:-1], out.shape[-1])

    def _row_tensors(self) -> dict[str, int]:
        """The codes' rows (dimension 1 where group major), their scales' and mins', the bias's; not
        PyTorch's int4 kernel's, whose tiles hold the outputs in its own order."""
        assert not self.tinygemm, "PyTorch's int4 kernel has no epilogue of kvserve's"
        rows = 1 if self.group_major else 0
        return {"packed": rows, "scales": rows, "mins": rows, "bias": 0}

    def extra_repr(self) -> str:
        inputs = ", int8 inputs" if self.int8_activations else ""
        kernel = ", PyTorch's int4 kernel" if self.tinygemm else ", group major" if self.group_major else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, group_size={GROUP_SIZE}{inputs}{kernel}"
            + self._layouts_repr()
        )


class GpuInt8GroupLinear(_RowLayouts):
    """y = x @ W.T (+ bias) with W as int8 codes and a float32 scale per 32 inputs (GGML's Q8_0), given in
    `out_dtype` (float32 for the lm_head's logits), else in x's dtype. One kernel for every row count.

    With `int8_activations` (`--activations int8`, set by set_int8_inputs) x is quantized to int8 per
    group of 32 and each group's products summed in integers (`int8_int8_matmul`, llama.cpp's Q8_0 x
    Q8_0), as the CPU's Int8GroupLinear takes int8 inputs then."""

    def __init__(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        device: torch.device | str,
        bias: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape
        if scales.shape[1] * GROUP_SIZE != self.in_features:
            raise ValueError(f"the GPU's int8 kernel takes a scale per {GROUP_SIZE} inputs")
        self.out_dtype = out_dtype
        self.int8_activations = False
        self.register_buffer("codes", codes.to(device))  # [N, K] int8
        self.register_buffer("scales", scales.float().to(device))  # [N, K / 32]
        self.bias = None if bias is None else nn.Parameter(bias.float().to(device), requires_grad=False)
        self.register_buffer("split_counters", _split_counters(device), persistent=False)

    def forward(self, x: torch.Tensor, rope=None) -> torch.Tensor:
        """`rope` as GpuLinear's."""
        from kvserve.kernels.gpu.matmul import int8_group_matmul, int8_int8_matmul

        x2 = _rows(x, self.in_features, not self.int8_activations)
        out_dtype = self.out_dtype or x2.dtype
        assert not (self.int8_activations and self.activation), "the int8-input kernels have RoPE's epilogue only"
        if self.int8_activations:
            quantized = getattr(x, INT8_FORM, None)  # made by the kernel that made x, if any
            out = int8_int8_matmul(
                x2, self.codes, self.scales, out_dtype, self.bias, quantized, self.split_counters, rope
            )
            out = self._rows_in_order(out, rope)
        else:
            out = int8_group_matmul(
                x2, self.codes, self.scales, out_dtype, self.bias, self.split_counters, self.activation, rope
            )
            out = self._rows_in_order(out, rope)
        return out.view(*x.shape[:-1], out.shape[-1])

    def _row_tensors(self) -> dict[str, int]:
        return {"codes": 0, "scales": 0, "bias": 0}

    def extra_repr(self) -> str:
        inputs = ", int8 inputs" if self.int8_activations else ""
        return f"in_features={self.in_features}, out_features={self.out_features}{inputs}{self._layouts_repr()}"


class GpuRMSNorm(RMSNorm):
    """RMSNorm through the Triton kernel (one program per row, its sum in one order) while batch
    invariant; PyTorch's reduction otherwise, whose split of a row may follow the number of rows.
    With `int8_output` (`set_int8_inputs`) the kernel also makes its output's int8 form. With
    `into_matmul` (`fuse_norms`) a call of at most NORM_IN_MATMUL_ROWS rows launches nothing and gives
    `NormedRows`, which the matmul after it normalizes in its own kernel: the same bits, one launch fewer."""

    batch_invariant = True
    int8_output = False
    into_matmul = False

    def _normed_rows(self, x: torch.Tensor, delta: torch.Tensor | None):
        """(x + delta or None, NormedRows) where this call may hand its rows to the matmul, else None."""
        if not self.into_matmul:  # (the default: no import on the eager step's path)
            return None
        from kvserve.kernels.gpu.norm import NORM_IN_MATMUL_ROWS, normed_rows

        if not (
            self.batch_invariant
            and x.dim() == 2
            and x.shape[0] <= NORM_IN_MATMUL_ROWS
            and self.weight.dtype == x.dtype  # (else the norm's output is promoted: its kernel's)
        ):
            return None
        return normed_rows(x, delta, self.weight, self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.batch_invariant:
            return super().forward(x)
        deferred = self._normed_rows(x, None)
        if deferred is not None:
            return deferred[1]
        from kvserve.kernels.gpu.norm import rms_norm

        quantized = [] if self.int8_output else None
        out = rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps, quantized).view(x.shape)
        return with_int8_form(out, quantized)

    def add_and_norm(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.batch_invariant:
            return super().add_and_norm(x, delta)
        deferred = self._normed_rows(x, delta)
        if deferred is not None:
            return deferred
        from kvserve.kernels.gpu.norm import add_rms_norm

        hidden = x.shape[-1]
        quantized = [] if self.int8_output else None
        total, out = add_rms_norm(x.reshape(-1, hidden), delta.reshape(-1, hidden), self.weight, self.eps, quantized)
        return total.view(x.shape), with_int8_form(out.view(x.shape), quantized)


def gated_activation_int8(gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:
    """kernels/gpu/elementwise.gated_activation, its output handed on with its int8 form."""
    from kvserve.kernels.gpu import elementwise

    quantized: list = []
    return with_int8_form(elementwise.gated_activation(gate_up, gelu, quantized), quantized)


def set_int8_inputs(model: nn.Module, on: bool) -> None:
    """Make every GpuInt4Linear and GpuInt8GroupLinear of `model` take int8 inputs (`on`, `--activations
    int8`) or float ones; and where one takes int8, have the kernel that makes its input make their
    int8 form too (the same bits as the layer's own quantizing, one launch fewer): the final norm for
    the lm_head, and in each decoder layer the attention norm for qkv_proj, the attention for o_proj
    (where head_dim is a power of two times 32; else o_proj quantizes its input itself), the MLP norm
    for gate_up_proj, the gated activation for down_proj. Then the epilogues' layouts follow
    (`fuse_gated_activations`, `fuse_rope_into_qkv`): this changes the layers' tensors, so it runs before
    a GPU's CUDA graphs are captured (the loader's call), whose replays would keep the old ones."""
    from kvserve.kernels.gpu import elementwise
    from kvserve.models.decoder import DecoderLayer

    def takes_int8(layer: nn.Module) -> bool:
        return isinstance(layer, (GpuInt4Linear, GpuInt8GroupLinear)) and layer.int8_activations

    for module in model.modules():
        if isinstance(module, (GpuInt4Linear, GpuInt8GroupLinear)):  # PyTorch's int4 kernel: float inputs only
            module.int8_activations = on and not (isinstance(module, GpuInt4Linear) and module.tinygemm)
    if isinstance(getattr(model, "norm", None), GpuRMSNorm):  # a pipeline's last stage, or the whole model
        model.norm.int8_output = takes_int8(model.lm_head)
    for layer in model.modules():
        if not isinstance(layer, DecoderLayer):
            continue
        for norm, consumer in ((layer.attn_norm, layer.self_attn.qkv_proj), (layer.ffn_norm, layer.mlp.gate_up_proj)):
            if isinstance(norm, GpuRMSNorm):
                norm.int8_output = takes_int8(consumer)
        layer.self_attn.int8_output = takes_int8(layer.self_attn.o_proj)
        mlp = layer.mlp
        if mlp.gated_activation in (elementwise.gated_activation, gated_activation_int8):  # the GPU's
            mlp.gated_activation = gated_activation_int8 if takes_int8(mlp.down_proj) else elementwise.gated_activation
    fuse_epilogues(model)


def fuse_epilogues(model: nn.Module) -> None:
    """The projections' epilogues (`fuse_gated_activations`, `fuse_rope_into_qkv`) set for what the layers
    now take: int8 or float inputs, batch invariance or cuBLAS. `set_int8_inputs` ends with this, and the
    runner calls it after `quantized.set_batch_invariant`, before a GPU's graphs are captured; a model
    without GPU forms is left as it is."""
    fuse_gated_activations(model)
    fuse_rope_into_qkv(model)
    fuse_norms(model)


# The gated activation in the gate and up projection's epilogue (`fuse_gated_activations`): on, as it is the
# activation kernel's bits with one launch a decoder layer fewer (unmeasured on a GPU when turned on; the
# kernel sweep's `-gated` kinds against `-gated-kernel`, bench/gpu_kernels.py, say what it saves).
FUSE_GATED_ACTIVATIONS = True


def fuse_gated_activations(model: nn.Module) -> None:
    """Have each MLP's gate and up projection apply the gated activation in its matmul's kernel (its rows
    interleaved: `matmul.interleave_gate_up`), one launch fewer a layer and the same bits, where its kernel
    can: a float or Q8_0 weight, or 4-bit codes in kvserve's kernel, taking float inputs, and the down
    projection taking float inputs too (int8 ones come with their int8 form from the activation's kernel,
    `set_int8_inputs`), while FUSE_GATED_ACTIVATIONS. Elsewhere the layout is put back. `set_int8_inputs`
    ends with this."""
    from kvserve.models.decoder import MLP

    for mlp in model.modules():
        if not isinstance(mlp, MLP):
            continue
        gate_up, down = mlp.gate_up_proj, mlp.down_proj
        if not isinstance(gate_up, _RowLayouts):
            continue
        fused = FUSE_GATED_ACTIVATIONS and _has_epilogues(gate_up) and not getattr(down, "int8_activations", False)
        activation = ("gelu_tanh" if mlp.gelu else "silu") if fused else None
        gate_up.interleave_gate_up(activation)  # (where it was fused before and no longer is: undone)
        mlp.activation_in_gate_up = activation is not None


def _has_epilogues(layer: nn.Module, float_inputs: bool = True) -> bool:
    """Whether a layer's kernel has kvserve's epilogues: float weights batch invariant (not cuBLAS), Q8_0
    or 4-bit weights in kvserve's kernels (not PyTorch's int4 kernel), taking float inputs (the gated
    activation's epilogue) or any (RoPE's)."""
    if isinstance(layer, GpuLinear):
        return layer.batch_invariant
    return (
        isinstance(layer, GpuInt8GroupLinear) or (isinstance(layer, GpuInt4Linear) and not layer.tinygemm)
    ) and not (float_inputs and layer.int8_activations)


# RoPE and the KV cache's write in the q/k/v projection's epilogue (`fuse_rope_into_qkv`): on, as it is the
# RoPE kernel's bits with one launch a decoder layer fewer (unmeasured on a GPU when turned on).
FUSE_ROPE = True


def fuse_rope_into_qkv(model: nn.Module) -> None:
    """Have each attention's q/k/v projection rotate q and k in its matmul's epilogue and write k and v
    into the KV cache there (its q and k rows paired: `matmul.interleave_rope`; `Attention.qkv_rope`), one
    launch fewer a layer and `elementwise.rotate_and_store`'s bits, where its kernel can (`_has_epilogues`:
    with float or int8 inputs) and RoPE covers whole heads with no q/k norm before it, while FUSE_ROPE.
    Elsewhere the layout is put back. `set_int8_inputs` ends with this."""
    from kvserve.models.decoder import Attention

    for attn in model.modules():
        if not isinstance(attn, Attention) or not isinstance(attn.qkv_proj, _RowLayouts):
            continue
        fused = (
            FUSE_ROPE
            and _has_epilogues(attn.qkv_proj, float_inputs=False)
            and attn.rotate_and_store is not None  # the GPU's forms (use_triton_forms)
            and attn.rotary_dim == attn.head_dim
            and attn.q_norm is None
            and attn.head_dim % 2 == 0
        )
        heads = (attn.num_heads, attn.num_kv_heads, attn.head_dim) if fused else None
        attn.qkv_proj.pair_rope_rows(heads)
        attn.qkv_rope = qkv_with_rope if fused else None


# A decoder layer's two norms in the prologues of the matmuls after them (`fuse_norms`): off until a GPU
# measures it (bench/gpu.py's `bf16-norms` and `q4-norms` runs); the same bits, two launches a layer
# fewer at up to NORM_IN_MATMUL_ROWS rows, each of the matmul's programs reading its rows whole.
FUSE_NORMS = False


def fuse_norms(model: nn.Module) -> None:
    """Have each decoder layer's attention and MLP norms hand their rows to q/k/v's and gate/up's matmul
    (`GpuRMSNorm.into_matmul`), which normalizes them in its own kernel (kernels/gpu/norm.NormedRows), where
    that matmul is kvserve's with float inputs (`_has_epilogues`) and the norm makes no int8 form, while
    FUSE_NORMS. `fuse_epilogues` ends with this."""
    from kvserve.models.decoder import DecoderLayer

    for layer in model.modules():
        if not isinstance(layer, DecoderLayer):
            continue
        for norm, consumer in ((layer.attn_norm, layer.self_attn.qkv_proj), (layer.ffn_norm, layer.mlp.gate_up_proj)):
            if isinstance(norm, GpuRMSNorm):
                norm.into_matmul = (
                    FUSE_NORMS and norm.batch_invariant and not norm.int8_output and _has_epilogues(consumer)
                )


def qkv_with_rope(
    qkv_proj: nn.Module,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin_signed: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """q/k/v projection of x [T, hidden] with RoPE and the KV cache's write in its kernel
    (`fuse_rope_into_qkv`): the rotated q [T, H, D]; k and v are in the caches at slot_mapping."""
    from kvserve.kernels.gpu.matmul import RopeStore

    num_heads, _, head_dim = qkv_proj.rope_heads
    rope = RopeStore(cos, sin_signed, k_cache, v_cache, slot_mapping, num_heads)
    return qkv_proj(x, rope).view(x.shape[0], num_heads, head_dim)


def use_triton_forms(model: nn.Module) -> None:
    """Turn a loaded model's float linear layers into GpuLinear (the lm_head giving float32 logits)
    and its norms into GpuRMSNorm, in place, sharing their tensors, and give its layers the one-kernel
    RoPE (with the KV cache's write where it rotates whole heads) and gated activation. Quantized
    layers the loader already built in their GPU forms."""
    from kvserve.kernels.gpu import elementwise
    from kvserve.models.decoder import MLP, Attention

    for name, module in list(model.named_modules()):
        if isinstance(module, Attention):
            module.rotate = elementwise.rotate
            module.rotate_and_store = elementwise.rotate_and_store
        elif isinstance(module, MLP):
            module.gated_activation = elementwise.gated_activation
        if isinstance(module, nn.Linear):
            model.set_submodule(name, GpuLinear.of(module, torch.float32 if name == "lm_head" else None))
        elif type(module) is RMSNorm:
            norm = GpuRMSNorm(module.weight.shape[0], module.eps)
            norm.weight = module.weight
            model.set_submodule(name, norm)
