"""Reading a GGUF file: metadata to ModelConfig, tensors dequantized under kvserve's parameter names.

The header is parsed here rather than by `gguf.GGUFReader`, which makes a numpy view of every part
of every metadata value (about 245,000 for a 49k-token vocabulary: 157 MB of Python objects and
2 s for the bundled model) and memory-maps the whole file, whose pages then count in the process's
RSS for as long as the reader lives. A GGUFFile keeps the metadata section as bytes (values are
decoded when asked for) and the tensor table, and reads a tensor's bytes when it is loaded.
"""

from __future__ import annotations

import math
import mmap
import os
import re
import struct
from collections.abc import Iterator
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType

from kvserve.errors import UnsupportedModelError
from kvserve.layers.quantized import Int4Groups
from kvserve.models.config import ModelConfig
from kvserve.weights.dequant import (
    INT4_GROUP_READERS,
    INT5_READERS,
    INT8_GROUP_READERS,
    dequantize,
    int4_groups,
    q4_k_parts,
    q6_k_parts,
)
from kvserve.weights.names import WeightTarget, shard_offsets
from kvserve.weights.source import SourceTensor

# GGUF tensor name -> (kvserve parameter, shard of a fused parameter or None).
_GLOBAL_NAMES = {
    "token_embd.weight": ("embed_tokens.weight", None),
    "output_norm.weight": ("norm.weight", None),
    "output.weight": ("lm_head.weight", None),
}
_LAYER_NAMES = {
    "attn_norm.weight": ("attn_norm.weight", None),
    "ffn_norm.weight": ("ffn_norm.weight", None),
    "post_attention_norm.weight": ("attn_out_norm.weight", None),
    "post_ffw_norm.weight": ("ffn_out_norm.weight", None),
    "attn_q_norm.weight": ("self_attn.q_norm.weight", None),
    "attn_k_norm.weight": ("self_attn.k_norm.weight", None),
    "attn_q.weight": ("self_attn.qkv_proj.weight", 0),
    "attn_k.weight": ("self_attn.qkv_proj.weight", 1),
    "attn_v.weight": ("self_attn.qkv_proj.weight", 2),
    "attn_q.bias": ("self_attn.qkv_proj.bias", 0),
    "attn_k.bias": ("self_attn.qkv_proj.bias", 1),
    "attn_v.bias": ("self_attn.qkv_proj.bias", 2),
    "attn_output.weight": ("self_attn.o_proj.weight", None),
    "attn_output.bias": ("self_attn.o_proj.bias", None),
    "ffn_gate.weight": ("mlp.gate_up_proj.weight", 0),
    "ffn_up.weight": ("mlp.gate_up_proj.weight", 1),
    "ffn_down.weight": ("mlp.down_proj.weight", None),
}
# Phi-3 stores q/k/v as one tensor, and gate and up as one ffn_up: split into the fused layer's shards.
_STORED_FUSED = {"attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
ROPE_FREQS = "rope_freqs.weight"
LONGROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")  # Phi-3's LongRoPE
GEMMA3_SLIDING_PATTERN = 6  # every 6th layer global, as llama.cpp sets for gemma3 (the file does not say)


# struct codes of the fixed-size GGUF value types
_SCALARS = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}
_VERSIONS = (2, 3)
_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3", "phi3")

# llama.cpp's general.sampling.* metadata keys -> SamplingParams' names
_SAMPLING_KEYS = {"temp": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p"}


class _Tensor(NamedTuple):
    name: str
    shape: list[int]  # outermost dimension first (GGUF lists them innermost first)
    qtype: GGMLQuantizationType
    offset: int  # of its bytes in the file
    nbytes: int


class _Cursor:
    """Reads GGUF values one after another from a buffer, in the file's byte order."""

    def __init__(self, buf: Any, order: str, pos: int = 0) -> None:
        self.buf, self.order, self.pos = buf, order, pos

    def scalar(self, code: str) -> Any:
        (value,) = struct.unpack_from(self.order + code, self.buf, self.pos)
        self.pos += struct.calcsize(code)
        return value

    def skip(self, nbytes: int) -> int:
        """Move past `nbytes`; returns where they start."""
        start, self.pos = self.pos, self.pos + nbytes
        if self.pos > len(self.buf):
            raise ValueError("a value runs past the end of the file")
        return start

    def string(self) -> str:
        length = self.scalar("Q")
        start = self.skip(length)
        return bytes(self.buf[start : self.pos]).decode("utf-8", errors="replace")

    def value(self, gtype: int, decode: bool = True) -> Any:
        """The value of GGUF type `gtype` here (str, int, float, bool or a list of those; None
        without `decode`), moving past it."""
        gtype = GGUFValueType(gtype)
        if gtype == GGUFValueType.STRING:
            if decode:
                return self.string()
            self.skip(self.scalar("Q"))
            return None
        if gtype in _SCALARS:
            return self.scalar(_SCALARS[gtype])
        if gtype != GGUFValueType.ARRAY:
            raise ValueError(f"unknown value type {gtype}")
        item_type, count = GGUFValueType(self.scalar("I")), self.scalar("Q")
        if item_type in _SCALARS:  # numbers: one numpy read rather than a struct call each
            dtype = np.dtype(_SCALARS[item_type]).newbyteorder(self.order)
            start = self.skip(count * dtype.itemsize)
            return np.frombuffer(self.buf, dtype, count, start).tolist() if decode else None
        values = [self.value(item_type, decode) for _ in range(count)]
        return values if decode else None


class GGUFFile:
    """A GGUF file's metadata and tensor table. Tensor bytes are read from the file when a tensor
    is loaded; the file must not change in between (a changed file is detected and refused)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                self._parse(buf)
                stat = os.fstat(f.fileno())
        except (ValueError, KeyError, IndexError, struct.error, OSError) as exc:
            raise UnsupportedModelError(f"{self.path} is not a readable GGUF file: {exc}") from exc
        self._identity = (stat.st_mtime_ns, stat.st_size)
        parts = self.get("split.count", 1)
        if isinstance(parts, int) and parts > 1:  # llama.cpp's gguf-split: each file holds some tensors
            raise UnsupportedModelError(
                f"{self.path} is one part of a GGUF split into {parts} files (split.count), and kvserve "
                "reads one file: merge them first (llama.cpp's `llama-gguf-split --merge FIRST-PART OUT.gguf`)."
            )

    def _parse(self, buf: mmap.mmap) -> None:
        if struct.unpack_from("<I", buf)[0] != GGUF_MAGIC:
            raise ValueError("GGUF magic invalid")
        # A file written on a machine of the other byte order reads as version << 16.
        self._order = "<" if struct.unpack_from("<I", buf, 4)[0] & 0xFFFF else ">"
        cursor = _Cursor(buf, self._order, 4)
        version = cursor.scalar("I")
        if version not in _VERSIONS:
            raise ValueError(f"GGUF version {version} is not supported (only {', '.join(map(str, _VERSIONS))})")
        num_tensors, num_fields = cursor.scalar("Q"), cursor.scalar("Q")
        self._fields: dict[str, tuple[int, int]] = {}  # key -> (value type, where the value starts)
        for _ in range(num_fields):
            key = cursor.string()
            if key in self._fields:
                raise ValueError(f"duplicate metadata key {key!r}")
            gtype = cursor.scalar("I")
            self._fields[key] = (gtype, cursor.pos)
            cursor.value(gtype, decode=False)
        self._metadata = bytes(buf[: cursor.pos])  # values are decoded from this copy on demand
        table = []
        for _ in range(num_tensors):
            name = cursor.string()
            dims = [cursor.scalar("Q") for _ in range(cursor.scalar("I"))]
            table.append((name, dims, GGMLQuantizationType(cursor.scalar("I")), cursor.scalar("Q")))
        alignment = self.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"invalid alignment {alignment!r}")
        data_start = -(-cursor.pos // alignment) * alignment
        self._tensors: list[_Tensor] = []
        for name, dims, qtype, offset in table:
            block_size, type_size = GGML_QUANT_SIZES[qtype]
            nbytes = int(np.prod(dims)) * type_size // block_size
            if data_start + offset + nbytes > len(buf):
                raise ValueError(f"tensor {name!r} runs past the end of the file")
            self._tensors.append(_Tensor(name, dims[::-1], qtype, data_start + offset, nbytes))
        if len(self.tensor_names) != len(self._tensors):
            raise ValueError("duplicate tensor names")

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value as a Python value (str, int, float, bool or list of those)."""
        field = self._fields.get(key)
        return default if field is None else _Cursor(self._metadata, self._order, field[1]).value(field[0])

    def array_length(self, key: str) -> int:
        """How many items the array `key` has (0 when absent), without decoding them."""
        field = self._fields.get(key)
        if field is None or field[0] != GGUFValueType.ARRAY:
            return 0
        return struct.unpack_from(self._order + "Q", self._metadata, field[1] + 4)[0]

    def read(self, tensor: _Tensor) -> torch.Tensor:
        """The stored bytes of `tensor` as a new uint8 tensor (nothing of the file stays mapped)."""
        out = torch.empty(tensor.nbytes, dtype=torch.uint8)
        view = memoryview(out.numpy())
        with open(self.path, "rb", buffering=0) as f:
            stat = os.fstat(f.fileno())
            if (stat.st_mtime_ns, stat.st_size) != self._identity:
                raise UnsupportedModelError(f"{self.path} changed after it was opened; load it again.")
            f.seek(tensor.offset)
            done = 0
            while done < tensor.nbytes:
                n = f.readinto(view[done:])
                if not n:
                    raise UnsupportedModelError(f"{self.path} ends inside tensor {tensor.name!r}.")
                done += n
        return out

    @property
    def architecture(self) -> str:
        return self.get("general.architecture", "")

    @cached_property
    def tensor_names(self) -> set[str]:
        return {t.name for t in self._tensors}

    @property
    def num_tensors(self) -> int:
        return len(self._tensors)

    def recommended_sampling(self) -> dict[str, float]:
        """The sampling values the file's author recommends (llama.cpp's `general.sampling.*` keys),
        under SamplingParams' names; empty when the file gives none."""
        values = {name: self.get(f"general.sampling.{key}") for key, name in _SAMPLING_KEYS.items()}
        return {
            name: value
            for name, value in values.items()
            if isinstance(value, int | float) and not isinstance(value, bool)
        }

    def model_config(self) -> ModelConfig:
        arch = self.architecture

        def key(name: str, default: Any = None) -> Any:
            return self.get(f"{arch}.{name}", default)

        if arch not in _GGUF_ARCHITECTURES:
            raise UnsupportedModelError(
                f"GGUF architecture {arch!r} ({self.path.name}) is not supported yet; kvserve runs "
                f"{', '.join(_GGUF_ARCHITECTURES)}."
            )
        num_heads = key("attention.head_count")
        hidden = key("embedding_length")
        num_layers = key("block_count")
        head_dim = key("attention.key_length") or hidden // num_heads
        context = key("context_length", 4096)
        names = self.tensor_names
        family: dict[str, Any] = {}
        if arch == "gemma3":
            # attention.sliding_window_pattern: a period, or per layer True where it slides
            pattern = key("attention.sliding_window_pattern", GEMMA3_SLIDING_PATTERN)
            sliding = pattern if isinstance(pattern, list) else [(i + 1) % pattern != 0 for i in range(num_layers)]
            scale = key("attention.scale")  # else llama.cpp's 1/sqrt(head_dim), for every size but 27B
            family = dict(
                layer_types=tuple("sliding_attention" if s else "full_attention" for s in sliding),
                local_rope_theta=10000.0,
                sandwich_norms=True,
                hidden_act="gelu_tanh",
                embedding_multiplier=math.sqrt(hidden),
                query_pre_attn_scalar=scale**-2 if scale else head_dim,
            )
        rotary_dims = key("rope.dimension_count")
        return ModelConfig(
            architecture=arch,
            vocab_size=key("vocab_size") or self.array_length("tokenizer.ggml.tokens"),
            hidden_size=hidden,
            intermediate_size=key("feed_forward_length"),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=key("attention.head_count_kv", num_heads),
            head_dim=head_dim,
            rms_norm_eps=key("attention.layer_norm_rms_epsilon", 1e-5),
            rope_theta=key("rope.freq_base", 10000.0),
            rope_scaling=self._rope_scaling(arch, context),
            max_position_embeddings=context,
            tie_word_embeddings="output.weight" not in names,
            attention_bias="blk.0.attn_q.bias" in names,
            attention_out_bias="blk.0.attn_output.bias" in names,
            sliding_window=key("attention.sliding_window") or None,
            partial_rotary_factor=rotary_dims / head_dim if rotary_dims else 1.0,
            qk_norm="blk.0.attn_q_norm.weight" in names,
            **family,
        )

    def _rope_scaling(self, arch: str, context: int) -> dict[str, Any] | None:
        """rope_scaling as Hugging Face spells it, from the file's rope.scaling keys (and Phi-3's
        LongRoPE factor tensors)."""
        scaling_type = self.get(f"{arch}.rope.scaling.type")
        if scaling_type == "linear":
            return {"rope_type": "linear", "factor": self.get(f"{arch}.rope.scaling.factor")}
        if LONGROPE_FACTORS[0] in self.tensor_names:
            long, short = (self._small_tensor(name).tolist() for name in LONGROPE_FACTORS)
            return {
                "rope_type": "longrope",
                "long_factor": long,
                "short_factor": short,
                "original_max_position_embeddings": self.get(f"{arch}.rope.scaling.original_context_length", context),
                "attention_factor": self.get(f"{arch}.rope.scaling.attn_factor"),
            }
        if scaling_type not in (None, "none"):
            raise UnsupportedModelError(f"RoPE scaling {scaling_type!r} in {self.path.name} is not supported.")
        return None

    def _small_tensor(self, name: str) -> torch.Tensor:
        """A small tensor's values (RoPE factors), flattened, in float32."""
        tensor = next(t for t in self._tensors if t.name == name)
        return dequantize(self.read(tensor).reshape(1, -1), tensor.qtype, int(np.prod(tensor.shape))).flatten()

    def rope_freq_factors(self) -> torch.Tensor | None:
        """llama.cpp's per-frequency RoPE divisors (llama3-style scaling), if the file has them."""
        return self._small_tensor(ROPE_FREQS) if ROPE_FREQS in self.tensor_names else None

    def stored(self) -> list[tuple[str, str, int, int]]:
        """Each model tensor as the file holds it: (kvserve's parameter name, GGML type name, bytes in the
        file, number of values); a tensor stored fused (Phi-3's qkv) under its fused name."""
        out = []
        for tensor in self._tensors:
            if tensor.name == ROPE_FREQS or tensor.name in LONGROPE_FACTORS:
                continue
            match = _LAYER_RE.match(tensor.name)
            fused = _STORED_FUSED.get(match.group(2)) if match else None
            # Phi-3's fused ffn_up is the whole gate_up, another family's its second shard: one module either way.
            name = f"layers.{match.group(1)}.{fused}" if fused is not None else _target(tensor.name).name
            out.append((name, tensor.qtype.name, tensor.nbytes, int(np.prod(tensor.shape))))
        return out

    def tensors(self, config: ModelConfig) -> Iterator[tuple[WeightTarget, SourceTensor]]:
        """Every model tensor under kvserve's names, read lazily as float32 or (4-bit and Q8_0 types)
        as its codes.

        llama.cpp stores Q and K rows permuted for its interleaved RoPE; that permutation is
        undone here so the weights match the rotate-half convention of the model code.
        """
        for tensor in self._tensors:
            if tensor.name == ROPE_FREQS or tensor.name in LONGROPE_FACTORS:
                continue
            match = _LAYER_RE.match(tensor.name)
            fused = _STORED_FUSED.get(match.group(2)) if match and config.architecture == "phi3" else None
            if fused is None:
                yield _target(tensor.name), self._source(tensor, config)
                continue
            offsets = shard_offsets(fused, config.q_size, config.kv_size, config.intermediate_size)
            for shard, part in enumerate(self._source(tensor, config).shards(offsets)):
                yield WeightTarget(f"layers.{match.group(1)}.{fused}", shard), part

    def _source(self, tensor: _Tensor, config: ModelConfig) -> SourceTensor:
        shape, qtype = tensor.shape, tensor.qtype
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        order = None  # the row permutation to undo, as a gather index (llama's converter permutes Q/K)
        if config.architecture == "llama" and ".attn_q." in tensor.name:
            order = _unpermute(torch.arange(shape[0]), config.num_attention_heads)
        elif config.architecture == "llama" and ".attn_k." in tensor.name:
            order = _unpermute(torch.arange(shape[0]), config.num_key_value_heads)

        def raw() -> torch.Tensor:
            return self.read(tensor).reshape(rows, -1)

        def read_float() -> torch.Tensor:
            weight = dequantize(raw(), qtype, shape[-1]).reshape(shape)
            return weight if order is None else weight[order]

        def read_int4() -> Int4Groups:
            groups = Int4Groups(*int4_groups(raw(), qtype))
            return groups if order is None else groups.permute_rows(order)

        def read_int8_groups() -> tuple[torch.Tensor, torch.Tensor]:
            codes, scales = INT8_GROUP_READERS[qtype](raw())
            return (codes, scales) if order is None else (codes[order], scales[order])

        def read_q6_k() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            parts = q6_k_parts(raw())
            return parts if order is None else tuple(t[order] for t in parts)

        def read_int5() -> tuple[torch.Tensor, ...]:
            parts = INT5_READERS[qtype](raw())
            return parts if order is None else tuple(t[order] for t in parts)

        def read_q4_k() -> tuple[torch.Tensor, ...]:
            parts = q4_k_parts(raw())
            return parts if order is None else tuple(t[order] for t in parts)

        return SourceTensor(
            kind=qtype.name,
            read_float=read_float,
            read_int4=read_int4 if qtype in INT4_GROUP_READERS else None,
            read_int8_groups=read_int8_groups if qtype in INT8_GROUP_READERS else None,
            read_q6_k=read_q6_k if qtype == GGMLQuantizationType.Q6_K else None,
            read_int5=read_int5 if qtype in INT5_READERS else None,
            read_q4_k=read_q4_k if qtype == GGMLQuantizationType.Q4_K else None,
        )


def open_gguf(path: str | Path) -> GGUFFile:
    """A GGUFFile, shared by everyone who opens the same unchanged file: parsing the header of the
    bundled model takes about 2 s, and loading config, tokenizer and weights would do it three times."""
    path = Path(path).resolve()
    stat = path.stat()
    return _open_cached(str(path), stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=4)
def _open_cached(path: str, mtime_ns: int, size: int) -> GGUFFile:
    return GGUFFile(path)


def _target(gguf_name: str) -> WeightTarget:
    if gguf_name in _GLOBAL_NAMES:
        return WeightTarget(*_GLOBAL_NAMES[gguf_name])
    match = _LAYER_RE.match(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        name, shard = _LAYER_NAMES[match.group(2)]
        return WeightTarget(f"layers.{match.group(1)}.{name}", shard)
    raise UnsupportedModelError(f"GGUF tensor {gguf_name!r} has no place in kvserve's decoder.")


def _unpermute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Invert llama.cpp's convert-time permutation of Q/K rows (interleaved -> rotate-half).
    Applied to `arange(rows)` it gives the same permutation as a gather index."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)
