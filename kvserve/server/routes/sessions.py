"""The session routes: create, read, add messages, stream input, fork, delete, and a turn as a chat
completion. A session belongs to the API key that created it; other keys get 404."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from kvserve.errors import InvalidRequestError
from kvserve.llm import LLM
from kvserve.server.execution import Job, handle
from kvserve.server.protocol import (
    SessionAppendRequest,
    SessionCompletionRequest,
    SessionCreateRequest,
    SessionForkRequest,
    SessionMessageRequest,
)
from kvserve.server.state import authorize, check_model, read_json, server_state
from kvserve.sessions.session import Session

router = APIRouter(prefix="/v1/sessions")


async def _session(request: Request, session_id: str, owner: str | None) -> Session:
    return await asyncio.to_thread(server_state(request).ready_llm().session, id=session_id, owner=owner)


def _session_object(info: dict) -> dict:
    return {"object": "session", **info}


@router.post("")
async def create_session(request: Request, owner: str | None = Depends(authorize)) -> dict:
    state = server_state(request)
    llm = state.ready_llm()
    body = SessionCreateRequest.model_validate(await read_json(request))
    check_model(state, body.model)
    session = await asyncio.to_thread(llm.session, body.system, body.conversation(), ttl=body.ttl, owner=owner)
    return _session_object(await asyncio.to_thread(session.info))


@router.get("/{session_id}")
async def get_session(session_id: str, request: Request, owner: str | None = Depends(authorize)) -> dict:
    session = await _session(request, session_id, owner)
    return _session_object(await asyncio.to_thread(session.info))


@router.post("/{session_id}/messages")
async def add_session_message(session_id: str, request: Request, owner: str | None = Depends(authorize)) -> dict:
    body = SessionMessageRequest.model_validate(await read_json(request))
    session = await _session(request, session_id, owner)
    await asyncio.to_thread(session.add_message, body.role, body.content)
    return {"id": session_id, "object": "session.message", "queued": True}


@router.post("/{session_id}/append")
async def append_to_session(session_id: str, request: Request, owner: str | None = Depends(authorize)) -> dict:
    body = SessionAppendRequest.model_validate(await read_json(request))
    session = await _session(request, session_id, owner)
    await asyncio.to_thread(session.append, body.text)
    return {"id": session_id, "object": "session.append", "queued": True}


@router.post("/{session_id}/fork")
async def fork_session(session_id: str, request: Request, owner: str | None = Depends(authorize)) -> dict:
    if (await request.body()).strip():  # no body, or one whose fields are known (a field it ignored misled)
        check_model(server_state(request), SessionForkRequest.model_validate(await read_json(request)).model)
    session = await _session(request, session_id, owner)
    child = await asyncio.to_thread(session.fork)
    return _session_object(await asyncio.to_thread(child.info))


@router.delete("/{session_id}")
async def delete_session(session_id: str, request: Request, owner: str | None = Depends(authorize)) -> dict:
    session = await _session(request, session_id, owner)
    await asyncio.to_thread(session.close)
    return {"id": session_id, "object": "session.deleted", "deleted": True}


@router.post("/{session_id}/completions")
async def session_completion(session_id: str, request: Request, owner: str | None = Depends(authorize)) -> Response:
    session = await _session(request, session_id, owner)

    def jobs(llm: LLM, body: SessionCompletionRequest, defaults: dict[str, float]) -> list[Job]:
        if body.n != 1:
            raise InvalidRequestError("A session turn has one choice; n must be 1.", "n")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = body.sampling_params(max_tokens, body.chat_logprobs(), 512, defaults)
        llm.request_builder.check_params(params)  # a turn's request is built on the engine's side

        def stream(rid: str):  # announces its start: a refusal is a status, before the first byte
            return session.astream(params, interrupt=body.interrupt, request_id=rid, announce=True)

        return [Job(0, stream, announces=True)]

    return await handle(request, owner, SessionCompletionRequest, jobs, "chatcmpl", "chat.completion", chat=True)
