"""kvserve.kernels as a package: the build cache is keyed by every source file, the layer kinds
fused_decode passes are the C++ enum's, and nothing in the package imports the rest of kvserve."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest
import torch

from kvserve.engine.kv_cache import allocate_kv_cache
from kvserve.kernels import build, ops
from kvserve.layers.fused_decode import FusedDecoder
from kvserve.layers.quantized import Int4Linear, Int8GroupLinear, Int8Linear
from kvserve.weights.loader import load_model
from tests.conftest import make_tiny_llama

PACKAGE = Path(build.__file__).resolve().parent  # kvserve/kernels


def test_the_build_name_changes_with_every_source_file(tmp_path, monkeypatch):
    sources = tmp_path / "csrc"
    shutil.copytree(build.SOURCE_DIR, sources)
    monkeypatch.setattr(build, "SOURCE_DIR", sources)
    files = build.sources()
    assert {p.suffix for p in files} == {".cpp", ".h"}
    assert {p.name for p in files} == {p.name for p in sources.iterdir()}  # no file left out
    original = build.build_name()
    for path in files:
        data = path.read_bytes()
        path.write_bytes(data.replace(b"\n", b"\n ", 1))  # one byte more, in the first line break
        assert build.build_name() != original, path.name
        path.write_bytes(data)
        assert build.build_name() == original, path.name
    (sources / "new.h").write_text("#pragma once\n")
    assert build.build_name() != original  # a new header counts too


def _module_names(path: Path, tree: ast.Module) -> list[str]:
    """Every module `path` imports, relative imports resolved against its package."""
    package = ["kvserve", *path.relative_to(PACKAGE.parent).parent.parts]  # e.g. kvserve.kernels
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[: len(package) - node.level + 1], *([base] if base else [])])
            names += [base] + [f"{base}.{alias.name}" for alias in node.names]
    return names


def test_the_kernels_package_imports_nothing_else_of_kvserve():
    modules = sorted(PACKAGE.rglob("*.py"))
    assert {p.name for p in modules} >= {"__init__.py", "build.py", "ops.py"}
    for path in modules:
        names = _module_names(path, ast.parse(path.read_text(), str(path)))
        outside = [n for n in names if n.split(".")[0] == "kvserve" and not n.startswith("kvserve.kernels")]
        assert outside == [], f"{path.name} imports {outside}"
    # the check itself sees such an import, absolute or relative
    for source in ("from kvserve.layers import quantized", "import kvserve.engine", "from ..layers import norm"):
        assert any(
            n.startswith("kvserve.") and "kernels" not in n
            for n in _module_names(PACKAGE / "ops.py", ast.parse(source))
        )


@pytest.mark.parametrize("weights", ["q4", "q8", "float", "q8_0-gguf", "q8_0-gguf-int8"])
def test_fused_decode_passes_the_cpp_enum_of_each_layer_kind(tmp_path, extension, weights):
    pytest.importorskip("transformers")
    from gguf import GGMLQuantizationType

    from tests.test_gguf import write_llama_gguf

    kinds = ops.linear_kinds()
    expected_kinds = {"Float": 0, "Int4": 1, "Int8": 2, "Int8Groups": 3, "Int8Quads": 4}
    assert {name: int(value) for name, value in kinds.__members__.items()} == expected_kinds
    hf_model = make_tiny_llama(tmp_path, seed=5, hidden_size=64, intermediate_size=128, vocab_size=320)
    path, activations, groups = tmp_path, "float", kinds.Int8Groups
    if weights.startswith("q8_0-gguf"):  # Q8_0 codes kept with their scale per 32: Int8GroupLinear
        if weights.endswith("int8"):  # int8 inputs: held as quads where the CPU has AVX2
            activations = "int8" if extension.int8_activations() else "float"
            groups = kinds.Int8Quads if activations == "int8" and extension.int8_quads_usable() else groups
        path, weights = tmp_path / "tiny.gguf", "auto"
        write_llama_gguf(path, hf_model, qtype=GGMLQuantizationType.Q8_0)
    model = load_model(path, torch.float32, progress=False, weights=weights, activations=activations)
    model.bind_kv_cache(allocate_kv_cache(model.config, 8, 4, torch.float32, "cpu"))
    fused = FusedDecoder(model)
    layers = [
        m
        for layer in model.layers
        for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    ]
    by_type = {Int4Linear: kinds.Int4, Int8Linear: kinds.Int8, Int8GroupLinear: groups}
    expected = [by_type.get(type(m), kinds.Float) for m in layers]
    assert [linear.kind for linear in fused.linears] == expected
    assert set(expected) == {{"q4": kinds.Int4, "q8": kinds.Int8, "float": kinds.Float, "auto": groups}[weights]}
    if groups == kinds.Int8Quads:  # one layout: the row-major codes are gone
        assert all(m.codes is None and m.quads is not None for m in layers)


def test_a_fused_decoder_refuses_caches_bound_after_it(tmp_path, extension):
    pytest.importorskip("transformers")
    make_tiny_llama(tmp_path, seed=6)
    model = load_model(tmp_path, torch.float32, progress=False, weights="float")
    model.bind_kv_cache(allocate_kv_cache(model.config, 8, 4, torch.float32, "cpu"))
    fused = FusedDecoder(model)
    ids, positions, slots = torch.tensor([1, 2]), torch.tensor([0, 1]), torch.tensor([0, 1])
    with torch.inference_mode():
        assert fused.prefill(ids, positions, slots, [0, 2]).shape == (2, model.config.hidden_size)
        model.bind_kv_cache(allocate_kv_cache(model.config, 8, 4, torch.float32, "cpu"))
        with pytest.raises(RuntimeError, match="rebound"):
            fused.prefill(ids, positions, slots, [0, 2])
