"""kvserve: an LLM inference server and library where every request and conversation owns its KV cache."""

import os

# A decode step on the CPU is a few hundred short parallel regions. GNU OpenMP's worker threads
# sleep after a short spin once a process has more OpenMP threads than cores (as soon as a second
# thread has run parallel torch code), and waking them costs tens of microseconds per region, a
# large share of a small model's step. A longer spin (a few milliseconds at most, then they sleep)
# keeps them awake through a step (docs/performance.md). Takes effect only when
# kvserve is imported before torch; an explicit GOMP_SPINCOUNT wins.
os.environ.setdefault("GOMP_SPINCOUNT", "100000")
# oneDNN (under PyTorch's CPU GEMMs) caches a GEMM's set-up per exact shape in two LRU caches of 1024
# entries (ideep's and its primitive cache, ~0.25 MB each): a server sees a new row count with
# every new mix of prompts, so both fill to ~0.5 GB of native heap that looks like a leak
# (docs/reliability.md). 128 entries keep the shapes a steady load repeats. An explicit value wins.
os.environ.setdefault("LRU_CACHE_CAPACITY", "128")
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "128")

from typing import TYPE_CHECKING

# The public names, each imported from its module on first use (PEP 562): `import kvserve.cli` stays
# light, so that `kvserve --help` answers at once and Ctrl-C during a command's start is its own
# (torch's import, about a second, used to be interrupted with a traceback or an abort).
_WHERE = {
    "ChatTemplateError": "kvserve.text.chat_template",
    "EngineClosedError": "kvserve.errors",
    "EngineError": "kvserve.errors",
    "InvalidRequestError": "kvserve.errors",
    "KVServeError": "kvserve.errors",
    "LLM": "kvserve.llm",
    "ModelFetchError": "kvserve.errors",
    "ModelNotFoundError": "kvserve.errors",
    "RequestOutput": "kvserve.outputs",
    "SamplingParams": "kvserve.sampling_params",
    "Session": "kvserve.sessions.session",
    "SessionBusyError": "kvserve.sessions.manager",
    "SessionLimitError": "kvserve.sessions.manager",
    "SessionNotFoundError": "kvserve.sessions.manager",
    "SessionStoreError": "kvserve.sessions.store",
    "SessionsOffError": "kvserve.sessions.manager",
    "StreamChunk": "kvserve.outputs",
    "StructuredOutput": "kvserve.structured_output",
    "Tokenizer": "kvserve.text.tokenizer",
    "UnsupportedModelError": "kvserve.errors",
    "UnsupportedTensorTypeError": "kvserve.errors",
    "Usage": "kvserve.outputs",
    "__version__": "kvserve.version",
    "pull": "kvserve.weights.registry",
    "resolve_model": "kvserve.weights.registry",
}


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'kvserve' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value  # once
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])


if TYPE_CHECKING:
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
    from kvserve.outputs import RequestOutput, StreamChunk, Usage
    from kvserve.sampling_params import SamplingParams
    from kvserve.sessions.manager import SessionBusyError, SessionLimitError, SessionNotFoundError, SessionsOffError
    from kvserve.sessions.session import Session
    from kvserve.sessions.store import SessionStoreError
    from kvserve.structured_output import StructuredOutput
    from kvserve.text.chat_template import ChatTemplateError
    from kvserve.text.tokenizer import Tokenizer
    from kvserve.version import __version__
    from kvserve.weights.registry import pull, resolve_model

__all__ = [
    "LLM",
    "ChatTemplateError",
    "EngineClosedError",
    "EngineError",
    "InvalidRequestError",
    "KVServeError",
    "ModelFetchError",
    "ModelNotFoundError",
    "RequestOutput",
    "SamplingParams",
    "Session",
    "SessionBusyError",
    "SessionLimitError",
    "SessionNotFoundError",
    "SessionStoreError",
    "SessionsOffError",
    "StreamChunk",
    "StructuredOutput",
    "Tokenizer",
    "UnsupportedModelError",
    "UnsupportedTensorTypeError",
    "Usage",
    "__version__",
    "pull",
    "resolve_model",
]
