"""SessionStore: sessions' transcripts in SQLite, so that they survive a restart or a crash.

One row per session, one row per message (the last may be the user message still being streamed
in, `is_open`). Every write is one transaction, committed with a sync (synchronous=FULL) before the
caller answers, so what was acknowledged survives a crash of the process or of the machine; WAL
mode keeps readers and the writer apart. One process owns a store (lock.py).

The file carries its schema version (table `kvserve_schema`); opening checks it and migrates an
older kvserve store, and refuses any other database, and one whose pages are damaged, with
SessionStoreError. Every SQLite or disk failure surfaces as SessionStoreError; `error` keeps the
last one until a write succeeds again, `broken` what no write can mend (the file was removed or
replaced while open, or a page is corrupt), until a restart. A write that fails for a full disk (or a
failed write) is tried once more after the write-ahead log is checkpointed and truncated, which gives its space
back: so a DELETE, which needs little, still frees space where SQLite can.

Beside the file lives the install's owner secret (`<file>.secret`, 32 random bytes, mode 0600,
created once): a session owned through an API key stores an HMAC of the key under it
(`key_owner`), so the file alone lets no one test guessed keys against its owners.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import resource
import secrets
import sqlite3
import threading
import time
from pathlib import Path

from kvserve.errors import KVServeError
from kvserve.sessions import lock

# 1: before the version table (owners stored as given); 2: owners are "sha256:" + the key's sha256;
# 3: owners are key_owner's HMAC of that hash under the owner secret; 4: messages.is_open; 5: sessions.used
SCHEMA_VERSION = 5
OWNER_SECRET_BYTES = 32
TABLES = """
CREATE TABLE sessions (
    id TEXT PRIMARY KEY,
    owner TEXT,
    created REAL NOT NULL,
    ttl REAL,
    used REAL
);
CREATE TABLE messages (
    session_id TEXT NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
    seq INTEGER NOT NULL,
    role TEXT NOT NULL,
    content TEXT NOT NULL,
    is_open INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (session_id, seq)
);
"""
COLUMNS = {
    "sessions": ["id", "owner", "created", "ttl", "used"],  # used: its last write (Unix time), for its TTL
    "messages": ["session_id", "seq", "role", "content", "is_open"],
}
COLUMNS_BEFORE_5 = {**COLUMNS, "sessions": COLUMNS["sessions"][:-1]}
COLUMNS_BEFORE_4 = {**COLUMNS_BEFORE_5, "messages": COLUMNS["messages"][:-1]}
PROBE_BYTES = 8192  # the health probe's row: more than a page, so that it needs space the disk must have
FILE_LIMIT_HEADROOM_PAGES = 4  # pages kept free below a file-size limit, for the log's frames to fit


class SessionStoreError(KVServeError):
    """The session store cannot be opened, read or written (a foreign file, a full or read-only disk)."""


def key_owner(api_key: str, secret: bytes) -> str:
    """What a session stores as the owner of an API key: an HMAC-SHA256, under the install's owner
    secret, of the key's sha256 (what schema 2 stored, so that its owners migrate), never the key."""
    return _keyed_owner(secret, hashlib.sha256(api_key.encode()).hexdigest())


def _keyed_owner(secret: bytes, key_sha256: str) -> str:
    return "hmac-sha256:" + hmac.new(secret, key_sha256.encode(), hashlib.sha256).hexdigest()


def owner_secret(path: Path) -> tuple[bytes, bool]:
    """(the secret in `path`, whether it was created now): read it, or write a new random one,
    readable by this user only, atomically (a file is linked into place with its content)."""
    try:
        try:
            secret = path.read_bytes()
        except FileNotFoundError:
            pass
        else:
            if len(secret) != OWNER_SECRET_BYTES:
                raise SessionStoreError(f"The owner secret {path} is damaged ({len(secret)} bytes); restore it.")
            return secret, False
        secret = secrets.token_bytes(OWNER_SECRET_BYTES)
        staged = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, secret)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(staged, path)
        except FileExistsError:  # another process created it first: use that one
            return owner_secret(path)[0], False
        finally:
            staged.unlink()
    except OSError as exc:
        raise SessionStoreError(f"Cannot read or create the owner secret {path}: {exc}.") from exc
    return secret, True


class SessionStore:
    def __init__(self, path: str | Path) -> None:
        # The file itself, not a link's name for it: the lock and the secret live beside it, so that a
        # second server given a symbolic link to a store in use is refused like one given its path.
        self.path = Path(path).resolve()
        self.secret_path = self.path.with_name(self.path.name + ".secret")
        self.error: str | None = None  # the last failure, until a write succeeds
        self.broken: str | None = None  # a failure no write mends (removed or corrupt), until a restart
        self._lock = threading.Lock()
        self._claimed: set[str] = set()  # the sessions live here (lock.claim)
        self.writing_since: float | None = None  # time.monotonic() when a write in progress began
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._owner_lock = lock.acquire(self.path)
        except lock.StoreInUseError as exc:
            raise SessionStoreError(
                f"The session store {self.path} is in use by another process ({exc}); one process owns a store. "
                "Stop that one, or give this one another --session-db (KVSERVE_SESSION_DB)."
            ) from None
        except OSError as exc:
            raise SessionStoreError(f"Cannot open the session store {self.path}: {exc}.") from exc
        try:
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        except (OSError, sqlite3.Error) as exc:
            lock.release(self._owner_lock)
            raise SessionStoreError(f"Cannot open the session store {self.path}: {exc}.") from exc
        try:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")  # a commit is on the disk before it is acknowledged
            self._db.execute("PRAGMA foreign_keys=ON")
            self._file = self._identity(self.path)
            self._bound_by_file_limit()
            self._check_pages()
            self._open_schema()
            # the write-ahead log, where a commit lies until it is copied into the file: it lives as long as
            # this connection (SQLite empties it, never deletes it, while the store is open)
            self._wal_path = self.path.with_name(self.path.name + "-wal")
            self._wal = self._identity(self._wal_path)
        except SessionStoreError:
            self._db.close()
            lock.release(self._owner_lock)
            raise
        except sqlite3.Error as exc:
            self._db.close()
            lock.release(self._owner_lock)
            raise SessionStoreError(
                f"{self.path} is not a usable kvserve session store ({exc}); point --session-db "
                "(KVSERVE_SESSION_DB) at another file or move this one away."
            ) from exc

    def _open_schema(self) -> None:
        """Create the schema in an empty file, migrate an older kvserve store, refuse anything else
        (also a store whose owners are keyed with a secret that is gone). Reads or creates the owner
        secret of a kvserve store."""
        tables = {row[0] for row in self._db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if not tables:
            self.owner_secret, _ = owner_secret(self.secret_path)
            with self._db:
                self._db.execute("BEGIN")
                for statement in TABLES.split(";"):
                    if statement.strip():
                        self._db.execute(statement)
                self._db.execute("CREATE TABLE kvserve_schema (version INTEGER NOT NULL)")
                self._db.execute("INSERT INTO kvserve_schema VALUES (?)", (SCHEMA_VERSION,))
            return
        version = 1
        if "kvserve_schema" in tables and [c[1] for c in self._db.execute("PRAGMA table_info(kvserve_schema)")] == [
            "version"
        ]:
            row = self._db.execute("SELECT version FROM kvserve_schema").fetchone()
            version = row[0] if row else 1
        if version > SCHEMA_VERSION:
            raise SessionStoreError(
                f"{self.path} was written by a newer kvserve (schema {version}, this one reads up to "
                f"{SCHEMA_VERSION}); upgrade kvserve or use another --session-db."
            )
        layout = {name: [c[1] for c in self._db.execute(f"PRAGMA table_info({name})")] for name in COLUMNS}
        expected = COLUMNS if version >= 5 else COLUMNS_BEFORE_5 if version == 4 else COLUMNS_BEFORE_4
        if layout != expected or not tables <= {*COLUMNS, "kvserve_schema"}:
            raise SessionStoreError(
                f"{self.path} is an SQLite database but not a kvserve session store (tables: "
                f"{', '.join(sorted(tables))}); point --session-db (KVSERVE_SESSION_DB) at another file or move "
                "this one away."
            )
        self.owner_secret, secret_created = owner_secret(self.secret_path)
        # From version 3 owners are keyed with the secret (1 and 2 are re-keyed by the migration below).
        keyed = version >= 3 and self._db.execute("SELECT 1 FROM sessions WHERE owner LIKE 'hmac-sha256:%'").fetchone()
        if secret_created and keyed:
            self.secret_path.unlink()  # a new secret would orphan every key's sessions: keep none
            raise SessionStoreError(
                f"{self.path} holds sessions owned through API keys, but the owner secret beside it "
                f"({self.secret_path}) is missing; restore it, or move the store away to start afresh."
            )
        if version < SCHEMA_VERSION:
            self._migrate(version)

    def _migrate(self, version: int) -> None:
        """Version 1 stored the API key itself as a session's owner, version 2 its sha256; version 3
        stores key_owner's HMAC of that hash. Owners a Python caller gave (not hashes) stay as they are.
        Version 4 marks a streamed user message that is still open (none in an older store); version 5
        keeps when each session was last written (an older store's count from the migration)."""
        with self._db:
            self._db.execute("BEGIN")
            owners = self._db.execute("SELECT id, owner FROM sessions WHERE owner IS NOT NULL").fetchall()
            if version == 1:
                rehashed = [(key_owner(o, self.owner_secret), i) for i, o in owners]
            elif version == 2:
                rehashed = [
                    (_keyed_owner(self.owner_secret, o.removeprefix("sha256:")), i)
                    for i, o in owners
                    if o.startswith("sha256:")
                ]
            else:
                rehashed = []
            self._db.executemany("UPDATE sessions SET owner = ? WHERE id = ?", rehashed)
            if version < 4:
                self._db.execute("ALTER TABLE messages ADD COLUMN is_open INTEGER NOT NULL DEFAULT 0")
            self._db.execute("ALTER TABLE sessions ADD COLUMN used REAL")
            self._db.execute("UPDATE sessions SET used = ?", (time.time(),))
            self._db.execute("CREATE TABLE IF NOT EXISTS kvserve_schema (version INTEGER NOT NULL)")
            self._db.execute("DELETE FROM kvserve_schema")
            self._db.execute("INSERT INTO kvserve_schema VALUES (?)", (SCHEMA_VERSION,))

    # ----- operations (each raises SessionStoreError on failure) --------------------------
    def create(
        self, session_id: str, owner: str | None, ttl: float | None, messages: list[dict], open_user: str | None = None
    ) -> None:
        """A new session with its first messages (and the user message streaming in, if any), atomically."""
        rows = [(m["role"], m["content"], False) for m in messages]
        if open_user is not None:
            rows.append(("user", open_user, True))

        def write() -> None:
            now = time.time()
            self._db.execute(
                "INSERT INTO sessions (id, owner, created, ttl, used) VALUES (?, ?, ?, ?, ?)",
                (session_id, owner, now, ttl, now),
            )
            self._insert(session_id, 0, rows)

        self._write("create the session", write)

    def write_tail(self, session_id: str, first_seq: int, rows: list[tuple[str, str, bool]]) -> None:
        """Make the session's messages from `first_seq` on be `rows` ((role, content, is_open) each),
        atomically: what comes after a change is written again, what is gone is deleted."""

        def write() -> None:
            self._db.execute("DELETE FROM messages WHERE session_id = ? AND seq >= ?", (session_id, first_seq))
            self._insert(session_id, first_seq, rows)
            self._db.execute("UPDATE sessions SET used = ? WHERE id = ?", (time.time(), session_id))

        self._write("store the session's messages", write)

    def load(self, session_id: str) -> tuple[str | None, float | None, list[tuple[str, str, bool]]] | None:
        """(owner, ttl, message rows (role, content, is_open)) of a stored session, None if there is none."""
        self._check_file()
        try:
            with self._lock:
                row = self._db.execute("SELECT owner, ttl FROM sessions WHERE id = ?", (session_id,)).fetchone()
                if row is None:
                    return None
                rows = self._db.execute(
                    "SELECT role, content, is_open FROM messages WHERE session_id = ? ORDER BY seq", (session_id,)
                ).fetchall()
        except sqlite3.Error as exc:
            raise self._failed("read the session", exc) from exc
        return row[0], row[1], [(r, c, bool(o)) for r, c, o in rows]

    def list_sessions(self, owner: str | None, limit: int = 200) -> list[tuple[str, float, str | None, int]]:
        """The stored sessions of `owner`, newest first, at most `limit`: (id, created (Unix time), the
        start of its first user message or None, its number of messages) each."""
        try:
            with self._lock:
                return self._db.execute(
                    "SELECT s.id, s.created, (SELECT substr(m.content, 1, 80) FROM messages m WHERE m.session_id = "
                    "s.id AND m.role = 'user' ORDER BY m.seq LIMIT 1), (SELECT COUNT(*) FROM messages m WHERE "
                    "m.session_id = s.id) FROM sessions s WHERE s.owner IS ? ORDER BY s.created DESC LIMIT ?",
                    (owner, limit),
                ).fetchall()
        except sqlite3.Error as exc:
            raise self._failed("list the sessions", exc) from exc

    def count(self, owner: str | None = None, everyone: bool = False) -> int:
        """How many sessions are stored: `owner`'s, or with `everyone` all of them (the limits count
        these, so that they hold across restarts)."""
        where, args = ("", ()) if everyone else (" WHERE owner IS ?", (owner,))
        try:
            with self._lock:
                return self._db.execute(f"SELECT COUNT(*) FROM sessions{where}", args).fetchone()[0]
        except sqlite3.Error as exc:
            raise self._failed("count the sessions", exc) from exc

    def expired(self, now: float, session_id: str | None = None) -> list[str]:
        """The sessions (or this one) idle past their TTL at Unix time `now`, by their last write."""
        query = "SELECT id FROM sessions WHERE ttl IS NOT NULL AND COALESCE(used, created) + ttl < ?"
        args: tuple = (now,)
        if session_id is not None:
            query, args = query + " AND id = ?", (now, session_id)
        try:
            with self._lock:
                return [row[0] for row in self._db.execute(query, args)]
        except sqlite3.Error as exc:
            raise self._failed("find expired sessions", exc) from exc

    def delete(self, session_id: str) -> None:
        self.delete_many([session_id])

    def delete_many(self, session_ids: list[str]) -> None:
        """Delete these sessions in one transaction (one sync of the disk, however many)."""
        delete = lambda: self._db.executemany("DELETE FROM sessions WHERE id = ?", [(i,) for i in session_ids])  # noqa: E731
        self._write("delete the session", delete, adds=False)

    def probe(self) -> str | None:
        """Why the store cannot take writes now, or None: what broke it for good, else (after a failed
        write) the failure a real write still meets: a row of PROBE_BYTES, so that a full disk shows."""
        with contextlib.suppress(SessionStoreError):  # each sets `broken` or `error`
            self._check_file()
        if self.broken is None and self.error is not None:
            probe = f"kvserve-probe-{'x' * PROBE_BYTES}"
            with contextlib.suppress(SessionStoreError):
                self._write(
                    "write",
                    lambda: self._db.execute("INSERT INTO sessions (id, created) VALUES (?, 0)", (probe,)),
                )
                self._write("write", lambda: self._db.execute("DELETE FROM sessions WHERE id = ?", (probe,)))
        return self.broken or self.error

    def claim(self, session_id: str) -> bool:
        """Make the session live here; False while another store of this process (another LLM on the
        same file) holds it live."""
        if not lock.claim(self._owner_lock, session_id, self):
            return False
        self._claimed.add(session_id)
        return True

    def unclaim(self, session_id: str) -> None:
        self._claimed.discard(session_id)
        lock.unclaim(self._owner_lock, [session_id], self)

    def close(self) -> None:
        with self._lock:
            self._db.close()
        lock.unclaim(self._owner_lock, list(self._claimed), self)
        self._claimed.clear()
        lock.release(self._owner_lock)

    # ----- internals ----------------------------------------------------------------------
    def _write(self, what: str, write, adds: bool = True) -> None:
        """One transaction, synced to the disk before this returns; a failure rolls it back and is kept
        in `error` (or `broken`), which only a write that `adds` data clears (a delete may succeed on a
        full disk). A full disk gets one more try after the WAL gives its space back. The file is
        checked before and after: a commit into a removed file would be acknowledged and lost."""
        self._check_file()
        self.writing_since = time.monotonic()
        try:
            try:
                self._transaction(write)
            except sqlite3.OperationalError as exc:
                if getattr(exc, "sqlite_errorcode", 0) & 0xFF not in (sqlite3.SQLITE_FULL, sqlite3.SQLITE_IOERR):
                    raise
                with self._lock:
                    self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                self._transaction(write)
        except (sqlite3.Error, OSError) as exc:
            raise self._failed(what, exc) from exc
        finally:
            self.writing_since = None
        self._check_file()
        if adds:
            self.error = None

    def _transaction(self, write) -> None:
        with self._lock, self._db:
            self._db.execute("BEGIN IMMEDIATE")
            write()

    def _bound_by_file_limit(self) -> None:
        """Under a file-size limit (RLIMIT_FSIZE), keep the database FILE_LIMIT_HEADROOM_PAGES below it:
        a write then fails as full (SQLITE_FULL) before the log holds pages the database file could
        never take, so a checkpoint still empties the log and a DELETE still fits."""
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY:
            page_size = self._db.execute("PRAGMA page_size").fetchone()[0]
            self._db.execute(f"PRAGMA max_page_count = {max(8, limit // page_size - FILE_LIMIT_HEADROOM_PAGES)}")

    @staticmethod
    def _identity(path: Path) -> tuple[int, int] | None:
        try:
            info = os.stat(path)
        except FileNotFoundError:
            return None
        return info.st_dev, info.st_ino

    def _check_file(self) -> None:
        """SessionStoreError (for good) once the file this store opened, or its write-ahead log, was
        removed or replaced: SQLite would go on writing into the unlinked file, and every write would be
        lost (a removed log takes with it the commits not yet copied into the file)."""
        if self.broken is None:
            for path, opened in ((self.path, self._file), (self._wal_path, self._wal)):
                now = self._identity(path)
                if now != opened and opened is not None:
                    what = "removed" if now is None else "replaced by another file"
                    self.broken = (
                        f"the session store's {path} was {what} while the server ran; nothing can be stored, and "
                        "what was stored since the last checkpoint may be lost. Restart the server (it starts a new "
                        "store there, or opens the one put back)"
                    )
                    break
        if self.broken is not None:
            raise SessionStoreError(f"The session store cannot be used: {self.broken}.")

    def _check_pages(self) -> None:
        """Refuse a store with a damaged page at start (on a connection of its own, whose page cache is
        dropped: the store's own reads the file afresh)."""
        check = sqlite3.connect(self.path)
        try:
            problems = [row[0] for row in check.execute("PRAGMA quick_check(5)")]
        except sqlite3.DatabaseError as exc:
            if getattr(exc, "sqlite_errorcode", 0) & 0xFF != sqlite3.SQLITE_CORRUPT:
                raise
            problems = [str(exc)]
        finally:
            check.close()
        if problems != ["ok"]:
            raise SessionStoreError(
                f"{self.path} is damaged ({'; '.join(problems)}); restore it from a backup, or move it away to start "
                "afresh (sessions in it are lost)."
            )

    def _failed(self, what: str, exc: Exception) -> SessionStoreError:
        reason = f"the session store {self.path} failed to {what}: {exc}"
        code = getattr(exc, "sqlite_errorcode", 0) & 0xFF  # the primary code of an extended one
        if code in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB):  # no later write mends a damaged page
            self.broken = f"{reason}; restore the file from a backup or move it away, then restart the server"
        else:
            self.error = reason
        return SessionStoreError(f"The session store could not {what} ({exc}); the server's disk needs attention.")

    def _insert(self, session_id: str, first_seq: int, rows: list[tuple[str, str, bool]]) -> None:
        self._db.executemany(
            "INSERT INTO messages (session_id, seq, role, content, is_open) VALUES (?, ?, ?, ?, ?)",
            [
                (session_id, first_seq + i, role, content, int(is_open))
                for i, (role, content, is_open) in enumerate(rows)
            ],
        )
