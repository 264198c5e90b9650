"""The house rule on reference outputs: torch (and transformers' models) live in the reference
venv (tests/refvenv.py), which only the scripts that make goldens create; the test run never
does. Read from the sources (`ast`): no test module calls `refvenv.ensure()`. (The one venv the
test run makes, lm-eval's, is checked to hold no torch by tests/serve/test_lm_eval.py.)"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _calls_ensure(tree: ast.Module) -> bool:
    return any(
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "ensure"
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "refvenv"
        for node in ast.walk(tree)
    )


def test_no_test_module_creates_the_reference_venv():
    found = [
        str(path.relative_to(TESTS))
        for path in sorted(TESTS.rglob("*.py"))
        if path.name != "refvenv.py" and _calls_ensure(ast.parse(path.read_text()))
    ]
    assert found == []
    # the check sees such a call
    assert _calls_ensure(ast.parse("from tests import refvenv\nrefvenv.ensure()\n"))
