"""Naming the most common reason a worker dies before it is ready: no main-module guard.

Workers start under `spawn` (or from a forkserver, which prepares its children the same way):
each one re-imports the program's main module, as `__mp_main__`, before running its target. A
script that starts an Engine at module level, without `if __name__ == "__main__":`, therefore
starts an Engine again inside every worker; multiprocessing refuses to start a process from a
process still bootstrapping, the worker dies with exit code 1 and the only clue is a
`RuntimeError` about the "bootstrapping phase" in its traceback.

Two sides say so plainly: the would-be worker refuses to start an engine while it is being
bootstrapped (`refuse_while_bootstrapping`), and the engine, seeing a worker exit before it was
ready, looks for the guard in the main module's source (`missing_guard_hint`).
"""

from __future__ import annotations

import ast
import sys
from multiprocessing import process

from aioprefill.errors import WorkerStartFailed

__all__ = ["GUARD_FIX", "missing_guard_hint", "refuse_while_bootstrapping"]

GUARD_FIX = 'put the code that starts the Engine under `if __name__ == "__main__":`'
_WHY = "workers start with spawn, which re-imports the main module in each worker"


def refuse_while_bootstrapping() -> None:
    """Raise `WorkerStartFailed` if this process is a child that multiprocessing is still
    preparing (re-importing the parent's main module): starting workers from here cannot work."""
    if getattr(process.current_process(), "_inheriting", False):
        raise WorkerStartFailed(
            "an Engine was started while multiprocessing was still bootstrapping this process "
            f"(the main module, re-imported in a worker): {_WHY}; {GUARD_FIX}"
        )


def missing_guard_hint() -> str:
    """A sentence naming the main module when its source has no `__main__` guard, else ''."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path or not str(path).endswith(".py"):
        return ""  # interactive, `python -c`, a frozen app: nothing is re-imported
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return ""
    if any(_is_main_guard(node) for node in tree.body):
        return ""
    return f"; the main module {path} has no main guard, and {_WHY}: {GUARD_FIX}"


def _is_main_guard(node: ast.stmt) -> bool:
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare):
        return False
    sides = [node.test.left, *node.test.comparators]
    names = {s.id for s in sides if isinstance(s, ast.Name)}
    consts = {s.value for s in sides if isinstance(s, ast.Constant)}
    return "__name__" in names and "__main__" in consts
