"""ModelConfig: the architecture hyper-parameters, under Hugging Face's names, frozen after load."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from kvserve.errors import UnsupportedModelError

logger = logging.getLogger("kvserve.models")
SUPPORTED_ARCHITECTURES = ("llama",)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


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
    attention_bias: bool = False
    mlp_bias: bool = False
    # Attention over only the last `sliding_window` positions (Mistral). Not implemented yet: a
    # model with one is served with max_position_embeddings capped to it, where both agree exactly.
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"Architecture {self.architecture!r} is not supported yet; kvserve runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}. Pick a model of a supported family."
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

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face config.json dictionary (transformers 4.x or 5.x spelling)."""
        model_type = cfg.get("model_type", "")
        architecture = "llama" if model_type in ("llama", "mistral") else model_type
        num_heads = cfg["num_attention_heads"]
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        params = cfg.get("rope_parameters")  # transformers 5 folds theta and scaling into one dict
        if params:
            rope_theta = params.get("rope_theta", rope_theta)
            if params.get("rope_type", "default") != "default":
                rope_scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        max_positions = context_within_window(cfg.get("max_position_embeddings", 4096), window, model_type)
        return cls(
            architecture=architecture,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=rope_theta if rope_theta is not None else 10000.0,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", False),
            mlp_bias=cfg.get("mlp_bias", False),
            sliding_window=window or None,
        )


def context_within_window(max_positions: int, window: int | None, name: str) -> int:
    """The context kvserve serves for a model whose attention sees only the last `window` positions:
    up to the window, where sliding-window and full attention agree exactly (a token's keys all
    fall inside it), until sliding-window attention is implemented."""
    if not window or window >= max_positions:
        return max_positions
    logger.warning(
        "%s uses sliding-window attention over %d tokens, which kvserve does not implement yet: "
        "serving contexts of up to %d tokens, where it equals full attention.",
        name or "the model",
        window,
        window,
    )
    return window
