"""LLM: the Python API. Every method may be called from any number of threads.

Building an LLM wires the engine (kvserve.engine) and, with the prefix cache on, sessions
(kvserve.sessions). Each call builds a Request and hands it to the engine thread through the
EngineClient, which reads the request's own sink; leaving a stream early aborts the request.
"""

from __future__ import annotations

import logging
import math
import numbers
import os
import threading
import weakref
from collections.abc import AsyncIterator, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from kvserve.engine.block_pool import BlockPool
from kvserve.engine.client import EngineClient, chunks
from kvserve.engine.config import EngineConfig
from kvserve.engine.core import EngineCore
from kvserve.engine.kv_cache import kv_cache_bytes_per_token
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.monitor import EngineMonitor
from kvserve.engine.request import Request
from kvserve.engine.scheduler import Scheduler
from kvserve.errors import InvalidRequestError, UnsupportedModelError, check_name, check_text
from kvserve.models.config import ModelConfig
from kvserve.outputs import RequestOutput, StreamChunk
from kvserve.pipeline.rendezvous import EngineSizes
from kvserve.pipeline.runner import PipelineRunner
from kvserve.pipeline.stage import StageSpec, build_stage
from kvserve.pipeline.topology import Topology
from kvserve.prompts import Messages, Prompt, RequestBuilder, check_messages
from kvserve.sampling_params import SamplingParams
from kvserve.sessions.limits import check_text_bytes
from kvserve.sessions.manager import SessionManager
from kvserve.sessions.session import Session
from kvserve.sessions.status import session_holders
from kvserve.sessions.store import SessionStore
from kvserve.text.tokenizer import Tokenizer
from kvserve.weights.loader import load_config, weight_summary
from kvserve.weights.plan import resolve_activations, resolve_weights
from kvserve.weights.registry import kvserve_home, resolve_model

logger = logging.getLogger("kvserve.weights")
DEFAULT_KV_CACHE_BYTES = 1 << 30
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "auto": None}
# The KV pool's element type; auto: the compute dtype. float16 halves the pool's bytes per token (twice
# the tokens in the same memory) and what decode attention reads, as llama.cpp's default f16 cache and
# vLLM's --kv-cache-dtype do; keys and values are rounded to it when written, and attention computes in
# float32 either way.
KV_CACHE_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 where the hardware computes it natively, else float32.

    Native bfloat16 halves the bytes a step reads and runs faster than float32 (bench/results/
    throughput.json); without native bf16 kernels it is emulated and slower, so float32 is the
    default there.
    """
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float32
    mkldnn_bf16 = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return torch.bfloat16 if mkldnn_bf16 is not None and mkldnn_bf16() else torch.float32


def _dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype in DTYPES.values()):
        return dtype
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise InvalidRequestError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r:.40}.", "dtype")
    return DTYPES[dtype]


def default_device() -> torch.device:
    """The first CUDA device that the kernels run on, else the CPU (logging why each GPU here was passed
    over)."""
    from kvserve.kernels.gpu import gpu_problem

    if not torch.cuda.is_available():
        return torch.device("cpu")
    log = logging.getLogger("kvserve.kernels")
    for index in range(torch.cuda.device_count()):
        problem = gpu_problem(index)
        if problem is None:
            return torch.device("cuda", index)
        log.warning("cuda:%d passed over: %s", index, problem)
    log.warning("Running on the CPU: no GPU here can run kvserve's kernels.")
    return torch.device("cpu")


def _device(device: object) -> torch.device:
    """The device asked for (None: `default_device`), checked now."""
    from kvserve.kernels.gpu import gpu_problem

    if device is None:
        return default_device()
    try:
        checked = torch.device(device)  # type: ignore[arg-type]
    except (RuntimeError, TypeError, ValueError):
        checked = None
    if checked is None or checked.type not in ("cpu", "cuda"):
        raise InvalidRequestError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r:.40}.", "device")
    if checked.type == "cuda" and (not torch.cuda.is_available() or (checked.index or 0) >= torch.cuda.device_count()):
        raise InvalidRequestError(
            f"device {str(checked)!r} is not here: this torch sees {torch.cuda.device_count()} CUDA device(s); "
            "use 'cpu', or leave device out.",
            "device",
        )
    problem = None if checked.type == "cpu" else gpu_problem(checked.index or 0)
    if problem is not None:
        raise InvalidRequestError(
            f"{problem} Use device 'cpu', or leave device out for the first GPU that can.", "device"
        )
    return checked


def _kv_cache_dtype(name: str) -> torch.dtype | None:
    if name not in KV_CACHE_DTYPES:
        raise InvalidRequestError(
            f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}.", "kv_cache_dtype"
        )
    return KV_CACHE_DTYPES[name]


def _check_size(name: str, value: object, low: int, kind: type | tuple = int) -> None:
    """One of the engine's sizes, checked before anything loads: a finite number of `kind` (never a
    bool), at least `low`."""
    if isinstance(value, bool) or not isinstance(value, kind) or not low <= value < math.inf:
        what = "an integer" if kind is int else "a number"
        raise InvalidRequestError(f"{name} must be {what} of at least {low}, got {value!r:.40}.", name)


def _check_vocabularies(path: Path, tokenizer: Tokenizer, model_vocab: int) -> None:
    """A tokenizer that gives ids the model has no row for would fail every request that meets them,
    blamed on the request: refused at load when its own tokens (BOS, EOS, stop tokens, what its chat
    template writes around a message) are past the model's rows, as llama.cpp refuses a GGUF whose token
    list and embedding disagree. A few added tokens past them (CodeLlama's 32004 over 32000) are only
    warned about: a prompt that spells one out gets a 400; a tokenizer smaller than the model is fine."""
    if tokenizer.vocab_size <= model_vocab:
        return
    own = [("BOS", tokenizer.bos_token_id), ("EOS", tokenizer.eos_token_id)]
    own += [("stop token", i) for i in tokenizer.stop_token_ids]
    if tokenizer.chat_template is not None:
        try:
            templated = tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
        except Exception:  # a template that refuses this conversation: the other ids are still checked
            templated = []
        own += [("chat template's token", i) for i in templated]
    past = [(i, name) for name, i in own if i is not None and i >= model_vocab]
    size = f"{path}'s tokenizer has {tokenizer.vocab_size} tokens, but its model only {model_vocab} (vocab_size)"
    if past:
        i, name = min(past)
        raise UnsupportedModelError(
            f"{size}, and its {name} {i} is past them: they do not belong together. "
            "Use the tokenizer files that came with these weights."
        )
    logger.warning("%s; a prompt that spells out one of the tokens past them is refused", size)
    tokenizer.keep_below(model_vocab)


def _memory_bytes() -> int | None:
    """The machine's memory (the KV pool lives in it on the CPU; a GPU's pool is checked as it is made)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _engine_config(
    model_config: ModelConfig,
    kv_cache_dtype: torch.dtype,
    kv_cache_tokens: int | None,
    block_size: int,
    max_num_seqs: int,
    max_model_len: int | None,
    max_num_batched_tokens: int | None,
    enable_prefix_caching: bool,
    host_share: float | None = 1.0,
) -> EngineConfig:
    """The engine's sizes: the KV pool (1 GiB worth of tokens unless told) and the limits."""
    per_token = kv_cache_bytes_per_token(model_config, kv_cache_dtype)
    if kv_cache_tokens is None:
        kv_cache_tokens = DEFAULT_KV_CACHE_BYTES // per_token
        if kv_cache_tokens < block_size:  # one block would be more than the budget
            raise InvalidRequestError(
                f"block_size={block_size} is more tokens than the default KV cache holds ({kv_cache_tokens}); "
                "lower it (16 is usual), or set kv_cache_tokens.",
                "block_size",
            )
    memory = _memory_bytes() if host_share else None
    share = kv_cache_tokens * per_token * (host_share or 1.0)  # a pipeline's: its stages on this host
    if memory is not None and share > memory:  # refused now, not as a MemoryError
        where = " on this host" if host_share != 1.0 else ""
        raise InvalidRequestError(
            f"kv_cache_tokens={kv_cache_tokens} needs {share / 2**30:.1f} GiB of KV cache{where}, more than this "
            f"machine's {memory / 2**30:.1f} GiB of memory; lower it.",
            "kv_cache_tokens",
        )
    num_blocks = max(1, kv_cache_tokens // block_size)
    if max_num_seqs > num_blocks * block_size:  # each running sequence holds a token of the cache at least
        raise InvalidRequestError(
            f"max_num_seqs={max_num_seqs} is more sequences than the KV cache holds tokens "
            f"({num_blocks * block_size}, kv_cache_tokens={kv_cache_tokens}), so most could never run; raise "
            f"kv_cache_tokens (a few thousand tokens at least), or lower max_num_seqs to {num_blocks * block_size} "
            "or fewer.",
            "max_num_seqs",
        )
    # A request must fit in the pool on its own, or preemption could never make room for it.
    longest = model_config.max_position_embeddings
    if max_model_len is not None and max_model_len > longest:  # asked for: refused, never lowered unsaid
        raise InvalidRequestError(
            f"max_model_len={max_model_len} is longer than this model's context of {longest} tokens; lower it, "
            f"or leave it out for {min(longest, num_blocks * block_size)}.",
            "max_model_len",
        )
    if max_model_len is not None and max_model_len > num_blocks * block_size:
        raise InvalidRequestError(
            f"max_model_len={max_model_len} does not fit in the KV cache of {num_blocks * block_size} tokens "
            f"(kv_cache_tokens, in whole blocks of {block_size}), which must hold a request alone; raise "
            "kv_cache_tokens or lower max_model_len.",
            "max_model_len",
        )
    return EngineConfig(
        num_kv_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens or max(2048, max_num_seqs),
        max_model_len=min(max_model_len or longest, longest, num_blocks * block_size),
        enable_prefix_caching=enable_prefix_caching,
    )


def stage_spec(
    model: str | os.PathLike[str] | None,
    dtype: str | torch.dtype | None,
    weights: str,
    activations: str,
    kv_cache_dtype: str,
    batch_invariant: bool,
    device: torch.device,
    cuda_graphs: bool = True,
    async_scheduling: bool | None = None,
) -> StageSpec:
    """The model file and the resolved settings an LLM runs with (its pipeline stages too; `kvserve
    serve` on a host without rank 0 resolves its flags through this as well)."""
    weight_mode, chosen = resolve_weights(weights, _dtype(dtype), device)
    compute = chosen or default_dtype(device)
    return StageSpec(
        model=str(resolve_model(model)),
        dtype=compute,
        weights=weight_mode,
        activations=resolve_activations(activations, device, weight_mode),
        kv_cache_dtype=_kv_cache_dtype(kv_cache_dtype) or compute,
        batch_invariant=batch_invariant,
        device=str(device),
        cuda_graphs=cuda_graphs,
        async_scheduling=device.type == "cuda" if async_scheduling is None else async_scheduling,
    )


class _ShutDown:
    """LLM.close, and what happens once nothing holds an LLM's client: the engine thread aborts what
    it runs and ends, then the store closes (its lock and its sessions' claims released); `done` then."""

    def __init__(self, engine: EngineCore, store: SessionStore | None) -> None:
        self.engine, self.store, self.done = engine, store, threading.Event()

    def __call__(self) -> None:
        if threading.current_thread() is self.engine.thread:  # collected there: it cannot wait for itself
            threading.Thread(target=self, name="kvserve-shutdown", daemon=True).start()
            return
        try:
            self.engine.shutdown()
            if self.store is not None:
                self.store.close()
        finally:
            self.done.set()


def _request_ids(request_id: object) -> list[str]:
    """A request id or a list of them, as a list; anything else is an InvalidRequestError."""
    if isinstance(request_id, str):
        return [request_id]
    ids = list(request_id) if isinstance(request_id, Iterable) and not isinstance(request_id, bytes) else None
    if ids is None or not all(isinstance(i, str) for i in ids):  # any iterable of them: a dict's keys too
        raise InvalidRequestError(f"request_id must be a string or a list of strings, got {request_id!r:.60}.")
    return ids


def _open_store(session_db: str | os.PathLike[str] | bool | None) -> SessionStore | None:
    """$KVSERVE_HOME/sessions.db by default (None or True), a path, or False for no store."""
    if session_db is False:
        return None
    return SessionStore(kvserve_home() / "sessions.db" if session_db in (None, True) else Path(session_db))


class LLM:
    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        *,
        dtype: str | torch.dtype | None = None,
        weights: str = "auto",
        activations: str = "auto",
        batch_invariant: bool = True,
        cuda_graphs: bool = True,
        async_scheduling: bool | None = None,
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
        max_session_tokens: int | None = None,
        max_message_bytes: int | None = None,
        progress: bool = True,
        pipeline_parallel: int = 1,
        pipeline: Topology | None = None,
        gather_ms: float = 3.0,
    ) -> None:
        """`pipeline_parallel` N > 1 splits the model's layers over N processes of this host (this one
        the first stage, and the engine; docs/scale-out.md), each computing on its share of the CPUs
        (this process's torch.set_num_threads then counts its share); `pipeline` gives the Topology
        across hosts (`kvserve serve --nnodes ...` builds it). Everything else is the same either way.
        `cuda_graphs` (on a GPU): steps of up to `max_num_seqs` tokens (decodes, short prompts within
        GRAPH_CONTEXT tokens of context) replay CUDA graphs captured here, one per bucket of rows
        (engine/cuda_graphs.py); off, every step runs eagerly.
        `async_scheduling` (None: on a GPU): the engine queues step n+1 on the device before it takes back
        step n's tokens, a request's next token read there (engine/core.py); the same tokens either way.
        A session holds at most `max_session_tokens` tokens (default and most: the context), and one
        message, append or system prompt at most `max_message_bytes` UTF-8 bytes (default 16 per
        token of that); more is refused with InvalidRequestError and not applied.
        From idle, the first step waits until no request has arrived for `gather_ms` ms (at most 8x), so
        that requests sent together share one prefill (engine/burst.py); 0 starts at once."""
        _check_size("block_size", block_size, 1)
        _check_size("max_num_seqs", max_num_seqs, 1)
        _check_size("gather_ms", gather_ms, 0, (int, float))
        _check_size("max_sessions", max_sessions, 0)
        _check_size("pipeline_parallel", pipeline_parallel, 1)
        for name, value in (
            ("max_sessions_per_owner", max_sessions_per_owner),
            ("max_session_tokens", max_session_tokens),
            ("max_message_bytes", max_message_bytes),
        ):
            if value is not None:
                _check_size(name, value, 1)
        for name, value in (
            ("batch_invariant", batch_invariant),
            ("cuda_graphs", cuda_graphs),
            ("enable_prefix_caching", enable_prefix_caching),
            ("progress", progress),
        ):
            if not isinstance(value, bool):
                raise InvalidRequestError(f"{name} must be True or False, got {value!r:.40}.", name)
        if model is not None and not isinstance(model, str | os.PathLike):
            raise InvalidRequestError(
                f"model must be a registered name or a path (a string), got {type(model).__name__}.", "model"
            )
        if not isinstance(session_db, str | os.PathLike | bool | None):
            raise InvalidRequestError(
                f"session_db must be a path, True (the default store) or False (none), got {type(session_db).__name__}.",
                "session_db",
            )
        if kv_cache_tokens is not None:  # (None: chosen later, as the rest)
            _check_size("kv_cache_tokens", kv_cache_tokens, block_size)  # at least a block
        if max_model_len is not None:
            _check_size("max_model_len", max_model_len, 1)
        if max_num_batched_tokens is not None:
            _check_size("max_num_batched_tokens", max_num_batched_tokens, 1)
        self.device = _device(device)
        topology = pipeline or (Topology.from_settings(pipeline_parallel) if pipeline_parallel > 1 else None)
        if topology is not None and not topology.hosts_rank0:
            raise InvalidRequestError(
                f"An LLM is rank 0 of its pipeline; node {topology.node_rank} runs stages "
                f"{topology.local_ranks} only (kvserve serve does that on its own).",
                "node_rank",
            )
        spec = stage_spec(
            model,
            dtype,
            weights,
            activations,
            kv_cache_dtype,
            batch_invariant,
            self.device,
            cuda_graphs,
            async_scheduling,
        )
        self.dtype, self.kv_cache_dtype = spec.dtype, spec.kv_cache_dtype
        self.model_path: Path = Path(spec.model)
        model_config = load_config(self.model_path)
        self.tokenizer = Tokenizer.from_model_path(self.model_path)
        _check_vocabularies(self.model_path, self.tokenizer, model_config.vocab_size)
        _ = self.tokenizer.token_bytes  # the detokenizer's table, built at load rather than on the first request
        self.config = _engine_config(
            model_config,
            self.kv_cache_dtype,
            kv_cache_tokens,
            block_size,
            max_num_seqs,
            max_model_len,
            max_num_batched_tokens,
            enable_prefix_caching,
            # a pipeline's pool is split over its stages, some on this host (on the CPU: a GPU's is not its memory)
            (len(topology.local_ranks) / topology.stages if topology is not None else 1.0)
            if self.device.type == "cpu"
            else None,
        )
        pool = BlockPool(self.config.num_kv_blocks, block_size, enable_prefix_caching)
        scheduler = Scheduler(
            pool, self.config.max_num_seqs, self.config.max_num_batched_tokens, self.config.max_model_len
        )

        # What the engine thread keeps (build_runner, the monitor's reader) holds no reference to this
        # LLM, so that an LLM nobody holds is collected, and shut down (`_ShutDown`).
        config, stop_token_ids = self.config, self.tokenizer.stop_token_ids

        def build_runner(engine: EngineCore) -> ModelRunner | PipelineRunner:
            # Runs on the engine thread: the weights and the KV pool are created by the thread that
            # computes with them. (With OpenMP, a second thread that ever ran parallel torch code makes
            # both thread teams stop spinning between kernels; here that halved decode speed.)
            sizes = EngineSizes(
                config.num_kv_blocks, block_size, stop_token_ids, config.max_num_seqs, config.max_model_len
            )
            if topology is not None and topology.stages > 1:
                return PipelineRunner.start(engine, topology.with_port(), spec, sizes, progress)
            return build_stage(spec, (0, model_config.num_hidden_layers), sizes, progress)  # the whole model

        # Sessions need the prefix cache (their pinned blocks are found through it) and a store.
        self.session_store = _open_store(session_db) if enable_prefix_caching else None
        self.sessions: SessionManager | None = None

        def make_sessions(engine: EngineCore) -> SessionManager:
            self.sessions = SessionManager(
                pool,
                self.tokenizer,
                engine.admit,
                engine.abort_now,
                self.session_store,
                max_sessions,
                session_ttl,
                self.config.max_model_len,
                max_sessions_per_owner,
                max_session_tokens,
                max_message_bytes,
            )
            return self.sessions

        make_hooks = make_sessions if enable_prefix_caching else None
        try:
            engine = EngineCore(scheduler, build_runner, self.tokenizer, make_hooks, gather=gather_ms / 1000)
        except BaseException:
            if self.session_store is not None:  # its lock, for the next try
                self.session_store.close()
            raise
        self.engine = engine
        # Everything a caller holds (this LLM, its sessions, its unfinished streams) holds the client:
        # once none is left, the engine stops and the store closes, as close() does.
        self.client = EngineClient(engine)
        self._shut_down = _ShutDown(engine, self.session_store)
        self._finalizer = weakref.finalize(self.client, self._shut_down)
        self._finalizer.atexit = False  # at exit the daemon engine thread just ends, as before
        # What the engine is doing, for status readers (the server's page and status routes); built on
        # the engine thread, which it watches.
        sessions = self.sessions
        self.monitor = engine.call(lambda: EngineMonitor(engine, lambda: session_holders(sessions)))
        self.model = self.engine.runner.model
        self.weights: dict[str, Any] = {
            "choice": weights,
            "mode": spec.weights,
            # int8 only where a layer takes it: a checkpoint of float tensors has none to quantize
            "activations": "int8"
            if any(getattr(m, "int8_activations", False) for m in self.model.modules())
            else "float",
            "batch_invariant": batch_invariant,
            "cuda_graphs": getattr(self.engine.runner, "graphs", None) is not None,  # a pipeline runs none
            "async_scheduling": getattr(self.engine.runner, "runs_ahead", False),
            **weight_summary(self.model),
        }
        self._log_start()
        self.request_builder = RequestBuilder(self.tokenizer, self.model.config.vocab_size, self.config.max_model_len)

    def _log_start(self) -> None:
        logger.info(
            "weights=%s activations=%s on %s: %s, %.1f MB, compute dtype %s, KV cache %s x %d tokens",
            self.weights["choice"],
            self.weights["activations"],
            self.device.type,
            ", ".join(f"{n} {form}" for form, n in self.weights["layers"].items()),
            self.weights["bytes"] / 1e6,
            str(self.dtype).removeprefix("torch."),
            str(self.kv_cache_dtype).removeprefix("torch."),
            self.config.kv_cache_tokens,
        )

    # ----- requests -------------------------------------------------------------------------
    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """A prompt's token ids: text is encoded, token ids are checked against the vocabulary."""
        return self.request_builder.encode_prompt(prompt)

    def _make_request(self, prompt: Prompt, params: SamplingParams | None, request_id: str | None) -> Request:
        return self.request_builder.build(prompt, params, request_id)

    def _chat_ids(self, messages: Messages) -> list[int]:
        return self.tokenizer.encode_chat(check_messages(messages))

    def generate(
        self, prompts: Prompt | list[Prompt], params: SamplingParams | list[SamplingParams] | None = None
    ) -> RequestOutput | list[RequestOutput]:
        """Run to completion. A list of prompts (strings or token-id lists) gives a list of results;
        `params` is one for all, or a list of one per prompt."""
        is_batch = isinstance(prompts, list) and (not prompts or not isinstance(prompts[0], numbers.Integral))
        batch = prompts if is_batch else [prompts]
        if isinstance(params, list | tuple):
            if not is_batch or len(params) != len(batch):
                raise InvalidRequestError(
                    f"params is a list of {len(params)}; give one SamplingParams for all prompts, or one per prompt "
                    f"({len(batch)}).",
                    "params",
                )
            per_prompt = list(params)
        else:
            per_prompt = [params] * len(batch)
        requests = [self._make_request(p, q, None) for p, q in zip(batch, per_prompt, strict=True)]
        try:
            sinks = [self.client.submit(request) for request in requests]
            results = [
                RequestOutput.from_chunks(list(chunks(s)), r.prompt_token_ids)
                for r, s in zip(requests, sinks, strict=False)
            ]
        except BaseException:
            self.client.abort([r.request_id for r in requests])
            raise
        return results if is_batch else results[0]

    def stream(
        self, prompt: Prompt, params: SamplingParams | None = None, *, request_id: str | None = None
    ) -> Iterator[StreamChunk]:
        """Yield chunks as tokens are generated. Leaving the loop early aborts the request (a stream
        still held in a variable once left: when it is closed, `stream.close()`, or collected)."""
        return self.client.stream(self._make_request(prompt, params, request_id))

    def chat(self, messages: Messages, params: SamplingParams | None = None) -> RequestOutput:
        return self.generate(self._chat_ids(messages), params)

    def stream_chat(self, messages: Messages, params: SamplingParams | None = None) -> Iterator[StreamChunk]:
        return self.stream(self._chat_ids(messages), params)

    def astream(
        self, prompt: Prompt, params: SamplingParams | None = None, *, request_id: str | None = None
    ) -> AsyncIterator[StreamChunk]:
        """asyncio stream; cancelling the task or leaving the loop aborts the request (a stream still
        held in a variable once left: when it is closed, `await stream.aclose()`, or collected).

        The prompt is validated now (raising InvalidRequestError); the request starts on first iteration.
        """
        return self.client.astream(self._make_request(prompt, params, request_id))

    async def agenerate(
        self, prompt: Prompt, params: SamplingParams | None = None, *, request_id: str | None = None
    ) -> RequestOutput:
        request = self._make_request(prompt, params, request_id)
        chunks = [chunk async for chunk in self.client.astream(request)]
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
        sessions = self.sessions
        if sessions is None:
            raise InvalidRequestError("Sessions need the prefix cache; create the LLM with enable_prefix_caching=True.")
        check_name(id, "id")
        check_name(owner, "owner")
        if id is not None:
            self.client.call(lambda: sessions.get(id, owner))
            return Session(self.client, sessions, id, owner)
        if self.tokenizer.chat_template is None:  # refused now, not at its first turn
            raise UnsupportedModelError(
                "This model has no chat template (it is a base model), so it cannot hold a conversation: "
                "send plain prompts (/v1/completions, llm.generate) instead of a session."
            )
        initial = [{"role": "system", "content": check_text(system, "system")}] if system else []
        if messages is not None and not isinstance(messages, list | tuple):
            raise InvalidRequestError(
                f'messages must be a list of {{"role": ..., "content": ...}} dicts, got {type(messages).__name__}.',
                "messages",
            )
        for i, message in enumerate(messages or []):
            if (
                not isinstance(message, dict)
                or message.get("role") not in ("system", "user", "assistant")
                or not isinstance(message.get("content"), str)
            ):
                raise InvalidRequestError(
                    f"messages[{i}] needs a role (system/user/assistant) and text content.", "messages"
                )
            initial.append(
                {"role": message["role"], "content": check_text(message["content"], f"messages[{i}].content")}
            )
        # Bounded before the engine thread tokenizes them (the session's tokens are checked there).
        limit = sessions.max_message_bytes
        check_text_bytes("".join(m["content"] for m in initial), limit, "system" if not messages else "messages")
        state = self.client.call(lambda: sessions.create(owner, initial, ttl))
        return Session(self.client, sessions, state.session_id, owner)

    def abort(self, request_id: str | list[str]) -> None:
        """Abort requests by id (idempotent; unknown or finished ids are ignored)."""
        self.client.abort(_request_ids(request_id))

    def pause(self, request_id: str | list[str], paused: bool = True) -> None:
        """Hold requests out of the batch (their reader is not keeping up: the server pauses a stream
        whose client does not read), or with `paused=False` let them back. A paused request keeps its
        place and its output; its KV blocks are freed and recomputed when it runs again."""
        self.client.pause(_request_ids(request_id), paused)

    # ----- introspection --------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return {"num_sessions": 0, "session_kv_blocks": 0, **self.engine.stats()}

    def problem(self) -> str | None:
        """Why this LLM cannot serve right now (its engine thread stopped, its session store fails
        to write), or None when it can. A failed store is probed with a real write each time."""
        reason = self.engine.problem()
        if reason is None and self.session_store is not None:
            reason = self.session_store.probe()
        return reason

    def check_integrity(self) -> dict[str, Any]:
        """On the engine thread: assert the block pool's and the scheduler's invariants; return the
        pool's counts and the scheduler's running and waiting requests at that moment."""

        def check() -> dict[str, Any]:
            pool, scheduler = self.engine.pool, self.engine.scheduler
            pool.check_integrity()
            scheduler.check_integrity()
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
        """Stop the engine (aborting what runs) and close the session store; a second call (another
        thread's) waits for the first one's."""
        self._finalizer()  # runs once
        if threading.current_thread() is not self.engine.thread:
            self._shut_down.done.wait()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
