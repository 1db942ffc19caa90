"""/health (503 with the reason whenever the server cannot serve) and /metrics (Prometheus)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvserve.server.state import server_state

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    state = server_state(request)
    if state.llm is None:
        status = "error" if state.load_error else "loading"
        return JSONResponse({"status": status, "detail": state.load_error}, status_code=503)
    problem = await asyncio.to_thread(state.llm.problem)  # a failed store is probed with a write
    if problem is not None:
        return JSONResponse({"status": "error", "detail": problem, "model": state.model_name}, status_code=503)
    return JSONResponse({"status": "ok", "model": state.model_name})


# HEAD: load balancers' and uptime checks' probe. Its own route, kept out of the schema: one route of two
# methods gave both operations one id (FastAPI warned of the duplicate in /openapi.json).
router.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    body = server_state(request).metrics.render()
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")
