"""LLM: the Python API over EngineCore. Every method may be called from any number of threads.

Each call builds a Request, hands it to the engine thread through its inbox, and reads the
request's own sink. Leaving a stream early (break, exception, garbage collection, task
cancellation) aborts its request through the engine's one abort path.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import queue
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from kvserve.engine.block_pool import BlockPool
from kvserve.engine.config import EngineConfig
from kvserve.engine.core import EngineCore
from kvserve.engine.kv_cache import kv_cache_bytes_per_token
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.request import Request
from kvserve.engine.scheduler import Scheduler
from kvserve.errors import InvalidRequestError, KVServeError, check_text
from kvserve.outputs import RequestOutput, StreamChunk
from kvserve.sampling_params import SamplingParams
from kvserve.sessions.manager import SessionManager
from kvserve.sessions.session import Session
from kvserve.sessions.store import SessionStore
from kvserve.text.tokenizer import Tokenizer
from kvserve.weights.loader import load_config, load_model, weight_summary
from kvserve.weights.plan import resolve_activations, resolve_weights
from kvserve.weights.registry import kvserve_home, resolve_model

logger = logging.getLogger("kvserve.weights")
Prompt = str | Sequence[int]
Messages = list[dict[str, Any]]
DEFAULT_KV_CACHE_BYTES = 1 << 30
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "auto": None}
# The KV pool's element type; auto: the compute dtype. float16 halves the pool's bytes per token (twice
# the tokens in the same memory) and what decode attention reads, as llama.cpp's default f16 cache and
# vLLM's --kv-cache-dtype do; keys and values are rounded to it when written, and attention computes in
# float32 either way.
KV_CACHE_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class _AsyncSink:
    """Delivers engine-thread items into an asyncio queue on its own loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item: Any) -> None:
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class _ThreadSink(queue.SimpleQueue):
    pass


def default_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 where the hardware computes it natively, else float32.

    Measured on the bundled model on a 2-core AVX-512-BF16 CPU (bench/throughput.py): bfloat16
    prefills about 2.2x and decodes about 1.9x faster than float32. Without native bf16 kernels,
    bfloat16 is emulated and slower, so float32 is the default there.
    """
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    mkldnn_bf16 = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return torch.bfloat16 if mkldnn_bf16 is not None and mkldnn_bf16() else torch.float32


class LLM:
    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        *,
        dtype: str | torch.dtype | None = None,
        weights: str = "auto",
        activations: str = "float",
        batch_invariant: bool = True,
        device: str | torch.device | None = None,
        kv_cache_tokens: int | None = None,
        kv_cache_dtype: str = "auto",
        block_size: int = 16,
        max_num_seqs: int = 64,
        max_model_len: int | None = None,
        max_num_batched_tokens: int | None = None,
        enable_prefix_caching: bool = True,
        max_sessions: int = 1024,
        max_sessions_per_owner: int | None = None,
        session_ttl: float | None = 3600.0,
        session_db: str | os.PathLike[str] | bool | None = None,
        progress: bool = True,
    ) -> None:
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if isinstance(dtype, str):
            if dtype not in DTYPES:
                raise InvalidRequestError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}.", "dtype")
            dtype = DTYPES[dtype]
        weight_mode, dtype = resolve_weights(weights, dtype, self.device)
        activations = resolve_activations(activations, self.device)
        self.dtype = dtype or default_dtype(self.device)
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidRequestError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}.", "kv_cache_dtype"
            )
        self.kv_cache_dtype: torch.dtype = KV_CACHE_DTYPES[kv_cache_dtype] or self.dtype
        self.model_path: Path = resolve_model(model)
        model_config = load_config(self.model_path)
        self.tokenizer = Tokenizer.from_model_path(self.model_path)
        if kv_cache_tokens is None:
            kv_cache_tokens = DEFAULT_KV_CACHE_BYTES // kv_cache_bytes_per_token(model_config, self.kv_cache_dtype)
        num_blocks = max(1, kv_cache_tokens // block_size)
        # A request must fit in the pool on its own, or preemption could never make room for it.
        max_model_len = min(
            max_model_len or model_config.max_position_embeddings,
            model_config.max_position_embeddings,
            num_blocks * block_size,
        )
        self.config = EngineConfig(
            num_kv_blocks=num_blocks,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens or max(2048, max_num_seqs),
            max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching,
        )
        pool = BlockPool(num_blocks, block_size, enable_prefix_caching)
        scheduler = Scheduler(
            pool, self.config.max_num_seqs, self.config.max_num_batched_tokens, self.config.max_model_len
        )

        def build_runner() -> ModelRunner:
            # Runs on the engine thread: the weights and the KV pool are created by the thread that
            # computes with them. (With OpenMP, a second thread that ever ran parallel torch code makes
            # both thread teams stop spinning between kernels; here that halved decode speed.)
            loaded = load_model(
                self.model_path,
                self.dtype,
                self.device,
                progress=progress,
                weights=weight_mode,
                activations=activations,
            )
            return ModelRunner(
                loaded, num_blocks, block_size, self.tokenizer.stop_token_ids, self.kv_cache_dtype, batch_invariant
            )

        # Sessions need the prefix cache (their pinned blocks are found through it) and a store:
        # $KVSERVE_HOME/sessions.db by default, a path, or False for none.
        store = None
        if session_db is not False and enable_prefix_caching:
            path = kvserve_home() / "sessions.db" if session_db in (None, True) else Path(session_db)
            store = SessionStore(path)
        self.session_store = store

        def make_sessions(engine: EngineCore) -> SessionManager | None:
            if not enable_prefix_caching:
                return None
            return SessionManager(
                pool,
                self.tokenizer,
                engine.admit,
                engine.abort_now,
                store,
                max_sessions,
                session_ttl,
                self.config.max_model_len,
                max_sessions_per_owner,
            )

        self.engine = EngineCore(scheduler, build_runner, self.tokenizer, make_sessions)
        self.model = self.engine.runner.model
        summary = weight_summary(self.model)
        self.weights: dict[str, Any] = {
            "choice": weights,
            "mode": weight_mode,
            "activations": activations,
            "batch_invariant": batch_invariant,
            **summary,
        }
        logger.info(
            "weights=%s activations=%s on %s: %s, %.1f MB, compute dtype %s, KV cache %s x %d tokens",
            weights,
            activations,
            self.device.type,
            ", ".join(f"{n} {form}" for form, n in summary["layers"].items()),
            summary["bytes"] / 1e6,
            str(self.dtype).removeprefix("torch."),
            str(self.kv_cache_dtype).removeprefix("torch."),
            num_blocks * block_size,
        )
        self._ids = itertools.count()
        self._id_prefix = uuid.uuid4().hex[:8]

    # ----- requests -------------------------------------------------------------------------
    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """A prompt's token ids: text is encoded, token ids are checked against the vocabulary."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        prompt_ids = [int(t) for t in prompt]
        vocab = self.model.config.vocab_size
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            shown = bad if bad.bit_length() <= 64 else f"of {bad.bit_length()} bits"
            raise InvalidRequestError(f"Token id {shown} is outside the vocabulary (0..{vocab - 1}).", "prompt")
        return prompt_ids

    def _make_request(self, prompt: Prompt, params: SamplingParams | None, request_id: str | None) -> Request:
        params = params or SamplingParams()
        prompt_ids = self.encode_prompt(prompt)
        if not prompt_ids:
            raise InvalidRequestError("The prompt is empty; send at least one token of text.", "prompt")
        limit = self.config.max_model_len
        if len(prompt_ids) >= limit:
            raise InvalidRequestError(
                f"The prompt has {len(prompt_ids)} tokens; this model's context is {limit}. Shorten the prompt.",
                "prompt",
            )
        if len(prompt_ids) + params.max_tokens > limit:
            raise InvalidRequestError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context of "
                f"{limit} tokens; lower max_tokens to at most {limit - len(prompt_ids)}.",
                "max_tokens",
            )
        return Request(
            request_id=request_id or f"req-{self._id_prefix}-{next(self._ids)}",
            prompt_token_ids=prompt_ids,
            params=params,
            eos_token_ids=self.tokenizer.stop_token_ids,
        )

    def _chat_ids(self, messages: Messages) -> list[int]:
        return self.tokenizer.encode_chat(messages)

    def generate(
        self, prompts: Prompt | list[Prompt], params: SamplingParams | None = None
    ) -> RequestOutput | list[RequestOutput]:
        """Run to completion. A list of prompts (strings or token-id lists) gives a list of results."""
        is_batch = isinstance(prompts, list) and (not prompts or not isinstance(prompts[0], int))
        batch = prompts if is_batch else [prompts]
        requests = [self._make_request(p, params, None) for p in batch]
        sinks = []
        try:
            for request in requests:
                sink = _ThreadSink()
                self.engine.add(request, sink)
                sinks.append(sink)
            results = [
                RequestOutput.from_chunks(list(_iter_sink(s)), r.prompt_token_ids)
                for r, s in zip(requests, sinks, strict=False)
            ]
        except BaseException:
            self.engine.abort([r.request_id for r in requests])
            raise
        return results if is_batch else results[0]

    def stream(
        self, prompt: Prompt, params: SamplingParams | None = None, *, request_id: str | None = None
    ) -> Iterator[StreamChunk]:
        """Yield chunks as tokens are generated. Leaving the loop early aborts the request."""
        request = self._make_request(prompt, params, request_id)
        return self._stream(request)

    def _stream(self, request: Request) -> Iterator[StreamChunk]:
        return self._stream_with(request.request_id, lambda sink: self.engine.add(request, sink))

    def _stream_with(self, request_id: str, start: Callable[[_ThreadSink], None]) -> Iterator[StreamChunk]:
        """Yield a request's chunks; `start(sink)` submits it. Leaving early aborts `request_id`."""
        sink = _ThreadSink()
        start(sink)
        finished = False
        try:
            for chunk in _iter_sink(sink):
                finished = chunk.finish_reason is not None
                yield chunk
        except KVServeError:  # the engine already finished (or refused) this request
            finished = True
            raise
        finally:
            if not finished:
                self.engine.abort([request_id])

    def chat(self, messages: Messages, params: SamplingParams | None = None) -> RequestOutput:
        return self.generate(self._chat_ids(messages), params)

    def stream_chat(self, messages: Messages, params: SamplingParams | None = None) -> Iterator[StreamChunk]:
        return self.stream(self._chat_ids(messages), params)

    def astream(
        self, prompt: Prompt, params: SamplingParams | None = None, *, request_id: str | None = None
    ) -> AsyncIterator[StreamChunk]:
        """asyncio stream; cancelling the task or leaving the loop aborts the request.

        The prompt is validated now (raising InvalidRequestError); the request starts on first iteration.
        """
        return self._astream(self._make_request(prompt, params, request_id))

    def _astream(self, request: Request) -> AsyncIterator[StreamChunk]:
        return self._astream_with(request.request_id, lambda sink: self.engine.add(request, sink))

    async def _astream_with(self, request_id: str, start: Callable[[Any], None]) -> AsyncIterator[StreamChunk]:
        """asyncio twin of `_stream_with`: `start(sink)` submits; leaving early aborts `request_id`."""
        sink = _AsyncSink(asyncio.get_running_loop())
        start(sink)
        finished = False
        try:
            while True:
                item = await sink.queue.get()
                if isinstance(item, BaseException):  # the engine already finished (or refused) it
                    finished = True
                    raise item
                finished = item.finish_reason is not None
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.engine.abort([request_id])

    async def agenerate(
        self, prompt: Prompt, params: SamplingParams | None = None, *, request_id: str | None = None
    ) -> RequestOutput:
        request = self._make_request(prompt, params, request_id)
        chunks = [chunk async for chunk in self._astream(request)]
        return RequestOutput.from_chunks(chunks, request.prompt_token_ids)

    def astream_chat(self, messages: Messages, params: SamplingParams | None = None) -> AsyncIterator[StreamChunk]:
        return self.astream(self._chat_ids(messages), params)

    async def achat(self, messages: Messages, params: SamplingParams | None = None) -> RequestOutput:
        return await self.agenerate(self._chat_ids(messages), params)

    # ----- sessions -------------------------------------------------------------------------
    def session(
        self,
        system: str | None = None,
        messages: Messages | None = None,
        *,
        id: str | None = None,
        ttl: float | None = None,
        owner: str | None = None,
    ) -> Session:
        """A new session (optionally with a system message or earlier messages), or, with `id`,
        an existing one: live, or reopened from the session store after a restart."""
        if self.engine.sessions is None:
            raise InvalidRequestError("Sessions need the prefix cache; create the LLM with enable_prefix_caching=True.")
        if id is not None:
            self._session_call(lambda m: m.get(id, owner))
            return Session(self, id, owner)
        initial = [{"role": "system", "content": check_text(system, "system")}] if system else []
        for i, message in enumerate(messages or []):
            if message.get("role") not in ("system", "user", "assistant") or not isinstance(
                message.get("content"), str
            ):
                raise InvalidRequestError(
                    f"messages[{i}] needs a role (system/user/assistant) and text content.", "messages"
                )
            initial.append(
                {"role": message["role"], "content": check_text(message["content"], f"messages[{i}].content")}
            )
        state = self._session_call(lambda m: m.create(owner, initial, ttl))
        return Session(self, state.session_id, owner)

    def _session_call(self, fn: Callable[[SessionManager], Any]) -> Any:
        return self.engine.call(lambda: fn(self.engine.sessions), timeout=600)

    def _session_post(self, fn: Callable[[SessionManager], Any], sink: Any) -> None:
        """Like _session_call without waiting: an error goes to `sink` (the caller's stream)."""
        future = self.engine.post(lambda: fn(self.engine.sessions))
        future.add_done_callback(lambda f: sink.put(f.exception()) if f.exception() is not None else None)

    def abort(self, request_id: str | list[str]) -> None:
        """Abort requests by id (idempotent; unknown or finished ids are ignored)."""
        self.engine.abort([request_id] if isinstance(request_id, str) else list(request_id))

    # ----- introspection --------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def problem(self) -> str | None:
        """Why this LLM cannot serve right now (its engine thread stopped, its session store fails
        to write), or None when it can. A failed store is probed with a real write each time."""
        reason = self.engine.problem()
        if reason is None and self.session_store is not None:
            reason = self.session_store.probe()
        return reason

    def check_integrity(self) -> dict[str, Any]:
        """On the engine thread: assert the block pool's invariants; return the pool's counts and the
        scheduler's running and waiting requests at that moment."""

        def check() -> dict[str, Any]:
            pool, scheduler = self.engine.pool, self.engine.scheduler
            pool.check_integrity()
            return {
                "used": pool.num_used_blocks,
                "cached": pool.num_cached_blocks,
                "free": pool.num_free_blocks,
                "running": len(scheduler.running),
                "waiting": len(scheduler.waiting),
            }

        return self.engine.call(check, timeout=60)

    def runner_timings(self) -> dict[str, float]:
        return self.engine.call(lambda: self.engine.runner.timings.as_dict(), timeout=60)

    def close(self) -> None:
        self.engine.shutdown()
        if self.session_store is not None:
            self.session_store.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None and not engine.is_closed:
            engine.shutdown(timeout=5)


def _iter_sink(sink: _ThreadSink) -> Iterator[StreamChunk]:
    while True:
        item = sink.get()
        if isinstance(item, BaseException):
            raise item
        yield item
        if item.finish_reason is not None:
            return
