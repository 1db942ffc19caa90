"""kvserve: an LLM inference server and library where every request and conversation owns its KV cache."""

from kvserve.errors import (
    KVServeError,
    ModelFetchError,
    ModelNotFoundError,
    UnsupportedModelError,
    UnsupportedTensorTypeError,
)
from kvserve.model_files import pull, resolve_model
from kvserve.tokenizer import Tokenizer

__version__ = "0.1.0"

__all__ = [
    "KVServeError",
    "ModelFetchError",
    "ModelNotFoundError",
    "Tokenizer",
    "UnsupportedModelError",
    "UnsupportedTensorTypeError",
    "__version__",
    "pull",
    "resolve_model",
]
