"""Which form each weight takes in memory (the `--weights` choice), decided per module.

| choice | linear layers (q/k/v/o, gate/up/down, lm_head) | token embedding |
|---|---|---|
| `f32`, `bf16` | float, in that dtype (which is then also the compute dtype) | float |
| `q4` | int4 groups of 32: 4-bit GGUF blocks repacked exactly, anything else rounded to nearest | int8, a scale per 32 values |
| `q8` | int8, one scale per output row (on a GPU a scale per 32 inputs); lm_head a scale per 32 inputs | int8, a scale per 32 values |
| `auto` on CPU | as stored: int4 where any shard is a 4-bit GGUF type (with int8 inputs, AVX2 and up and no AMX, Q4_0, Q4_1 and Q4_K layers as 4-bit quads: Int4QuadsLinear); otherwise, where any shard is quantized, int8 with a scale per 32 inputs (Q8_0 and Q5_0 exactly, other types rounded to nearest; a tied lm_head shares the embedding's tensors); with int8 inputs (AVX2 and up), Q6_K, Q5_1 and Q5_K as stored (Int6Linear, Int5Linear); float for float tensors | int8 if stored quantized, else float |
| `auto` on a GPU | as on CPU: int4 where any shard is a 4-bit GGUF type, int8 with a scale per 32 inputs for other quantized types, float for float tensors (layers/gpu.py, packed on the device) | int8 if stored quantized, else float |

`auto` on CPU is the fastest measured choice for the bundled model (bench/compare.py).
"""

from __future__ import annotations

import torch

from kvserve.errors import InvalidRequestError
from kvserve.layers.gpu import uses_triton
from kvserve.layers.quantized import ACTIVATION_CHOICES
from kvserve.weights.source import SourceTensor

WEIGHT_CHOICES = ("auto", "q4", "q8", "bf16", "f32")
FLOAT_CHOICES = {"bf16": torch.bfloat16, "f32": torch.float32}
MODES = ("auto", "q4", "q8", "float")


def resolve_weights(weights: str, dtype: torch.dtype | None, device: torch.device) -> tuple[str, torch.dtype | None]:
    """(mode for `WeightPlan`, compute dtype or None for the device's default) from the user's choices."""
    if weights not in WEIGHT_CHOICES:
        raise InvalidRequestError(f"weights must be one of {', '.join(WEIGHT_CHOICES)}, got {weights!r}.", "weights")
    if weights in FLOAT_CHOICES:
        wanted = FLOAT_CHOICES[weights]
        if dtype is not None and dtype != wanted:
            raise InvalidRequestError(
                f"weights={weights} keeps the weights in the compute dtype, but dtype is {dtype}; "
                "drop dtype or make the two agree.",
                "weights",
            )
        return "float", wanted
    if device.type not in ("cpu", "cuda"):
        if weights == "auto":
            return "float", dtype
        raise InvalidRequestError(
            f"weights={weights} needs kvserve's CPU or CUDA kernels; on {device.type} use weights=bf16 or auto.",
            "weights",
        )
    return weights, dtype


def resolve_activations(activations: str, device: torch.device, weight_mode: str) -> str:
    """The `activations` choice, checked and resolved to "float" or "int8" (the int4 layers and a
    quantized lm_head quantize their inputs; CPU only). "auto" is "int8" where that serves quantized
    weights on a CPU with AVX2 (llama.cpp's arithmetic for Q4 models, as close to transformers as
    llama.cpp: bench/results/numerics.json; faster: docs/performance.md), "float" otherwise: for float
    weights, and on the GPU path until int8 inputs are measured faster there ("int8" runs its int4
    layers through int4_int8_matmul). "float" keeps the arithmetic closest to transformers."""
    if activations not in ACTIVATION_CHOICES:
        raise InvalidRequestError(
            f"activations must be one of {', '.join(ACTIVATION_CHOICES)}, got {activations!r}.", "activations"
        )
    if activations == "auto":
        cpu_kernels = device.type == "cpu" and not uses_triton(device)
        return "int8" if cpu_kernels and weight_mode != "float" and _cpu_has_avx2() else "float"
    if activations == "int8" and device.type not in ("cpu", "cuda"):
        raise InvalidRequestError(
            f"activations=int8 uses kvserve's CPU or CUDA kernels; on {device.type} use activations=float.",
            "activations",
        )
    return activations


def _cpu_has_avx2() -> bool:
    """Whether PyTorch found AVX2 (with FMA) or AVX-512 on this CPU, as the int8 kernels need. Asked of
    PyTorch, not of `ops.int8_activations()`: the C++ kernels may still be compiling in the background
    when the settings are resolved, and the layers fall back to float inputs if they lack it."""
    return torch.backends.cpu.get_cpu_capability().startswith(("AVX2", "AVX512"))


class WeightPlan:
    def __init__(self, mode: str, quads: bool = False, int8_inputs: bool = False) -> None:
        assert mode in MODES, mode
        self.mode = mode
        # the int4 and int8-group layers take int8 inputs (`activations` int8): on a GPU their scales stay
        # as stored, for the CPU's int4 x int8 bits (no packed bfloat16 FMAs, which round them)
        self.int8_inputs = int8_inputs
        # CPU int8-group layers held as quads from load (layers/quads.py: Q5_0 at 5 bits, as in the
        # file): where their int8 inputs go through int8_quads.cpp (AVX2 and up)
        self.quads = quads

    def linear_format(self, shards: list[SourceTensor], is_lm_head: bool = False) -> str:
        """'float', 'int4', 'int8' (a scale per row) or 'int8-groups' (a scale per 32 inputs) for a
        linear layer stored as these shards (q/k/v, gate/up, or one)."""
        if self.mode == "float":
            return "float"
        if self.mode == "q4":
            return "int4"
        if self.mode == "q8":
            return "int8-groups" if is_lm_head else "int8"
        if all(s.is_float for s in shards):
            return "float"
        if is_lm_head:  # the logits decide every token: Q8_0 kept exact (and shared with a tied embedding)
            return "int8-groups"
        return "int4" if any(s.is_int4 for s in shards) else "int8-groups"

    def embedding_format(self, source: SourceTensor) -> str:
        if self.mode == "float" or (self.mode == "auto" and source.is_float):
            return "float"
        return "int8"

    @property
    def is_quantized(self) -> bool:
        return self.mode != "float"
