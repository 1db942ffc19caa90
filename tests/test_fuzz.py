"""A short fixed-seed fuzz of the HTTP API (hypothesis): every response to a generated body is
below 500, every error is an OpenAI-shaped JSON body, every stream ends with `data: [DONE]`, and a
greedy stream running beside the fuzz produces exactly its solo text. bench/fuzz.py runs the same
property for longer; the strategies and the property are in tests/fuzz_strategies.py."""

from __future__ import annotations

import pytest

pytest.importorskip("hypothesis")

from kvserve import LLM
from kvserve.server.app import ServerSettings
from tests.conftest import wait_idle_and_check
from tests.fuzz_strategies import BODY_LIMIT, KEYS, MODEL, fuzz
from tests.server_harness import running_server

EXAMPLES = 80


def test_fuzz_http_api(tiny_model_dir, tmp_path):
    db = tmp_path / "sessions.db"
    with LLM(str(tiny_model_dir), dtype="float32", kv_cache_tokens=8192, session_db=db, progress=False) as llm:
        settings = ServerSettings(served_model_name=MODEL, api_keys=KEYS, max_queue=64, max_body_bytes=BODY_LIMIT)
        with running_server(settings, llm) as base:
            fuzzer, background = fuzz(base, llm, EXAMPLES, seed=None, derandomize=True)
        print(f"slowest cases:\n{fuzzer.slowest()}")
        assert fuzzer.examples >= EXAMPLES  # the generated ones, after the explicit ones
        assert not fuzzer.failures, f"{len(fuzzer.failures)} failures, distinct:\n{fuzzer.report()}"
        assert background.runs >= 1 and not background.problems, "\n".join(background.problems[:5])
        wait_idle_and_check(llm)
