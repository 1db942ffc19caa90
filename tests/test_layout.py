"""The layout keeps its shape: no import cycles inside kvserve, and the engine knows sessions (and
the server, and the Python API) only through its own interfaces. (That kernels/ is a leaf package
is tests/test_kernels.py's.)"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "kvserve"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The kvserve modules `path` imports anywhere (module level or inside functions), except under
    `if TYPE_CHECKING:`; `from kvserve.a import b` counts as kvserve.a.b when that is a module."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):  # drop typing-only imports
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = []
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in found if name in modules}


def packages_run_by(name: str, importer: str) -> set[str]:
    """The packages whose `__init__` importing module `name` runs first (kvserve.models.config: kvserve.models),
    but the importer's own (already run, or running: a package may import its modules, and they each other)."""
    parts, own = name.split("."), importer.split(".")
    parents = {".".join(parts[:i]) for i in range(1, len(parts))}
    return parents - {".".join(own[:i]) for i in range(1, len(own) + 1)}


def import_graph() -> dict[str, set[str]]:
    """Each kvserve module's imports of the others, the packages above them included (`packages_run_by`)."""
    paths = {module_name(p): p for p in ROOT.rglob("*.py")}
    modules = set(paths)
    graph = {}
    for name, path in paths.items():
        imported = imports_of(path, modules) - {name}
        graph[name] = imported | {p for module in imported for p in packages_run_by(module, name) if p in modules}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_no_import_cycles_inside_kvserve():
    assert cycles(import_graph()) == []


def test_an_import_runs_the_packages_above_it():
    """`from kvserve.models.config import ...` runs kvserve/models/__init__.py first, which imports the
    decoder: an edge the cycle finder must see (kvserve.layers.rotary once imported it so, and importing
    rotary before the decoder failed, the module half made)."""
    assert packages_run_by("kvserve.models.config", "kvserve.layers.rotary") == {"kvserve.models"}
    assert packages_run_by("kvserve.models.config", "kvserve.models.decoder") == set()


def imports_from_outside(package: str) -> dict[str, list[str]]:
    """The modules of `package` that import sessions, the server, the Python API or the CLI, and what."""
    outside = ("kvserve.sessions", "kvserve.server", "kvserve.llm", "kvserve.cli")
    wrong = {
        module: sorted(t for t in targets if t.startswith(outside))
        for module, targets in import_graph().items()
        if module.startswith(package)
    }
    return {m: t for m, t in wrong.items() if t}


def test_the_engine_does_not_import_sessions_the_server_or_the_api():
    assert imports_from_outside("kvserve.engine") == {}


def test_pipeline_stages_know_the_engine_not_sessions_the_server_or_the_api():
    assert imports_from_outside("kvserve.pipeline") == {}


def test_importing_kvserve_leaves_triton_and_torch_compile_alone():
    """`import kvserve` is every CLI start: triton and torch.compile'd modules load only where used
    (llguidance.torch's decorator once cost each start ~2 s and imported triton before
    TRITON_INTERPRET could be set)."""
    import subprocess
    import sys

    probe = "import sys, kvserve; print(sorted(m for m in ('triton', 'llguidance.torch') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
