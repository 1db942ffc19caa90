"""The HTTP server: OpenAI-compatible routes over one LLM. Routes translate; the engine decides.

`create_app` wires the routers (routes/: openai, sessions, health), the error handlers (errors.py),
the edge's checks (edge.py) and the LLM's loading. Errors always carry the OpenAI body: a client's
mistake is a 4xx, never a 500, and never harms another request. With API keys, the API's schema
(/openapi.json) needs one too, and the browser docs (/docs, /redoc), which cannot send it, are off.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi import Depends, FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse

from kvserve.llm import LLM
from kvserve.server.body_deadline import BodyDeadlineMiddleware
from kvserve.server.edge import CrossSiteMiddleware, HTTPVersionMiddleware, redact_access_log
from kvserve.server.engine_client import RemoteLLM
from kvserve.server.engine_process import build_llm
from kvserve.server.errors import BodyLimitMiddleware, BugMiddleware, install_error_handlers
from kvserve.server.metrics import ServerMetrics
from kvserve.server.routes import health, openai, page, sessions, status
from kvserve.server.state import ServerSettings, ServerState, require_key

__all__ = ["ServerSettings", "create_app"]


def create_app(settings: ServerSettings, llm: LLM | None = None) -> FastAPI:
    """Build the app. With `llm` given it serves that engine in this process (and does not close it);
    otherwise it starts the engine for `settings.model` in the background after start-up (in a
    process of its own unless `settings.engine_process` is off), answering 503 until ready."""
    state = ServerState(settings)
    state.metrics = ServerMetrics(lambda: state.llm.stats() if state.llm is not None else None)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        redact_access_log()  # here: uvicorn has configured its loggers by now
        state.loop = asyncio.get_running_loop()
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

    protected = bool(settings.api_keys)
    app = FastAPI(
        title="kvserve",
        lifespan=lifespan,
        openapi_url=None if protected else "/openapi.json",
        docs_url=None if protected else "/docs",
        redoc_url=None if protected else "/redoc",
    )
    if protected:

        @app.get("/openapi.json", include_in_schema=False, dependencies=[Depends(require_key)])
        async def openapi() -> JSONResponse:
            return JSONResponse(app.openapi())

    app.state.kvserve = state
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(BodyDeadlineMiddleware, timeout=settings.body_timeout)
    app.add_middleware(CrossSiteMiddleware, allowed_origins=settings.allowed_origins, bind_host=settings.host)
    app.add_middleware(HTTPVersionMiddleware)
    app.add_middleware(BugMiddleware)
    if settings.allowed_origins:  # outermost: every answer, an error or a refusal too, says who may read it
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.allowed_origins),
            allow_methods=["*"],
            allow_headers=["*"],  # Authorization, Content-Type, X-Request-Id
            expose_headers=["X-Request-Id", "Retry-After"],
        )
    for router in (health.router, openai.router, sessions.router, page.router):
        app.include_router(router)
    status.install(app, state)  # the status routes, and the ledger of requests they read
    return app


async def _load(state: ServerState) -> None:
    """Start the engine the settings describe, in its own process (engine_process.py) or in this
    one; a failure is reported by /health and every route."""
    settings = state.settings
    try:
        if settings.engine_process:
            loaded = await RemoteLLM.start(settings)
            loaded.on_death = lambda reason: state.on_fatal(reason) if state.on_fatal is not None else None
        else:
            loaded = await asyncio.to_thread(build_llm, settings)
            # its engine stops for good (a lost pipeline stage, the engine thread's bug): as a dead process
            loaded.engine.on_death = lambda reason: state.on_fatal(reason) if state.on_fatal is not None else None
            if loaded.engine.death is not None and state.on_fatal is not None:  # it died before being told
                state.on_fatal(loaded.engine.death)
            if state.on_loaded is not None:
                try:
                    await asyncio.to_thread(state.on_loaded)
                except BaseException:
                    loaded.close()  # not served: its engine thread ends with it
                    raise
    except Exception as exc:
        state.load_error = f"{type(exc).__name__}: {exc}"
        if state.on_fatal is not None:  # `kvserve serve`: nothing to serve, so exit for a supervisor to see
            state.on_fatal(f"The engine could not start ({state.load_error})")
        return
    state.set_llm(loaded)
