"""What status readers see of sessions: their pins for the engine's block map, and an owner's list of
sessions (live and stored, so that the list survives a restart). Both run on the engine thread."""

from __future__ import annotations

from typing import Any

from kvserve.engine.monitor import SessionHolder
from kvserve.sessions.manager import SessionManager
from kvserve.sessions.store import SessionStore


def session_holders(manager: SessionManager | None) -> list[SessionHolder]:
    """Every live session's pinned blocks, owner, and the turn or eager prefill it runs now."""
    if manager is None:
        return []
    return [
        SessionHolder(
            s.session_id,
            s.owner,
            s.pinned_block_ids,
            s.is_generating,
            tuple(i for i in (s.turn_request_id, s.prefill_request_id) if i is not None),
        )
        for s in manager.sessions.values()
    ]


def owner_sessions(
    manager: SessionManager | None, store: SessionStore | None, owner: str | None, limit: int = 200
) -> list[dict[str, Any]]:
    """`owner`'s sessions, newest first: those in the store (also from before a restart, reopened when
    used) and those live in memory only. Each: id, created (Unix time, None if unknown), title (the
    start of its first user message), num_messages, is_live, kv_blocks, state."""
    if manager is None:
        return []
    manager.drop_expired_stored()  # listed, a session past its TTL would answer 404 when opened
    listed: dict[str, dict[str, Any]] = {}
    for session_id, created, title, num_messages in store.list_sessions(owner, limit) if store is not None else []:
        listed[session_id] = {
            "id": session_id,
            "created": created,
            "title": title,
            "num_messages": num_messages,
            "is_live": False,
            "kv_blocks": 0,
            "state": "stored",
        }
    for state in manager.sessions.values():
        if state.owner != owner:
            continue
        entry = listed.setdefault(state.session_id, {"id": state.session_id, "created": None})
        first_user = next((m["content"] for m in state.messages if m["role"] == "user"), state.open_user)
        entry.update(
            title=first_user[:80] if first_user is not None else None,
            num_messages=len(state.messages) + (state.open_user is not None),
            is_live=True,
            kv_blocks=len(state.pinned_block_ids),
            state="generating" if state.is_generating else "idle",
        )
    return list(listed.values())[:limit]
