"""Building and loading the C++ extension (kvserve/kernels/csrc), once per process.

The extension is compiled on first use with the machine's C++ compiler and -march=native (about a
minute, once per machine; cached under $TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions,
in a folder named by a hash of every source file, the CPU's flags and torch's version). Without
a compiler, or with KVSERVE_FUSED_DECODE=0, nothing here is loaded and every caller takes its
PyTorch path.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("kvserve.kernels")
SOURCE_DIR = Path(__file__).resolve().parent / "csrc"
_lock = threading.Lock()
_extension: Any = None
_error: str | None = None


def is_enabled() -> bool:
    """False when KVSERVE_FUSED_DECODE is 0/false/no: read at every call, so that turning it off
    takes effect even after the extension was loaded."""
    return os.environ.get("KVSERVE_FUSED_DECODE", "1") not in ("0", "false", "no")


def sources() -> list[Path]:
    """The files compiled together (the .cpp files) and those they include (headers)."""
    return sorted(p for p in SOURCE_DIR.iterdir() if p.suffix in (".cpp", ".h"))


def build_name() -> str:
    """The cache folder's name: changes with any source file, the CPU (-march=native) or torch."""
    digest = hashlib.sha256()
    for path in sources():
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(f"{_cpu_identity()}{torch.__version__}".encode())
    return "kvserve_kernels_" + digest.hexdigest()[:12]


def load() -> Any:
    """The compiled module (building it first if needed; waits), or None when it cannot be built
    (the reason logged once, and kept in `error()`) or is turned off."""
    global _extension, _error
    if not is_enabled():
        return None
    with _lock:
        if _extension is None and _error is None:
            try:
                _extension = _build_or_load(build_name())
            except Exception as exc:  # no compiler, no headers: the PyTorch paths serve
                _error = f"{type(exc).__name__}: {exc}"
                logger.warning("C++ kernels unavailable, using PyTorch's: %s", _error)
        return _extension


def start_loading() -> None:
    """`load` in a background thread. Compiling runs in a compiler subprocess, so the caller
    keeps serving on the PyTorch paths meanwhile."""
    if is_enabled() and _extension is None and _error is None:
        threading.Thread(target=load, name="kvserve-build-kernels", daemon=True).start()


def loaded() -> Any:
    """The module if it is loaded by now and enabled, without waiting; else None."""
    return _extension if _extension is not None and is_enabled() else None


def error() -> str | None:
    """Why the build failed, or None."""
    return _error


def _build_or_load(name: str) -> Any:
    """torch's `load`, serialized across processes by an flock that dies with its holder.

    torch's own lock is a plain file: a build killed midway leaves it behind and every later
    build waits on it forever. Holding the flock, no live process is building, so any such file
    is stale and is removed first."""
    import fcntl

    from torch.utils.cpp_extension import _get_build_directory
    from torch.utils.cpp_extension import load as torch_load

    build_dir = Path(_get_build_directory(name, verbose=False))
    build_dir.mkdir(parents=True, exist_ok=True)
    if not (build_dir / f"{name}.so").exists():  # said at warning level: the first start pauses here
        logger.warning("Compiling kvserve's C++ kernels for this CPU (once per machine, about a minute)...")
    with open(build_dir / "kvserve.flock", "w") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        return torch_load(
            name=name,
            sources=[str(p) for p in sources() if p.suffix == ".cpp"],
            extra_include_paths=[str(SOURCE_DIR)],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            verbose=False,
        )


def _cpu_identity() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
        return next((line for line in info.splitlines() if line.startswith("flags")), platform.processor())
    except OSError:
        return platform.processor()
