"""The package's layers, read from its own imports (`ast`, nothing imported): no import circle,
imports only downwards (one exception, named below), workers/ free of asyncio, and no library
file over 350 lines. docs/architecture.md draws the same layers.

Every import counts, at the top of a module or inside a function, except those under
`if TYPE_CHECKING:` (annotations only: they never run, so they can form no circle).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "aioprefill"

# Bottom first. A module may import its own layer or any layer below it. A module matches the
# longest prefix listed (a package's name covers its modules).
LAYERS: list[tuple[str, list[str]]] = [
    ("base", ["errors", "optional", "checks", "engine.histogram", "engine.timer", "shm"]),
    ("file formats", ["hf", "text.tokenizer", "text.gguf_vocab", "text.chunks"]),
    (
        "specs",
        [
            *("models", "parallel", "text", "transfer.options", "transfer.backend"),
            *("kvstore.options", "kvstore.backend", "config"),
        ],
    ),
    ("wire", ["wire.protocol", "wire.kv", "transfer", "kvstore"]),
    ("worker process", ["workers"]),
    ("engine parts", ["sched", "wire", "result", "engine"]),
    ("pool", ["engine.pool"]),
    (
        "engine",
        [*("engine.health", "engine.controls", "engine.loop", "metrics", "bench", "kv_events", "")],
    ),
    ("server", ["serve"]),
]

# The one import that runs back up: `PaddleModel.from_pretrained` checks a checkpoint's tensor
# headers with the same reader the worker uses (`hf.weights`), imported inside the function;
# `hf` names the specs for annotations only.
UPWARD_ALLOWED: set[tuple[str, str]] = set()

MAX_LINES = 350


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _type_checking_only(tree: ast.Module) -> set[ast.AST]:
    skipped: set[ast.AST] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                skipped.update(ast.walk(child))
    return skipped


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package modules `name` imports (a `from pkg import mod` names the module)."""
    tree = ast.parse(path.read_text())
    skipped = _type_checking_only(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if node in skipped:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([p for p in up if p] + ([base] if base else []))
                base = "aioprefill." + base if base else "aioprefill"
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for target in targets:
            if not target.startswith("aioprefill"):
                continue
            inner = target.removeprefix("aioprefill").removeprefix(".")
            if inner in known:
                found.add(inner)
                if isinstance(node, ast.ImportFrom):
                    break  # `from pkg import mod`: the module, not also the package
    found.discard(name)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def layer_of(module: str) -> int:
    best, best_len = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".") or prefix == "") and len(
                prefix
            ) > best_len:
                best, best_len = i, len(prefix)
    return best


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_checker_sees_imports():
    edges = graph()
    assert "engine.pool.pool" in edges["engine.loop"] and "errors" in edges["checks"]
    assert "models" in edges["config"]  # a `from aioprefill.models import (...)` block


def test_no_import_circles():
    assert cycles(graph()) == []


def test_imports_run_downwards():
    up = sorted((a, b) for a, bs in graph().items() for b in bs if layer_of(b) > layer_of(a) >= 0)
    assert set(up) <= UPWARD_ALLOWED, [f"{a} -> {b}" for a, b in up]
    assert len(up) <= 1


def test_every_module_has_a_layer():
    assert [m for m in graph() if layer_of(m) < 0] == []


def test_workers_run_no_asyncio():
    """workers/ is what runs inside a worker process: no event loop there."""
    for path in (PACKAGE / "workers").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                assert not any(n.split(".")[0] == "asyncio" for n in names), path.name


def test_no_library_file_is_too_long():
    long = {
        p.name: n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}
    assert len((PACKAGE / "engine" / "loop.py").read_text().splitlines()) <= 300
