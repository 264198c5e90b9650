"""Field checks shared by the validated records (`models`, `config`): each raises
`InvalidConfig` naming the field and saying why, so every message reads the same."""

from __future__ import annotations

import math

from aioprefill.errors import InvalidConfig

__all__ = ["finite_nonneg", "positive_int", "require"]


def require(ok: bool, name: str, why: str) -> None:
    if not ok:
        raise InvalidConfig(f"{name}: {why}")


def positive_int(value: object, name: str, *, allow_zero: bool = False) -> None:
    require(
        isinstance(value, int) and not isinstance(value, bool),
        name,
        f"must be an int, got {value!r}",
    )
    assert isinstance(value, int)
    require(
        value >= (0 if allow_zero else 1), name, f"must be >= {0 if allow_zero else 1}, got {value}"
    )


def finite_nonneg(value: object, name: str) -> None:
    require(
        isinstance(value, (int, float)) and not isinstance(value, bool),
        name,
        f"must be a number, got {value!r}",
    )
    assert isinstance(value, (int, float))
    require(math.isfinite(value) and value >= 0, name, f"must be finite and >= 0, got {value}")
