"""Build a model from a checkpoint (GGUF file or Hugging Face folder) on a device, in a dtype."""

from __future__ import annotations

from pathlib import Path

import torch
from tqdm.auto import tqdm

from kvserve.config import ModelConfig
from kvserve.errors import UnsupportedModelError
from kvserve.models import MODEL_CLASSES
from kvserve.weights.gguf_file import GGUFFile, open_gguf
from kvserve.weights.names import shard_offsets
from kvserve.weights.safetensors_folder import SafetensorsFolder

Checkpoint = GGUFFile | SafetensorsFolder


def open_checkpoint(path: str | Path) -> Checkpoint:
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return open_gguf(path)
    if path.is_dir():
        return SafetensorsFolder(path)
    raise UnsupportedModelError(f"{path} is neither a .gguf file nor a Hugging Face model folder.")


@torch.inference_mode()
def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    progress: bool = True,
) -> torch.nn.Module:
    """Load weights into a fresh model (eval mode, no grad). Raises UnsupportedModelError."""
    checkpoint = open_checkpoint(path)
    config = checkpoint.model_config()
    with torch.device("meta"):
        model = MODEL_CLASSES[config.architecture](config)
    model = model.to_empty(device=device).to(dtype)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    params = dict(model.named_parameters(remove_duplicate=False))
    expected = _expected_shards(params, config)
    loaded: set[tuple[str, int | None]] = set()
    tensors = checkpoint.tensors(config)
    if progress:
        tensors = tqdm(
            tensors,
            total=checkpoint.num_tensors,
            desc=f"Loading {Path(path).name}",
            unit="tensor",
            leave=False,
        )
    for target, tensor in tensors:
        if target.name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        param = params.get(target.name)
        if param is None:
            raise UnsupportedModelError(f"The checkpoint has {target.name!r}, which the model does not.")
        if target.shard is None:
            dest = param.data
        else:
            offsets = shard_offsets(target.name, config.q_size, config.kv_size, config.intermediate_size)
            dest = param.data[offsets[target.shard] : offsets[target.shard + 1]]
        if tuple(dest.shape) != tuple(tensor.shape):
            raise UnsupportedModelError(
                f"Tensor for {target} has shape {tuple(tensor.shape)}, the model expects {tuple(dest.shape)}."
            )
        dest.copy_(tensor)
        loaded.add((target.name, target.shard))
    missing = sorted(f"{n}[{s}]" if s is not None else n for n, s in expected - loaded)
    if missing:
        raise UnsupportedModelError(f"The checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}.")
    model.rotary.build(torch.device(device), checkpoint.rope_freq_factors())
    model.eval().requires_grad_(False)
    return model


def _expected_shards(params: dict[str, torch.nn.Parameter], config: ModelConfig) -> set[tuple[str, int | None]]:
    expected: set[tuple[str, int | None]] = set()
    for name in params:
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if "qkv_proj" in name:
            expected.update((name, s) for s in range(3))
        elif "gate_up_proj" in name:
            expected.update((name, s) for s in range(2))
        else:
            expected.add((name, None))
    return expected


def load_config(path: str | Path) -> ModelConfig:
    return open_checkpoint(path).model_config()
