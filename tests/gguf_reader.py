"""gguf-py's reader on a plain array of the mapped file: the same fields and tensors, a third of the time.

transformers reads a GGUF (the references' models and tokenizers) through gguf-py's `GGUFReader`, which
maps the file with `np.memmap` and slices it a few times for each of the values it parses, a million for
Gemma 3's 262,144-token vocabulary, each slice through `memmap`'s Python `__getitem__` and `__array_finalize__`.
Here the reader's module sees a numpy whose `memmap` maps the file as numpy does, then hands the reader
a plain `ndarray` view of that map, so each slice is numpy's own C code over the same bytes (the map
stays alive as the view's base). Gemma's file took 15.6 s to read through the memmap and takes 4.6 s
so, on a 2-core EPYC, and a test session reads it three times (transformers reads a model's file twice, for its
config and its weights, and once more for a tokenizer). And transformers' map from the file's tensor
names to its model's is built once per model instead of once per submodule (`_one_name_map_per_model`).
"""

from __future__ import annotations

import contextlib
import functools
import types

import numpy as np


def _plain_map(*args, **kwargs) -> np.ndarray:
    """`np.memmap(...)`'s bytes as a plain array (a view: nothing copied, the map its base)."""
    return np.memmap(*args, **kwargs).view(np.ndarray)


def _numpy_with_plain_maps() -> types.ModuleType:
    module = types.ModuleType(np.__name__, np.__doc__)
    module.__dict__.update(vars(np))  # numpy's own names, looked up as fast as in numpy itself
    module.memmap = _plain_map
    return module


def speed_up() -> bool:
    """Install it once; False (and nothing changed) where gguf-py is missing or its reader does not
    map the file through the module-level numpy it was written for."""
    try:
        from gguf import gguf_reader
    except ImportError:
        return False
    if getattr(gguf_reader, "_kvserve_sped_up", False):
        return True
    if getattr(gguf_reader, "np", None) is not np or not hasattr(gguf_reader, "GGUFReader"):
        return False
    gguf_reader.np = _numpy_with_plain_maps()
    gguf_reader._kvserve_sped_up = True
    _one_name_map_per_model()
    return True


def _one_name_map_per_model() -> None:
    """transformers maps a GGUF's tensor names to its model's by walking every submodule, and builds
    gguf-py's `TensorNameMap` (every architecture's names for every block) anew in each: hundreds of
    times for one model. The map depends on the architecture and the block count alone and is only
    read, so one is kept per pair (loading SmolLM2's reference: 25.9 -> 12.8 s on a 2-core EPYC)."""
    import gguf

    if not hasattr(gguf.get_tensor_name_map, "cache_info"):
        gguf.get_tensor_name_map = functools.cache(gguf.get_tensor_name_map)


@contextlib.contextmanager
def ggufs_own():
    """gguf-py's reader as shipped, for the length of the block (the test that compares the two)."""
    from gguf import gguf_reader

    held = gguf_reader.np
    gguf_reader.np = np
    try:
        yield
    finally:
        gguf_reader.np = held
