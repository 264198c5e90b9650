"""Optional dependencies imported on first use, failing with the extra to install."""

from __future__ import annotations

import importlib
from typing import Any

from aioprefill.errors import InvalidConfig

__all__ = ["import_optional"]


def import_optional(module: str, extra: str) -> Any:
    """Import an optional dependency, or raise `InvalidConfig` naming the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise InvalidConfig(
            f"aioprefill needs the {module!r} package, not installed here: "
            f"pip install 'aioprefill[{extra}]'"
        ) from exc
