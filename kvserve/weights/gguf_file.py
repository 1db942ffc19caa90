"""Reading a GGUF file: metadata to ModelConfig, tensors dequantized under kvserve's parameter names."""

from __future__ import annotations

import re
from collections.abc import Iterator
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType

from kvserve.config import ModelConfig
from kvserve.errors import UnsupportedModelError
from kvserve.weights.dequant import dequantize
from kvserve.weights.names import WeightTarget

# GGUF tensor name -> (kvserve parameter, shard of a fused parameter or None).
_GLOBAL_NAMES = {
    "token_embd.weight": ("embed_tokens.weight", None),
    "output_norm.weight": ("norm.weight", None),
    "output.weight": ("lm_head.weight", None),
}
_LAYER_NAMES = {
    "attn_norm.weight": ("input_layernorm.weight", None),
    "ffn_norm.weight": ("post_attention_layernorm.weight", None),
    "attn_q.weight": ("self_attn.qkv_proj.weight", 0),
    "attn_k.weight": ("self_attn.qkv_proj.weight", 1),
    "attn_v.weight": ("self_attn.qkv_proj.weight", 2),
    "attn_q.bias": ("self_attn.qkv_proj.bias", 0),
    "attn_k.bias": ("self_attn.qkv_proj.bias", 1),
    "attn_v.bias": ("self_attn.qkv_proj.bias", 2),
    "attn_output.weight": ("self_attn.o_proj.weight", None),
    "ffn_gate.weight": ("mlp.gate_up_proj.weight", 0),
    "ffn_up.weight": ("mlp.gate_up_proj.weight", 1),
    "ffn_down.weight": ("mlp.down_proj.weight", None),
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
ROPE_FREQS = "rope_freqs.weight"


def _field_value(field: Any) -> Any:
    """A GGUF metadata field as a Python value (str, int, float, bool or list of those)."""
    types = field.types
    if types[0] == GGUFValueType.ARRAY:
        if types[-1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if types[0] == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    value = field.parts[field.data[0]].tolist()[0]
    return bool(value) if types[0] == GGUFValueType.BOOL else value


class GGUFFile:
    """A GGUF file opened read-only (memory-mapped). Metadata values are decoded on demand."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self.reader = GGUFReader(self.path)
        except Exception as exc:  # the gguf package raises ValueError/struct.error on bad files
            raise UnsupportedModelError(f"{self.path} is not a readable GGUF file: {exc}") from exc

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        return default if field is None else _field_value(field)

    @property
    def architecture(self) -> str:
        return self.get("general.architecture", "")

    @cached_property
    def tensor_names(self) -> set[str]:
        return {t.name for t in self.reader.tensors}

    @property
    def num_tensors(self) -> int:
        return len(self.reader.tensors)

    def model_config(self) -> ModelConfig:
        arch = self.architecture

        def key(name: str, default: Any = None) -> Any:
            return self.get(f"{arch}.{name}", default)

        if arch != "llama":
            raise UnsupportedModelError(
                f"GGUF architecture {arch!r} ({self.path.name}) is not supported yet; kvserve runs llama."
            )
        num_heads = key("attention.head_count")
        hidden = key("embedding_length")
        rope_scaling = None
        scaling_type = key("rope.scaling.type")
        if scaling_type == "linear":
            rope_scaling = {"rope_type": "linear", "factor": key("rope.scaling.factor")}
        elif scaling_type not in (None, "none"):
            raise UnsupportedModelError(f"RoPE scaling {scaling_type!r} in {self.path.name} is not supported.")
        num_kv_heads = key("attention.head_count_kv", num_heads)
        return ModelConfig(
            architecture=arch,
            vocab_size=key("vocab_size") or len(self.get("tokenizer.ggml.tokens", [])),
            hidden_size=hidden,
            intermediate_size=key("feed_forward_length"),
            num_hidden_layers=key("block_count"),
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=key("attention.key_length") or hidden // num_heads,
            rms_norm_eps=key("attention.layer_norm_rms_epsilon", 1e-5),
            rope_theta=key("rope.freq_base", 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=key("context_length", 4096),
            tie_word_embeddings="output.weight" not in self.tensor_names,
            attention_bias="blk.0.attn_q.bias" in self.tensor_names,
        )

    def rope_freq_factors(self) -> torch.Tensor | None:
        """llama.cpp's per-frequency RoPE divisors (llama3-style scaling), if the file has them."""
        for tensor in self.reader.tensors:
            if tensor.name == ROPE_FREQS:
                return torch.from_numpy(np.array(tensor.data, dtype=np.float32)).flatten()
        return None

    def tensors(self, config: ModelConfig) -> Iterator[tuple[WeightTarget, torch.Tensor]]:
        """Yield every model tensor dequantized to float32, mapped to kvserve's names.

        llama.cpp stores Q and K rows permuted for its interleaved RoPE; that permutation is
        undone here so the weights match the rotate-half convention of the model code.
        """
        for tensor in self.reader.tensors:
            if tensor.name == ROPE_FREQS:
                continue
            target = _target(tensor.name)
            shape = [int(n) for n in reversed(tensor.shape.tolist())]  # GGUF lists dims innermost first
            qtype = GGMLQuantizationType(int(tensor.tensor_type))
            raw = torch.from_numpy(np.array(tensor.data).view(np.uint8))  # a copy: the map is read-only
            rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
            weight = dequantize(raw.reshape(rows, -1), qtype, shape[-1]).reshape(shape)
            if ".attn_q." in tensor.name:
                weight = _unpermute(weight, config.num_attention_heads)
            elif ".attn_k." in tensor.name:
                weight = _unpermute(weight, config.num_key_value_heads)
            yield target, weight


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
    raise UnsupportedModelError(f"GGUF tensor {gguf_name!r} has no place in the llama model code.")


def _unpermute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Invert llama.cpp's convert-time permutation of Q/K rows (interleaved -> rotate-half)."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)
