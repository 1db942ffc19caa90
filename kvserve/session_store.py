"""SessionStore: sessions' transcripts in SQLite, so that they survive a restart or a crash.

One row per session, one row per message. A completed turn is one transaction (its new user
messages and the assistant reply together), so a crash mid-turn loses at most that turn. WAL mode
keeps readers and the writer apart and survives a killed process without corruption.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY,
    owner TEXT,
    created REAL NOT NULL,
    ttl REAL
);
CREATE TABLE IF NOT EXISTS messages (
    session_id TEXT NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
    seq INTEGER NOT NULL,
    role TEXT NOT NULL,
    content TEXT NOT NULL,
    PRIMARY KEY (session_id, seq)
);
"""


class SessionStore:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._db.executescript(SCHEMA)

    def create(self, session_id: str, owner: str | None, ttl: float | None, messages: list[dict]) -> None:
        with self._lock, self._db:
            self._db.execute("BEGIN")
            self._db.execute(
                "INSERT INTO sessions (id, owner, created, ttl) VALUES (?, ?, ?, ?)",
                (session_id, owner, time.time(), ttl),
            )
            self._insert(session_id, 0, messages)

    def append_turn(self, session_id: str, first_seq: int, messages: list[dict]) -> None:
        """Store messages[first_seq:] of a completed turn, atomically."""
        with self._lock, self._db:
            self._db.execute("BEGIN")
            self._insert(session_id, first_seq, messages)

    def load(self, session_id: str) -> tuple[str | None, float | None, list[dict]] | None:
        with self._lock:
            row = self._db.execute("SELECT owner, ttl FROM sessions WHERE id = ?", (session_id,)).fetchone()
            if row is None:
                return None
            rows = self._db.execute(
                "SELECT role, content FROM messages WHERE session_id = ? ORDER BY seq", (session_id,)
            ).fetchall()
        return row[0], row[1], [{"role": r, "content": c} for r, c in rows]

    def delete(self, session_id: str) -> None:
        with self._lock, self._db:
            self._db.execute("DELETE FROM sessions WHERE id = ?", (session_id,))

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _insert(self, session_id: str, first_seq: int, messages: list[dict]) -> None:
        self._db.executemany(
            "INSERT OR REPLACE INTO messages (session_id, seq, role, content) VALUES (?, ?, ?, ?)",
            [(session_id, first_seq + i, m["role"], m["content"]) for i, m in enumerate(messages)],
        )
