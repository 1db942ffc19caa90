"""The int8 form a GPU kernel makes of its output for the layer it feeds (`--activations int8`).

A norm, the attention, or the gated activation can quantize its output per group of 32 in the kernel
that stores it (matmul.quantize_int8's words, d and s, the same bits), saving the next int4 or int8
layer its own quantizing launch. The form travels as an attribute of the output tensor
(layers/gpu.set_int8_inputs decides who makes one; the layer reads it back, or quantizes if absent).
"""

from __future__ import annotations

import torch

INT8_FORM = "kvserve_int8_form"


def with_int8_form(out: torch.Tensor, quantized: list | None) -> torch.Tensor:
    """out, handing on the int8 form a kernel appended to `quantized` (if it did) to the layer it feeds."""
    if quantized:
        setattr(out, INT8_FORM, quantized[0])
    return out
