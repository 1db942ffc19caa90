"""What a process of kvserve's own (the server's front end, the engine process, a pipeline stage) does:
a helper never outlives the process that started it, and none walks its start-up heap to collect
garbage."""

from __future__ import annotations

import ctypes
import gc
import logging
import multiprocessing
import os
import signal
import time

logger = logging.getLogger("kvserve")


def die_with_parent(parent_pid: int | None = None) -> None:
    """On Linux, have the kernel kill this process the moment its parent (`parent_pid`, else the
    multiprocessing parent) dies, even by SIGKILL: a helper whose parent is gone must not go on
    running requests, or recording session turns, for a server that is gone. Elsewhere the helper
    notices by other means (a closed pipe, a store gone)."""
    if parent_pid is None:
        parent = multiprocessing.parent_process()
        parent_pid = parent.pid if parent is not None else None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if parent_pid is not None and os.getppid() != parent_pid:  # it died before prctl took effect
        os._exit(1)


def freeze_startup_heap(process: str) -> int:
    """Collect once, then leave every object alive now (the imports, the model's modules, the
    tokenizer's tables: a few hundred thousand objects) out of later collections: a full collection
    walks every tracked object with the interpreter lock held, 0.15-0.2 s with the engine loaded on a
    small CPU, a stall of every stream at once, and CPython runs one whenever enough objects have
    aged since the last. (vLLM and SGLang freeze after start-up too.) Only in a process kvserve owns
    for good: a cycle among these objects is never collected. Returns the objects frozen."""
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info(
        "%s process: %d start-up objects left out of garbage collection (one full collection: %.0f ms)",
        process,
        frozen,
        (time.perf_counter() - start) * 1000,
    )
    return frozen
