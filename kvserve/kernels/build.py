"""Building and loading the C++ extension (kvserve/kernels/csrc), once per process.

The extension is compiled on first use with the machine's C++ compiler and -march=native (about a
minute, once per machine; cached under $TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions,
in a folder named by a hash of every source file, the CPU's flags and torch's version). Without
a compiler, or with KVSERVE_FUSED_DECODE=0, nothing here is loaded and every caller takes its
PyTorch path.

The cache is shared by every copy of kvserve on the machine whose sources are the same (two
checkouts, a checkout and an installed copy): a start that finds the folder's built library loads
it as it is and never runs the compiler. torch's build file records absolute paths (of the sources
and of torch's headers), so building from each copy's own path would rebuild for every other copy;
a build therefore compiles a copy of the sources kept inside the content-named folder.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import platform
import shutil
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


def sources(source_dir: Path | None = None) -> list[Path]:
    """The files compiled together (the .cpp files) and those they include (headers)."""
    return sorted(p for p in (source_dir or SOURCE_DIR).iterdir() if p.suffix in (".cpp", ".h"))


def build_name(source_dir: Path | None = None) -> str:
    """The cache folder's name: changes with any source file, the CPU (-march=native) or torch."""
    digest = hashlib.sha256()
    for path in sources(source_dir):
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


def _build_or_load(name: str, source_dir: Path | None = None) -> Any:
    """The library built for `name` (the hash of the sources in `source_dir`), loaded as it is when
    the cache holds it; else built with torch's `load` from a copy of the sources inside the cache
    folder, so that the build's recorded paths are the same for every copy of kvserve.

    Serialized across processes by an flock that dies with its holder. torch's own lock is a plain
    file: a build killed midway leaves it behind and every later build waits on it forever. Holding
    the flock, no live process is building, so any such file is stale: it is removed first, and so
    is a library it may have left half-written."""
    import fcntl

    from torch.utils.cpp_extension import _get_build_directory
    from torch.utils.cpp_extension import load as torch_load

    build_dir = Path(_get_build_directory(name, verbose=False))
    build_dir.mkdir(parents=True, exist_ok=True)
    library = build_dir / f"{name}.so"
    with open(build_dir / "kvserve.flock", "w") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)
        if (build_dir / "lock").exists():
            (build_dir / "lock").unlink()
            library.unlink(missing_ok=True)
        if library.exists():
            try:
                return _import_library(name, library)
            except ImportError as exc:  # damaged: build it again
                logger.warning("The cached C++ kernels at %s do not load (%s); building them again.", library, exc)
                library.unlink()
        # said at warning level: the first start pauses here
        logger.warning("Compiling kvserve's C++ kernels for this CPU (once per machine, about a minute)...")
        staged = _stage_sources(source_dir or SOURCE_DIR, build_dir / "src")
        return torch_load(
            name=name,
            sources=[str(p) for p in sources(staged) if p.suffix == ".cpp"],
            extra_include_paths=[str(staged)],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            verbose=False,
        )


def _stage_sources(source_dir: Path, staged: Path) -> Path:
    """Copy the sources into `staged` (inside the content-named cache folder: the same path for
    every copy of these sources) and return it."""
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir(parents=True)
    for path in sources(source_dir):
        shutil.copyfile(path, staged / path.name)
    return staged


def _import_library(name: str, library: Path) -> Any:
    """Import a built extension module from its file, as torch's `load` does once it has built it."""
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"not a Python extension module: {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cpu_identity() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
        return next((line for line in info.splitlines() if line.startswith("flags")), platform.processor())
    except OSError:
        return platform.processor()
