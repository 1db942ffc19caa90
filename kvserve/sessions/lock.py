"""One process owns a session store: an exclusive flock on `<store>.lock`, held while the process has
the store open. A second server on the same store would split sessions' histories between two
processes (each its own copy in memory, each writing); it is refused at start, naming the holder.

The lock belongs to the process, not to a SessionStore: two stores of one process on the same file
(two LLMs in one script) share it, counted, and the last to close releases it. Within the process a
session is then live in one of them at a time (`claim`): the other refuses it until it is closed
there. The kernel releases the lock when the process dies, even by SIGKILL, so a crash never leaves a
stale lock; the file's text (the holder's pid and host) only names who holds it now.
"""

from __future__ import annotations

import fcntl
import os
import socket
import threading
import weakref
from pathlib import Path

_held: dict[Path, list] = {}  # lock file -> [file descriptor, stores holding it]
_claims: dict[Path, dict[str, weakref.ref]] = {}  # lock file -> session id -> the store it is live in
_guard = threading.Lock()


class StoreInUseError(Exception):
    """Another process holds the store's lock; str() names it."""


def acquire(store: Path) -> Path:
    """Take (or share, within this process) the lock of `store`; returns the lock file to `release`.
    Raises StoreInUseError naming the holder, OSError where the lock file cannot be made."""
    path = store.with_name(store.name + ".lock").resolve()
    with _guard:
        if path in _held:
            _held[path][1] += 1
            return path
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "a process that has not said which"
            os.close(fd)
            raise StoreInUseError(holder) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        _held[path] = [fd, 1]
        return path


def release(path: Path) -> None:
    with _guard:
        entry = _held.get(path)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del _held[path]
            os.close(entry[0])  # drops the flock


def claim(path: Path, session_id: str, holder: object) -> bool:
    """Make `session_id` live in `holder` (a store of this process on the lock file `path`); False
    while it is live in another one."""
    with _guard:
        claims = _claims.setdefault(path, {})
        current = claims.get(session_id)
        if current is not None and current() not in (None, holder):
            return False
        claims[session_id] = weakref.ref(holder)
        return True


def unclaim(path: Path, session_ids: list[str], holder: object) -> None:
    with _guard:
        claims = _claims.get(path, {})
        for session_id in session_ids:
            current = claims.get(session_id)
            if current is not None and current() in (None, holder):
                del claims[session_id]
