"""The status operations on an LLM that the status routes (routes/status.py) use: in the server's
process (--engine-process off), or by name in the engine process (engine_process.OPERATIONS), where
the LLM lives. Each returns plain data (it crosses the process boundary pickled)."""

from __future__ import annotations

from typing import Any

from kvserve.llm import LLM
from kvserve.sessions.status import owner_sessions
from kvserve.weights.loader import recommended_sampling


def status_read(llm: LLM, since_seq: int, watch_s: float, series_seconds: int | None) -> dict[str, Any]:
    """The engine's state for the engine view (EngineMonitor.read), with the log's events after
    `since_seq` and the last `series_seconds` of the per-second figures (None: all)."""
    return llm.monitor.read(since_seq, watch_s, series_seconds)


def status_requests(llm: LLM, request_ids: list[str]) -> dict[str, dict[str, Any]]:
    """The status of each of these engine requests the monitor knows, by id."""
    return llm.monitor.statuses(request_ids)


def engine_info(llm: LLM) -> dict[str, Any]:
    """The model and the engine's settings, as the page shows them."""
    config = llm.config
    return {
        "model_file": llm.model_path.name,
        "architecture": llm.model.config.architecture,
        "device": llm.device.type,
        "dtype": str(llm.dtype).removeprefix("torch."),
        "kv_cache_dtype": str(llm.kv_cache_dtype).removeprefix("torch."),
        "weights": {k: v for k, v in llm.weights.items() if isinstance(v, str | int | float | bool)},
        "max_model_len": config.max_model_len,
        "max_num_seqs": config.max_num_seqs,
        "num_kv_blocks": config.num_kv_blocks,
        "block_size": config.block_size,
        "kv_cache_tokens": config.kv_cache_tokens,
        "prefix_caching": config.enable_prefix_caching,
        "recommended_sampling": recommended_sampling(llm.model_path),
    }


def sessions_list(llm: LLM, owner: str | None) -> list[dict[str, Any]]:
    """`owner`'s sessions, live and stored (sessions/status.owner_sessions), read on the engine thread."""
    return llm.engine.call(lambda: owner_sessions(llm.sessions, llm.session_store, owner), timeout=60)


STATUS_OPERATIONS = {
    "status_read": status_read,
    "status_requests": status_requests,
    "engine_info": engine_info,
    "sessions_list": sessions_list,
}
