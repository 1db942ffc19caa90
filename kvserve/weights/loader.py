"""Build a model from a checkpoint (GGUF file or Hugging Face folder) on a device, in a dtype.

Linear layers (and the token embedding) are built only once every shard of their weight has
arrived, in the form the WeightPlan picks: float, int8 or int4. A quantized layer never exists in
float in between, so loading a 4-bit model does not first need the float model's memory.
"""

from __future__ import annotations

import ctypes
import itertools
from pathlib import Path

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from tqdm.auto import tqdm

from kvserve.errors import UnsupportedModelError, reads_model_files
from kvserve.layers.gpu import (
    GpuInt4Linear,
    GpuInt8GroupLinear,
    GpuLinear,
    set_int8_inputs,
    use_triton_forms,
    uses_triton,
)
from kvserve.layers.quads import int4_quads_cpu, quads_cpu, to_quads
from kvserve.layers.quantized import (
    GROUP_SIZE,
    Int4Linear,
    Int4QuadsLinear,
    Int5Linear,
    Int6Linear,
    Int8Embedding,
    Int8GroupLinear,
    Int8Linear,
    set_activations,
)
from kvserve.models import MODEL_CLASSES
from kvserve.models.config import ModelConfig
from kvserve.weights.gguf_file import GGUFFile, open_gguf
from kvserve.weights.names import shard_offsets
from kvserve.weights.plan import WeightPlan
from kvserve.weights.registry import card_sampling
from kvserve.weights.safetensors_folder import SafetensorsFolder
from kvserve.weights.source import SourceTensor

Checkpoint = GGUFFile | SafetensorsFolder
EMBEDDING = "embed_tokens"
LM_HEAD = "lm_head"


def open_checkpoint(path: str | Path) -> Checkpoint:
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return open_gguf(path)
    if path.is_dir():
        return SafetensorsFolder(path)
    raise UnsupportedModelError(f"{path} is neither a .gguf file nor a Hugging Face model folder.")


# The in-place initializers a module constructor may call on its parameters.
_INITIALIZERS = frozenset(
    [getattr(nn.init, n) for n in dir(nn.init) if n.endswith("_") and not n.startswith("_")]
    + [torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.fill_, torch.Tensor.zero_]
)


class _SkipMetaInit(TorchFunctionMode):
    """Skips the random initialization of meta tensors while the model is built on the meta device.

    A meta tensor has no values, so nothing is lost; and `normal_` on a meta tensor (nn.Embedding's
    init) is a Python decomposition whose first use imports torch._dynamo, sympy and about 800
    other modules: 65 MB of RSS that the process would keep. Thread-local, like all torch modes.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _INITIALIZERS:
            tensor = args[0] if args else kwargs.get("tensor")
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


class _PendingLinear(nn.Module):
    """Stands in for a linear layer until all its shards are read; has no parameters."""

    def __init__(self, layer: nn.Linear, num_shards: int) -> None:
        super().__init__()
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.has_bias = layer.bias is not None
        self.num_shards = num_shards
        self.weights: dict[int, SourceTensor] = {}
        self.biases: dict[int, SourceTensor] = {}

    @property
    def is_complete(self) -> bool:
        return len(self.weights) == self.num_shards and len(self.biases) == (self.num_shards if self.has_bias else 0)

    def missing(self, name: str) -> list[str]:
        out = [f"{name}.weight[{s}]" for s in range(self.num_shards) if s not in self.weights]
        if self.has_bias:
            out += [f"{name}.bias[{s}]" for s in range(self.num_shards) if s not in self.biases]
        return out


@torch.inference_mode()
@reads_model_files
def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    progress: bool = True,
    weights: str = "float",
    activations: str = "float",
    stage: tuple[int, int] | None = None,
) -> torch.nn.Module:
    """Load weights into a fresh model (eval mode, no grad). `weights` is a WeightPlan mode
    ("float", "auto", "q4", "q8"; see weights/plan.py); `activations` "int8" makes the int4 layers
    quantize their inputs (see kvserve/layers/quantized.py). With `stage` (first, end), only a
    pipeline stage's share: layers [first, end), the embedding with the first layer, the final norm
    and lm_head with the last (DecoderForCausalLM); the other tensors are not read. Raises
    UnsupportedModelError."""
    checkpoint = open_checkpoint(path)
    config = checkpoint.model_config()
    int8_inputs = activations == "int8"
    plan = WeightPlan(weights, quads=int8_inputs and not uses_triton(device) and quads_cpu(), int8_inputs=int8_inputs)
    with torch.device("meta"), _SkipMetaInit():
        model = MODEL_CLASSES[config.architecture](config, stage)
    pending: dict[str, _PendingLinear] = {}
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear):
            pending[name] = _PendingLinear(module, _num_shards(name))
            model.set_submodule(name, pending[name])
    _materialize(model.to(dtype), device)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    tensors = checkpoint.tensors(config)
    if progress:
        tensors = tqdm(
            tensors, total=checkpoint.num_tensors, desc=f"Loading {Path(path).name}", unit="tensor", leave=False
        )
    for target, source in tensors:
        name = stage_name(model, target.name)
        if name is None:  # another stage's
            continue
        module_name, kind = name.rsplit(".", 1)
        if name == f"{LM_HEAD}.weight" and config.tie_word_embeddings:
            continue
        if module_name in pending:
            layer = pending[module_name]
            (layer.weights if kind == "weight" else layer.biases)[target.shard or 0] = source
            if layer.is_complete:
                model.set_submodule(module_name, _build_linear(module_name, layer, plan, config, dtype, device))
                del pending[module_name]
        elif name == f"{EMBEDDING}.weight":
            if model.has_embedding:
                _load_embedding(model, source, plan, dtype, tied=config.tie_word_embeddings and model.has_head)
            loaded.add(name)
            if config.tie_word_embeddings and model.has_head:
                layer = pending.pop(LM_HEAD)
                layer.weights[0] = source
                model.set_submodule(LM_HEAD, _build_linear(LM_HEAD, layer, plan, config, dtype, device, model))
        elif name in params:
            value = source.read_float()
            if name.endswith("norm.weight"):
                value = value + config.norm_weight_offset  # Gemma's checkpoints store w of 1 + w
            _copy(params[name].data, value, name)
            loaded.add(name)
        else:
            raise UnsupportedModelError(f"The checkpoint has {target.name!r}, which the model does not.")
    missing = sorted(n for n in params if n not in loaded and not n.startswith((f"{EMBEDDING}.", f"{LM_HEAD}.")))
    missing += [m for name, layer in pending.items() for m in layer.missing(name)]
    if f"{EMBEDDING}.weight" not in loaded and model.reads_embedding:
        missing.append(f"{EMBEDDING}.weight")
    if missing:
        missing = [_numbered_in_the_model(model, name) for name in missing]  # a stage's layers from its first
        raise UnsupportedModelError(f"The checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}.")
    model.rotary.build(torch.device(device), checkpoint.rope_freq_factors())
    if uses_triton(device):
        use_triton_forms(model)
    model.eval().requires_grad_(False)
    set_activations(model, activations)
    if uses_triton(device):
        set_int8_inputs(model, activations == "int8")
    del params, tensors
    _return_freed_memory()
    return model


def _numbered_in_the_model(model: nn.Module, name: str) -> str:
    """A stage's tensor name with its layer numbered as in the whole model (stage_name's inverse)."""
    if not name.startswith("layers."):
        return name
    _, index, rest = name.split(".", 2)
    return f"layers.{int(index) + model.first_layer}.{rest}"


def stage_name(model: nn.Module, name: str) -> str | None:
    """A checkpoint tensor's name in `model` (a pipeline stage numbers its layers from 0), or None
    where it belongs to another stage."""
    if name.startswith("layers."):
        _, index, rest = name.split(".", 2)
        layer = int(index)
        if layer >= model.config.num_hidden_layers:  # never dropped unsaid: the model would be another
            raise UnsupportedModelError(
                f"The checkpoint has a layer {layer}, but its model has {model.config.num_hidden_layers} layers "
                "(config.json's num_hidden_layers, GGUF's block_count); fix that, or fetch the model again."
            )
        if not model.first_layer <= layer < model.end_layer:
            return None
        return f"layers.{layer - model.first_layer}.{rest}"
    if name.startswith(f"{EMBEDDING}."):
        return name if model.reads_embedding else None
    if name.startswith((f"{LM_HEAD}.", "norm.")):
        return name if model.has_head else None
    return name


def _materialize(model: nn.Module, device: torch.device | str) -> None:
    """Give every meta parameter and buffer uninitialized storage on `device`, in its dtype.

    What `to_empty` does, but with `torch.empty`: `empty_like` of a meta tensor runs a Python
    reference that imports sympy (33 MB of RSS for good). The dtype is set while still on meta,
    so each tensor is allocated once, and its pages stay untouched until it is loaded (the float
    embedding, replaced when the plan keeps it int8, never becomes resident).
    """
    done: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if id(tensor) not in done:
                empty = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
                done[id(tensor)] = (
                    nn.Parameter(empty, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else empty
                )
            setattr(module, name, done[id(tensor)])


def _return_freed_memory() -> None:
    """Give the heap pages that loading freed back to the system (glibc; elsewhere nothing).

    The temporaries of loading (raw blocks, codes, int32 codes for packing) are freed, but glibc
    keeps their pages: freeing a large block raises its mmap threshold, so the next temporaries land
    in the loading thread's malloc arena between long-lived weights. For the bundled model that left
    30-40 MB resident beyond the weights; malloc_trim releases the free pages of every arena.
    """
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


def _num_shards(name: str) -> int:
    if name.endswith("qkv_proj"):
        return 3
    return 2 if name.endswith("gate_up_proj") else 1


def _copy(dest: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if tuple(dest.shape) != tuple(tensor.shape):
        raise UnsupportedModelError(
            f"Tensor for {name} has shape {tuple(tensor.shape)}, the model expects {tuple(dest.shape)}."
        )
    dest.copy_(tensor)


def _shard_rows(name: str, layer: _PendingLinear, config: ModelConfig) -> list[int]:
    if layer.num_shards == 1:
        return [layer.out_features]
    offsets = shard_offsets(name, config.q_size, config.kv_size, config.intermediate_size)
    return [b - a for a, b in itertools.pairwise(offsets)]


def _build_linear(
    name: str,
    layer: _PendingLinear,
    plan: WeightPlan,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    model: nn.Module | None = None,
) -> nn.Module:
    """The layer in its planned form from its shards (rows of q/k/v or gate/up, stacked in order)."""
    shards = [layer.weights[s] for s in range(layer.num_shards)]
    bias = torch.cat([layer.biases[s].read_float() for s in range(layer.num_shards)]) if layer.has_bias else None
    rows = _shard_rows(name, layer, config)
    fmt = plan.linear_format(shards, is_lm_head=name == LM_HEAD)
    gpu = uses_triton(device)
    if fmt == "int4" and not Int4Linear.supports(layer.out_features, layer.in_features):
        fmt = "int8"
    if fmt == "int8" and gpu and layer.in_features % GROUP_SIZE == 0:
        fmt = "int8-groups"  # the GPU's one int8 form: a scale per 32 inputs (float where they do not group)
    if fmt == "int8-groups":
        if layer.in_features % GROUP_SIZE:
            fmt = "int8"
        elif model is None and _q6_k_held(shards, layer, plan, gpu):
            # Q6_K as stored, 6 bits (the lm_head's logits in float32); a tied head (model given) shares the
            # embedding's table instead of holding a second copy
            parts = [s.read_q6_k() for s in shards]
            for i, ((codes, _, _), n) in enumerate(zip(parts, rows, strict=True)):
                _check_shape(name, i, tuple(codes.shape), (n, layer.in_features))
            codes, scales, d = (torch.cat(t) for t in zip(*parts, strict=True))
            return Int6Linear(codes, scales, d, dtype, bias, out_dtype=torch.float32 if name == LM_HEAD else None)
        elif model is None and _int5_held(shards, layer, plan, gpu):
            # Q5_1 / Q5_K as stored, 5 bits with a scale and a min per 32 (as Q6_K above)
            parts = [s.read_int5() for s in shards]
            for i, (part, n) in enumerate(zip(parts, rows, strict=True)):
                _check_shape(name, i, tuple(part[0].shape), (n, layer.in_features))
            stacked = tuple(torch.cat(t) for t in zip(*parts, strict=True))
            out_dtype = torch.float32 if name == LM_HEAD else None
            return Int5Linear(shards[0].kind, stacked, dtype, bias, out_dtype=out_dtype)
        elif name == LM_HEAD:
            return _int8_group_linear(shards[0], layer, plan, dtype, device, model)
        else:  # a hidden layer: Q8_0 / Q5_0 shards as stored, others rounded; out in the compute dtype
            parts = [s.int8_groups() for s in shards]
            for i, ((codes, _), n) in enumerate(zip(parts, rows, strict=True)):
                _check_shape(name, i, tuple(codes.shape), (n, layer.in_features))
            codes, scales = (torch.cat(t) for t in zip(*parts, strict=True))
            if gpu:
                return GpuInt8GroupLinear(codes, scales, device, bias)
            return _held(Int8GroupLinear(codes, scales, dtype, bias=bias, out_dtype=dtype), plan)
    if fmt == "int4" and _q4_k_held(name, shards, layer, plan, gpu):
        # Q4_K as stored, its codes arranged once: the same bits as Int4Linear's int8 kernel
        parts = [s.read_q4_k() for s in shards]
        for i, (part, n) in enumerate(zip(parts, rows, strict=True)):
            _check_shape(name, i, tuple(part[0].shape), (n, layer.in_features))
        return Int4QuadsLinear(tuple(torch.cat(t) for t in zip(*parts, strict=True)), dtype, bias)
    if fmt == "int4":
        groups = [s.int4() for s in shards]
        for i, (g, n) in enumerate(zip(groups, rows, strict=True)):
            _check_shape(name, i, tuple(g.codes.shape), (n, layer.in_features))
        weight = type(groups[0]).cat(groups)
        if gpu:  # the lm_head's logits in float32, as every other form gives them
            out_dtype = torch.float32 if name == LM_HEAD else None
            return GpuInt4Linear(weight, device, bias, out_dtype, dtype, int8_inputs=plan.int8_inputs)
        if _int4_quads_planned(name, plan, gpu) and Int4QuadsLinear.holds(weight):
            # Q4_0 / Q4_1 with int8 inputs: the same bits as Int4Linear's int8 kernel, its codes arranged once
            return Int4QuadsLinear(weight, dtype, bias)
        return Int4Linear(weight, dtype, bias)
    weight = _stacked_float(name, shards, rows, layer.in_features)
    if fmt == "int8" and not gpu:
        return Int8Linear(weight, dtype, bias)
    out = nn.Linear(layer.in_features, layer.out_features, bias=bias is not None, device=device, dtype=dtype)
    if model is not None and isinstance(getattr(model, EMBEDDING), nn.Embedding):
        out.weight = getattr(model, EMBEDDING).weight  # tied and both float: one tensor
    else:
        out.weight.copy_(weight)
    if bias is not None:
        out.bias.copy_(bias)
    return out


def _int8_group_linear(
    source: SourceTensor,
    layer: _PendingLinear,
    plan: WeightPlan,
    dtype: torch.dtype,
    device: torch.device | str,
    model: nn.Module | None,
) -> Int8GroupLinear | GpuInt8GroupLinear:
    """The lm_head as int8 with a scale per 32 inputs, float32 logits: a tied Q8_0 embedding's own
    tensors (one copy, in whichever layout the lm_head holds), Q8_0 codes as stored, or rounded from
    float."""
    embedding = getattr(model, EMBEDDING, None) if model is not None else None
    tied = isinstance(embedding, Int8Embedding) and embedding.group_size == GROUP_SIZE
    if tied:
        codes, scales = embedding.codes, embedding.scales
    else:
        codes, scales = source.int8_groups()
        _check_shape(LM_HEAD, 0, tuple(codes.shape), (layer.out_features, layer.in_features))
    if uses_triton(device):
        return GpuInt8GroupLinear(codes, scales, device, out_dtype=torch.float32)
    head = Int8GroupLinear(codes, scales, dtype)
    if tied:
        head.tie(embedding)
    return _held(head, plan)


def _q6_k_held(shards: list[SourceTensor], layer: _PendingLinear, plan: WeightPlan, gpu: bool) -> bool:
    """Whether a layer stored as Q6_K is held so (Int6Linear) rather than rounded to int8 groups: every
    shard Q6_K, a whole number of 16-row vectors, and quads planned (int8 inputs on a CPU with AVX2)."""
    return (
        plan.quads
        and not gpu
        and all(s.read_q6_k is not None for s in shards)
        and Int6Linear.supports(layer.out_features, layer.in_features)
    )


def _int4_quads_planned(name: str, plan: WeightPlan, gpu: bool) -> bool:
    """Whether a 4-bit hidden layer is held as 4-bit quads (Int4QuadsLinear) where its type and shape allow:
    int8 inputs on a CPU with AVX2 and no AMX (quads.int4_quads_cpu); the lm_head stays Int4Linear."""
    return plan.quads and not gpu and name != LM_HEAD and int4_quads_cpu()


def _q4_k_held(name: str, shards: list[SourceTensor], layer: _PendingLinear, plan: WeightPlan, gpu: bool) -> bool:
    """Whether a layer stored as Q4_K is held so (Int4QuadsLinear with its K-quant scales) rather than for
    int4_mm: 4-bit quads planned, every shard Q4_K, a whole number of 16-row vectors."""
    return (
        _int4_quads_planned(name, plan, gpu)
        and all(s.read_q4_k is not None for s in shards)
        and Int4QuadsLinear.holds_q4_k(layer.out_features, layer.in_features)
    )


def _int5_held(shards: list[SourceTensor], layer: _PendingLinear, plan: WeightPlan, gpu: bool) -> bool:
    """Whether a layer stored as Q5_1 or Q5_K is held so (Int5Linear) rather than rounded to int8 groups:
    every shard of the one type, a whole number of 16-row vectors (and of 256 inputs for Q5_K), and quads
    planned (int8 inputs on a CPU with AVX2)."""
    kind = shards[0].kind
    return (
        plan.quads
        and not gpu
        and all(s.read_int5 is not None and s.kind == kind for s in shards)
        and Int5Linear.supports(kind, layer.out_features, layer.in_features)
    )


def _held(layer: Int8GroupLinear, plan: WeightPlan) -> Int8GroupLinear:
    """`layer` in the layout its inputs will be multiplied in: quads from load where the plan says so
    and the layer's shape allows (whole groups, whole vectors of 16 rows), else row-major."""
    if plan.quads and layer.is_grouped and layer.out_features % 16 == 0:
        layer.arrange_quads()
    return layer


def _stacked_float(name: str, shards: list[SourceTensor], rows: list[int], in_features: int) -> torch.Tensor:
    tensors = [s.read_float() for s in shards]
    for i, (t, n) in enumerate(zip(tensors, rows, strict=True)):
        _check_shape(name, i, tuple(t.shape), (n, in_features))
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def _check_shape(name: str, shard: int, got: tuple[int, ...], want: tuple[int, ...]) -> None:
    if got != want:
        raise UnsupportedModelError(f"Tensor for {name}.weight[{shard}] has shape {got}, the model expects {want}.")


def _load_embedding(model: nn.Module, source: SourceTensor, plan: WeightPlan, dtype: torch.dtype, tied: bool) -> None:
    """The token embedding in its planned form; held as quads (Q5_0 at its 5 bits) where the plan holds
    its layers so, unless the lm_head is `tied` to it (the head then decides its layout)."""
    embedding = getattr(model, EMBEDDING)
    if plan.embedding_format(source) == "float":
        _copy(embedding.weight.data, source.read_float(), f"{EMBEDDING}.weight")
        return
    quantized = Int8Embedding(*source.int8_groups(), dtype).to(embedding.weight.device)
    _check_shape(EMBEDDING, 0, (quantized.num_embeddings, quantized.embedding_dim), tuple(embedding.weight.shape))
    if plan.quads and not tied and quantized.group_size == GROUP_SIZE and quantized.num_embeddings % 16 == 0:
        quantized.read_from(quads=to_quads(quantized.codes, quantized.scales))
    model.set_submodule(EMBEDDING, quantized)


def weight_summary(model: nn.Module) -> dict[str, object]:
    """How the weights are held: layer counts per form and the bytes of all parameters and weight buffers."""
    forms: dict[str, int] = {}
    for module in model.modules():
        forms_by_type = {
            Int4Linear: "int4",
            GpuInt4Linear: "int4",
            Int8Linear: "int8",
            Int8GroupLinear: "int8 groups",
            Int6Linear: "int6 (Q6_K)",
            Int5Linear: "int5 (Q5_1, Q5_K)",
            Int4QuadsLinear: "int4 quads (Q4_0, Q4_1, Q4_K)",
            GpuInt8GroupLinear: "int8 groups",
        }
        form = {**forms_by_type, Int8Embedding: "int8 embedding"}.get(type(module))
        if form is None and isinstance(module, nn.Linear | nn.Embedding | GpuLinear):
            kind = "linear" if isinstance(module, GpuLinear) else type(module).__name__.lower()
            form = f"{str(module.weight.dtype).removeprefix('torch.')} {kind}"
        if form is not None:
            forms[form] = forms.get(form, 0) + 1
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers(recurse=True)) if t is not model.rotary.cos_sin}
    return {"layers": forms, "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}


@reads_model_files
def load_config(path: str | Path) -> ModelConfig:
    return open_checkpoint(path).model_config()


@reads_model_files
def recommended_sampling(path: str | Path) -> dict[str, float]:
    """The sampling values a model file recommends (temperature, top_k, top_p, min_p), if any; for a
    registered model's file that recommends none, its model card's (registry.card_sampling)."""
    return open_checkpoint(path).recommended_sampling() or card_sampling(path)
