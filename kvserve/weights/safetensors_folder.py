"""Reading a Hugging Face model folder: config.json plus one or more *.safetensors files."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from kvserve.errors import UnsupportedModelError
from kvserve.models.config import ModelConfig
from kvserve.weights.names import WeightTarget, shard_offsets
from kvserve.weights.source import SourceTensor

_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_STORED_FUSED = ("self_attn.qkv_proj", "mlp.gate_up_proj")  # Phi-3 stores them fused: split into shards
# Hugging Face's norm names -> kvserve's roles (kvserve/models/decoder.py); Gemma's post_attention
# norm is the attention's output norm, Llama's the MLP's input norm.
_NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
_SANDWICH_NORMS = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "attn_out_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "ffn_out_norm",
}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def _checkpoint_files(path: Path) -> list[Path]:
    """The checkpoint's files as transformers finds them: the shards its index names, else
    model.safetensors, else every *.safetensors (a folder may also hold another format's copy of the
    weights, Mistral's consolidated.safetensors, or a stale single file beside newer shards)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise UnsupportedModelError(f"{index} has no weight_map of tensor names to files; fix or remove it.")
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise UnsupportedModelError(f"{index} names shards that are not in {path}: {missing[:3]}; fetch them.")
        return files
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    return sorted(path.glob("*.safetensors"))


class SafetensorsFolder:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        config_path = self.path / "config.json"
        if not config_path.is_file():
            raise UnsupportedModelError(f"{self.path} has no config.json; it is not a Hugging Face model folder.")
        self.hf_config = json.loads(config_path.read_text())
        self.files = _checkpoint_files(self.path)
        if not self.files:
            raise UnsupportedModelError(
                f"{self.path} has no *.safetensors files; save the model with safe_serialization=True."
            )

    @property
    def num_tensors(self) -> int:
        count = 0
        for file in self.files:
            with safe_open(file, framework="pt") as f:
                count += len(list(f.keys()))
        return count

    def model_config(self) -> ModelConfig:
        return ModelConfig.from_hf_dict(self.hf_config)

    def recommended_sampling(self) -> dict[str, float]:
        """The sampling values of generation_config.json (temperature, top_k, top_p, min_p), unless it
        turns sampling off (`do_sample: false`); empty when there are none."""
        path = self.path / "generation_config.json"
        config = json.loads(path.read_text()) if path.is_file() else {}
        if config.get("do_sample") is False:
            return {}
        names = ("temperature", "top_k", "top_p", "min_p")
        return {
            n: config[n] for n in names if isinstance(config.get(n), int | float) and not isinstance(config[n], bool)
        }

    def rope_freq_factors(self) -> torch.Tensor | None:
        return None

    def tensors(self, config: ModelConfig) -> Iterator[tuple[WeightTarget, SourceTensor]]:
        norms = _SANDWICH_NORMS if config.sandwich_norms else _NORMS
        for file in self.files:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    target = _target(name, norms)
                    if target is None:
                        continue
                    source = SourceTensor.of(f.get_tensor(name))
                    module = target.name.rsplit(".", 1)[0]
                    if target.shard is None and module.endswith(_STORED_FUSED):
                        offsets = shard_offsets(module, config.q_size, config.kv_size, config.intermediate_size)
                        for shard, part in enumerate(source.shards(offsets)):
                            yield target._replace(shard=shard), part
                    else:
                        yield target, source


def _target(hf_name: str, norms: dict[str, str]) -> WeightTarget | None:
    if hf_name == "model.embed_tokens.weight":
        return WeightTarget("embed_tokens.weight")
    if hf_name == "model.norm.weight":
        return WeightTarget("norm.weight")
    if hf_name == "lm_head.weight":
        return WeightTarget("lm_head.weight")
    match = _LAYER_RE.match(hf_name)
    if match:
        layer, module, kind = match.groups()
        if module.endswith("rotary_emb"):
            return None
        if module in _FUSED:
            fused, shard = _FUSED[module]
            return WeightTarget(f"layers.{layer}.{fused}.{kind}", shard)
        return WeightTarget(f"layers.{layer}.{norms.get(module, module)}.{kind}")
    if hf_name.endswith("rotary_emb.inv_freq"):
        return None
    raise UnsupportedModelError(f"Checkpoint tensor {hf_name!r} has no place in kvserve's decoder.")
