"""kvserve: an LLM inference server and library where every request and conversation owns its KV cache."""

from kvserve.errors import (
    EngineClosedError,
    EngineError,
    InvalidRequestError,
    KVServeError,
    ModelFetchError,
    ModelNotFoundError,
    UnsupportedModelError,
    UnsupportedTensorTypeError,
)
from kvserve.llm import LLM
from kvserve.model_files import pull, resolve_model
from kvserve.outputs import RequestOutput, StreamChunk, Usage
from kvserve.sampling_params import SamplingParams
from kvserve.session_handle import Session
from kvserve.sessions import SessionLimitError, SessionNotFoundError
from kvserve.tokenizer import Tokenizer

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "EngineClosedError",
    "EngineError",
    "InvalidRequestError",
    "KVServeError",
    "ModelFetchError",
    "ModelNotFoundError",
    "RequestOutput",
    "SamplingParams",
    "Session",
    "SessionLimitError",
    "SessionNotFoundError",
    "StreamChunk",
    "Tokenizer",
    "UnsupportedModelError",
    "UnsupportedTensorTypeError",
    "Usage",
    "__version__",
    "pull",
    "resolve_model",
]
