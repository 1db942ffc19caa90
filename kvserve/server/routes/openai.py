"""The OpenAI routes: /v1/models, /v1/completions, /v1/chat/completions, and aborting a request."""

from __future__ import annotations

import dataclasses

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from kvserve.errors import InvalidRequestError
from kvserve.llm import LLM
from kvserve.server.execution import Job, handle, llm_stream, with_seed
from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest
from kvserve.server.state import APIError, authorize, check_model, server_state
from kvserve.text import tool_calls

router = APIRouter(prefix="/v1")


@router.get("/models", dependencies=[Depends(authorize)])
async def models(request: Request) -> dict:
    state = server_state(request)
    state.ready_llm()
    return {"object": "list", "data": [_model_object(state.model_name, state.model_created)]}


@router.get("/models/{model:path}", dependencies=[Depends(authorize)])
async def model(model: str, request: Request) -> dict:
    """One model (`client.models.retrieve`): this server's, else 404 model_not_found."""
    state = server_state(request)
    state.ready_llm()
    check_model(state, model)
    return _model_object(model, state.model_created)


def _model_object(name: str, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "kvserve"}


@router.delete("/requests/{request_id}")
async def abort(request_id: str, request: Request, owner: str | None = Depends(authorize)) -> dict:
    state = server_state(request)
    running = state.requests.get((owner, request_id))
    if (  # an engine request's id (`<response id>-<choice>`), still running: that choice alone
        running is None
        and state.requests.owner_of(request_id) == owner
        and any(request_id in live.engine_ids for live in state.requests.values())
    ):
        state.ready_llm().abort([request_id])
        return {"id": request_id, "object": "request.abort", "aborted": True}
    if running is None:  # also another key's request: it is not this caller's to see
        raise APIError(404, f"No running request with id {request_id!r}.", "not_found_error", "request_id")
    state.ready_llm().abort(running.engine_ids)
    for alias in running.aliases:  # aborted once: a second DELETE finds nothing running
        if state.requests.get(alias) is running:
            del state.requests[alias]
    return {"id": request_id, "object": "request.abort", "aborted": True}


@router.post("/completions")
async def completions(request: Request, owner: str | None = Depends(authorize)) -> Response:
    return await handle(request, owner, CompletionRequest, _completion_jobs, "cmpl", "text_completion", chat=False)


@router.post("/chat/completions")
async def chat_completions(request: Request, owner: str | None = Depends(authorize)) -> Response:
    return await handle(request, owner, ChatCompletionRequest, _chat_jobs, "chatcmpl", "chat.completion", chat=True)


def _completion_jobs(llm: LLM, body: CompletionRequest, defaults: dict[str, float]) -> list[Job]:
    if body.echo and body.logprobs is not None:
        raise InvalidRequestError("echo with logprobs is not supported (no prompt logprobs).", "echo")
    params = body.sampling_params(body.max_tokens, body.logprobs, 16, defaults)
    jobs = []
    for p_index, prompt in enumerate(body.prompts()):
        echo = None
        if body.echo:
            echo = prompt if isinstance(prompt, str) else llm.tokenizer.decode(llm.encode_prompt(prompt))
        prompt_ids = llm.encode_prompt(prompt)  # here, off the event loop (the engine request checks them again)
        for i in range(body.n):
            jobs.append(Job(p_index, llm_stream(llm, prompt_ids, with_seed(params, body.seed, i)), echo))
    return jobs


def _chat_jobs(llm: LLM, body: ChatCompletionRequest, defaults: dict[str, float]) -> list[Job]:
    """Tools go through the chat template (text/tool_calls.py); a required or named call is
    constrained by the functions' grammar, and the answer is parsed back into tool_calls."""
    tokenizer = llm.tokenizer
    choice = body.tool_choice_spec()
    fmt = tool_calls.detect_format(tokenizer)
    messages, variables = tool_calls.render_inputs(body.conversation(), choice, fmt, tokenizer)
    prompt_ids = tokenizer.encode_chat(messages, **variables)
    limit = llm.config.max_model_len
    if len(prompt_ids) >= limit:  # named as sent: the engine would say "prompt"
        raise InvalidRequestError(
            f"The messages make a prompt of {len(prompt_ids)} tokens{' with the tools' if body.tools else ''}; "
            f"the context is {limit}. Send fewer or shorter messages.",
            "messages",
        )
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    default_max = max(1, llm.config.max_model_len - len(prompt_ids))  # as OpenAI: up to the context
    params = body.sampling_params(max_tokens, body.chat_logprobs(), default_max, defaults)
    calls = choice is not None and choice.choice != "none"
    if calls:
        grammar = tool_calls.grammar(choice, fmt, tokenizer)
        keep_special = tool_calls.needs_special_tokens(fmt, tokenizer)
        params = dataclasses.replace(
            params, structured_output=grammar or params.structured_output, skip_special_tokens=not keep_special
        )
    return [
        Job(0, llm_stream(llm, prompt_ids, with_seed(params, body.seed, i)), tool_format=fmt if calls else None)
        for i in range(body.n)
    ]
