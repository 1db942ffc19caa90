"""A checkpoint tensor before it is placed in the model: its stored type and lazy readers.

The loader decides per module whether a weight is kept as float, int8 or int4 (weights/plan.py)
and only then reads it in that form, so a 4-bit GGUF tensor can be repacked from its codes
without ever being dequantized.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvserve.layers.quantized import Int4Groups, int8_groups_from_float

FLOAT_KINDS = ("F32", "F16", "BF16", "F64", "float32", "float16", "bfloat16", "float64")
INT4_KINDS = ("Q4_0", "Q4_1", "Q4_K")


@dataclass
class SourceTensor:
    kind: str  # GGML type name ("Q4_1", "Q8_0", "F32", ...) or torch dtype name ("bfloat16", ...)
    read_float: Callable[[], torch.Tensor]
    read_int4: Callable[[], Int4Groups] | None = None  # exact codes, for 4-bit GGML types
    read_int8_groups: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None  # exact Q8_0 codes, scales
    # exact Q6_K (codes, scales per 16, d per 256): dequant.q6_k_parts
    read_q6_k: Callable[[], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
    # exact Q5_1 / Q5_K parts (5-bit codes, a scale and a min per 32): dequant.q5_1_parts / q5_k_parts
    read_int5: Callable[[], tuple[torch.Tensor, ...]] | None = None
    # exact Q4_K parts (4-bit codes, 6-bit scales and mins per 32, d and dmin per 256): dequant.q4_k_parts
    read_q4_k: Callable[[], tuple[torch.Tensor, ...]] | None = None

    @property
    def is_float(self) -> bool:
        return self.kind in FLOAT_KINDS

    @property
    def is_int4(self) -> bool:
        return self.read_int4 is not None

    def int4(self) -> Int4Groups:
        """Exact codes when stored as 4-bit groups, else round-to-nearest from the float values
        (from Q8_0's codes a block of rows at a time, without the whole float weight)."""
        if self.read_int4 is not None:
            return self.read_int4()
        if self.read_int8_groups is not None:
            return Int4Groups.from_int8_groups(*self.read_int8_groups())
        return Int4Groups.from_float(self.read_float())

    def int8_groups(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes, scales) with a scale per 32 values: exact where stored so (Q8_0, Q5_0), else
        rounded to nearest from the float values."""
        if self.read_int8_groups is not None:
            return self.read_int8_groups()
        return int8_groups_from_float(self.read_float())

    def shards(self, offsets: Sequence[int]) -> list[SourceTensor]:
        """The row ranges between consecutive `offsets` of this tensor (the shards of a fused checkpoint
        tensor, e.g. Phi-3's qkv_proj), read in the same forms; the tensor is read once for all."""
        read_float = functools.cache(self.read_float)
        int4 = None if self.read_int4 is None else functools.cache(self.read_int4)
        int8 = None if self.read_int8_groups is None else functools.cache(self.read_int8_groups)
        q6_k = None if self.read_q6_k is None else functools.cache(self.read_q6_k)
        int5 = None if self.read_int5 is None else functools.cache(self.read_int5)
        q4_k = None if self.read_q4_k is None else functools.cache(self.read_q4_k)

        def shard(begin: int, end: int) -> SourceTensor:
            part = slice(begin, end)
            return SourceTensor(
                self.kind,
                lambda: read_float()[part],
                None if int4 is None else lambda: int4().permute_rows(torch.arange(begin, end)),
                None if int8 is None else lambda: tuple(t[part] for t in int8()),
                None if q6_k is None else lambda: tuple(t[part] for t in q6_k()),
                None if int5 is None else lambda: tuple(t[part] for t in int5()),
                None if q4_k is None else lambda: tuple(t[part] for t in q4_k()),
            )

        return [shard(begin, end) for begin, end in itertools.pairwise(offsets)]

    @classmethod
    def of(cls, tensor: torch.Tensor) -> SourceTensor:
        return cls(str(tensor.dtype).removeprefix("torch."), lambda: tensor)
