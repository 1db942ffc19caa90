"""What a helper process of kvserve's (the engine process, a pipeline stage) does to never outlive the
process that started it."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal


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
