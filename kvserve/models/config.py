"""ModelConfig: the architecture hyper-parameters, under Hugging Face's names, frozen after load.

Every family kvserve serves is one decoder (kvserve/models/decoder.py) with named differences:

| family (config.json / GGUF) | differences from Llama |
|---|---|
| `llama`, `mistral` / `llama` | Mistral: a sliding window on every layer, where configured |
| `qwen2` / `qwen2` | bias on q, k and v; sliding window on the layers `layer_types` says |
| `qwen3` / `qwen3` | RMSNorm over each q and k head (`qk_norm`); head_dim of its own |
| `gemma3_text` / `gemma3` | embeddings times sqrt(hidden); RMSNorm weights 1 + w; norms on the attention's and MLP's outputs too (`sandwich_norms`); GELU-tanh gate; q/k norms; sliding-window layers with their own RoPE base; query scale 1/sqrt(query_pre_attn_scalar) |
| `phi3` / `phi3` | fused qkv and gate_up in the checkpoint; LongRoPE; partial rotary; sliding window |

A family's feature kvserve does not implement (logit soft-capping, an unknown RoPE type) is
refused at load with UnsupportedModelError naming it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvserve.errors import UnsupportedModelError

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3", "phi3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
ACTIVATIONS = ("silu", "gelu_tanh")
SLIDING, FULL = "sliding_attention", "full_attention"


_SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Hugging Face's rope_scaling dict ({"rope_type": "llama3", "factor": ..., ...}) or None.
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # on q, k and v
    attention_out_bias: bool = False  # on o (Llama's attention_bias sets both; Qwen2 has q/k/v only)
    mlp_bias: bool = False
    # Attention over only the last `sliding_window` positions (the query's own included), on every
    # layer, or on those `layer_types` marks "sliding_attention".
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    local_rope_theta: float | None = None  # the RoPE base of the sliding layers, where they have their own
    partial_rotary_factor: float = 1.0  # the share of each head's dimensions that RoPE rotates
    qk_norm: bool = False
    sandwich_norms: bool = False
    hidden_act: str = "silu"
    embedding_multiplier: float = 1.0
    query_pre_attn_scalar: float | None = None  # the softmax scale is its inverse square root, else head_dim's
    norm_weight_offset: float = 0.0  # added to every RMSNorm weight at load (Gemma's checkpoints store w of 1 + w)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"Architecture {self.architecture!r} is not supported yet; kvserve runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}. Pick a model of a supported family."
            )
        for name in _SIZES:
            value = getattr(self, name)
            if type(value) is not int or value < 1:  # missing, zero, or a string where a number belongs
                raise UnsupportedModelError(
                    f"The model's {name} is {value!r}, where a positive whole number belongs: its config.json or "
                    "GGUF metadata is incomplete or damaged. Fetch the model again, or fix that file."
                )
        if self.num_attention_heads % self.num_key_value_heads:
            raise UnsupportedModelError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}; the model file is inconsistent."
            )
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"RoPE scaling {self.rope_type!r} is not supported; kvserve supports {', '.join(SUPPORTED_ROPE_TYPES)}."
            )
        if self.hidden_act not in ACTIVATIONS:
            raise UnsupportedModelError(
                f"Activation {self.hidden_act!r} is not supported; kvserve supports {', '.join(ACTIVATIONS)}."
            )
        if self.layer_types is not None and (
            len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= {SLIDING, FULL}
        ):
            raise UnsupportedModelError(
                f"layer_types must name {self.num_hidden_layers} layers, each {SLIDING!r} or {FULL!r}; "
                f"got {self.layer_types!r}."
            )
        if self.rotary_dim % 2 or self.rotary_dim <= 0:
            raise UnsupportedModelError(
                f"partial_rotary_factor={self.partial_rotary_factor} leaves {self.rotary_dim} rotary dimensions "
                "of each head; RoPE needs an even number."
            )

    @property
    def rope_type(self) -> str:
        if not self.rope_scaling:
            return "default"
        return self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def layer_windows(self) -> tuple[int, ...]:
        """Per layer, how many positions a query sees (its own included); 0: all of them."""
        window = self.sliding_window or 0
        if self.layer_types is None:
            return (window,) * self.num_hidden_layers
        return tuple(window if kind == SLIDING else 0 for kind in self.layer_types)

    @property
    def layer_rope_tables(self) -> tuple[int, ...]:
        """Per layer, its RoPE table: 0 the model's, 1 the sliding layers' own (local_rope_theta)."""
        local = self.local_rope_theta is not None
        return tuple(int(local and w > 0) for w in self.layer_windows)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face config.json dictionary (transformers 4.x or 5.x spelling)."""
        model_type = cfg.get("model_type", "")
        reader = _HF_FAMILIES.get(model_type)
        if reader is None:
            raise UnsupportedModelError(
                f"config.json model_type {model_type!r} is not supported yet; kvserve runs "
                f"{', '.join(sorted(_HF_FAMILIES))}. Pick a model of a supported family."
            )
        for key in ("final_logit_softcapping", "attn_logit_softcapping"):
            if cfg.get(key):
                raise UnsupportedModelError(
                    f"{model_type} with {key}={cfg[key]} is not supported: kvserve has no soft-capping."
                )
        num_heads = cfg["num_attention_heads"]
        theta, scaling = _rope_parameters(cfg)
        common = dict(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=theta if theta is not None else 10000.0,
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            sliding_window=cfg.get("sliding_window") or None,
            layer_types=tuple(cfg["layer_types"]) if cfg.get("layer_types") else None,
        )
        return cls(**{**common, **reader(cfg)})


def _rope_parameters(cfg: dict[str, Any], layer_type: str = FULL) -> tuple[float | None, dict[str, Any] | None]:
    """(rope_theta, rope_scaling or None) from transformers 4's rope_theta/rope_scaling or 5's
    rope_parameters (one dict, or one per layer type)."""
    theta, scaling = cfg.get("rope_theta"), cfg.get("rope_scaling")
    params = cfg.get("rope_parameters")
    if params and layer_type in params:
        params = params[layer_type]
    if params:
        theta = params.get("rope_theta", theta)
        kind = params.get("rope_type", params.get("type", "default"))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"} if kind != "default" else None
    if scaling and scaling.get("rope_type", scaling.get("type")) in ("longrope", "su"):
        scaling = {**scaling, "rope_type": "longrope"}
        scaling.setdefault("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
    return theta, scaling


def _llama(cfg: dict[str, Any]) -> dict[str, Any]:
    bias = cfg.get("attention_bias", False)
    window = cfg.get("sliding_window") if cfg.get("model_type") == "mistral" else None
    return dict(
        architecture="llama",
        attention_bias=bias,
        attention_out_bias=bias,
        mlp_bias=cfg.get("mlp_bias", False),
        sliding_window=window or None,
        layer_types=None,
    )


def _qwen(cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen2/2.5: bias on q/k/v; Qwen3: q/k head norms, a bias on all four where configured."""
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
    layer_types = cfg.get("layer_types")
    if window and not layer_types:  # transformers 4: the layers from max_window_layers on slide
        first = cfg.get("max_window_layers", cfg["num_hidden_layers"])
        layer_types = [SLIDING if i >= first else FULL for i in range(cfg["num_hidden_layers"])]
    return dict(
        architecture=cfg["model_type"],
        attention_bias=cfg["model_type"] == "qwen2" or cfg.get("attention_bias", False),
        attention_out_bias=cfg["model_type"] == "qwen3" and cfg.get("attention_bias", False),
        qk_norm=cfg["model_type"] == "qwen3",
        sliding_window=window or None,
        layer_types=tuple(layer_types) if window and layer_types else None,
    )


def _gemma3(cfg: dict[str, Any]) -> dict[str, Any]:
    num_layers = cfg["num_hidden_layers"]
    pattern = cfg.get("sliding_window_pattern", 6)
    layer_types = cfg.get("layer_types") or [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
    local = (cfg.get("rope_parameters") or {}).get(SLIDING) or {}  # transformers 5; else rope_local_base_freq
    if local.get("rope_type", "default") != "default":
        raise UnsupportedModelError("Gemma 3 with RoPE scaling on its sliding layers is not supported.")
    activation = cfg.get("hidden_activation") or cfg.get("hidden_act", "gelu_pytorch_tanh")
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedModelError("Gemma 3 with bidirectional attention (an encoder) is not a generative model.")
    return dict(
        architecture="gemma3",
        rope_theta=_rope_parameters(cfg)[0] or 1_000_000.0,  # Gemma 3's global base unless told
        attention_bias=cfg.get("attention_bias", False),
        attention_out_bias=cfg.get("attention_bias", False),
        tie_word_embeddings=cfg.get("tie_word_embeddings", True),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        layer_types=tuple(layer_types),
        local_rope_theta=local.get("rope_theta") or cfg.get("rope_local_base_freq") or 10000.0,
        qk_norm=True,
        sandwich_norms=True,
        hidden_act="gelu_tanh" if activation == "gelu_pytorch_tanh" else activation,
        embedding_multiplier=math.sqrt(cfg["hidden_size"]),
        query_pre_attn_scalar=cfg.get("query_pre_attn_scalar", 256),
        norm_weight_offset=1.0,
    )


def _phi3(cfg: dict[str, Any]) -> dict[str, Any]:
    return dict(
        architecture="phi3",
        partial_rotary_factor=cfg.get("partial_rotary_factor", 1.0),
        layer_types=None,
        hidden_act=cfg.get("hidden_act", "silu"),
    )


_HF_FAMILIES = {
    "llama": _llama,
    "mistral": _llama,
    "qwen2": _qwen,
    "qwen3": _qwen,
    "gemma3_text": _gemma3,
    "phi3": _phi3,
}
