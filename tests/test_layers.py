"""The package's layers, read from its own imports (`ast`, nothing imported): no import circle,
imports only downwards, at most 12 layers, workers/ free of asyncio, a package root that holds
only what a user imports, and no library file over 350 lines. docs/architecture.md draws the
same layers; each folder's `__init__.py` says what lives there and what it may import.

Every import counts: at the top of a module, inside a function, and under `if TYPE_CHECKING:`
(an annotation that names a module above is still a coupling, and a circle through one is a
circle).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "aioprefill"

# Bottom first. A module may import its own layer or any layer below it. A module matches the
# longest prefix listed (a package's name covers its modules).
LAYERS: list[tuple[str, list[str]]] = [
    ("base", ["errors", "optional", "checks", "shm"]),
    (
        "file formats",
        ["hf", "text.tokenizer", "text.gguf_vocab", "text.chunks", "text.chat_template"],
    ),
    (
        "specs",
        [
            *("models", "parallel", "text", "transfer.options", "transfer.backend"),
            *("kvstore.options", "kvstore.backend", "config"),
        ],
    ),
    ("wire", ["wire", "transfer", "kvstore"]),
    ("worker process", ["workers"]),
    ("scheduling", ["sched", "result"]),
    ("engine parts", ["engine", "kv_events"]),
    ("pool", ["engine.pool"]),
    ("engine", ["engine.health", "engine.controls", "engine.loop", "metrics", ""]),
    ("applications", ["serve", "bench"]),
]

MAX_LAYERS = 12
# What a user imports, and nothing else, sits at the package root.
ROOT_MODULES = {"errors", "config", "models", "parallel", "result", "metrics", "checks", "optional"}
MAX_LINES = 350


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package modules `name` imports (a `from pkg import mod` names the module)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
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


def test_the_checker_sees_type_checking_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from aioprefill.errors import AioprefillError\n"
    )
    assert imports("probe", probe, {"errors": probe}) == {"errors"}


def test_imports_run_downwards():
    up = sorted((a, b) for a, bs in graph().items() for b in bs if layer_of(b) > layer_of(a) >= 0)
    assert up == [], [f"{a} -> {b}" for a, b in up]


def test_at_most_twelve_layers():
    assert len(LAYERS) <= MAX_LAYERS


def test_the_root_holds_what_a_user_imports():
    root = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    assert root <= ROOT_MODULES and len(root) <= 10, sorted(root - ROOT_MODULES)


def test_every_folder_says_what_it_holds():
    for init in PACKAGE.rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        where = init.relative_to(PACKAGE)
        assert len(doc.split()) >= 8, f"{where}: no docstring saying what lives there"


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
