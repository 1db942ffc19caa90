"""The HTTP server: OpenAI-compatible routes over one LLM. Routes translate; the engine decides.

`create_app` wires the routers (routes/: openai, sessions, health), the error handlers (errors.py)
and the LLM's loading. Errors always carry the OpenAI body: a client's mistake is a 4xx, never a
500, and never harms another request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI

from kvserve.llm import LLM
from kvserve.server.errors import BodyLimitMiddleware, install_error_handlers
from kvserve.server.metrics import ServerMetrics
from kvserve.server.routes import health, openai, sessions
from kvserve.server.state import ServerSettings, ServerState

__all__ = ["ServerSettings", "create_app"]


def create_app(settings: ServerSettings, llm: LLM | None = None) -> FastAPI:
    """Build the app. With `llm` given it serves that engine (and does not close it); otherwise it
    loads `settings.model` in the background after start-up, answering 503 until ready."""
    state = ServerState(settings)
    state.metrics = ServerMetrics(lambda: state.llm.stats() if state.llm is not None else None)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loader = None
        if llm is not None:
            state.set_llm(llm)
        else:
            loader = asyncio.create_task(_load(state))
        yield
        if loader is not None:
            loader.cancel()
            if state.llm is not None:
                await asyncio.to_thread(state.llm.close)

    app = FastAPI(title="kvserve", lifespan=lifespan)
    app.state.kvserve = state
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    for router in (health.router, openai.router, sessions.router):
        app.include_router(router)
    return app


async def _load(state: ServerState) -> None:
    """Load the LLM the settings name; a failure is reported by /health and every route."""
    settings = state.settings
    try:
        loaded = await asyncio.to_thread(
            LLM,
            settings.model,
            dtype=settings.dtype,
            weights=settings.weights,
            activations=settings.activations,
            batch_invariant=settings.batch_invariant,
            kv_cache_tokens=settings.kv_cache_tokens,
            kv_cache_dtype=settings.kv_cache_dtype,
            max_num_seqs=settings.max_num_seqs,
            max_sessions=settings.max_sessions,
            max_sessions_per_owner=settings.max_sessions_per_key,
            session_ttl=settings.session_ttl,
            session_db=settings.session_db,
        )
    except Exception as exc:
        state.load_error = f"{type(exc).__name__}: {exc}"
        return
    state.set_llm(loaded)
