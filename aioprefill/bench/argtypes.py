"""argparse value types for the benchmark's flags: each raises `ArgumentTypeError` with a
message that argparse prefixes with the flag's name."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any, NoReturn

from aioprefill.bench.prefix import CacheBudget
from aioprefill.bench.workload import LengthSpec, RateSpec, parse_rates

__all__ = [
    "EP_POLICIES",
    "POLICIES",
    "Parser",
    "cache_budgets",
    "lengths",
    "number",
    "policies",
    "rates",
]

POLICIES = ("forward", "eager", "timeout")  # the contract's policy names, in the default order
EP_POLICIES = ("forward", "ep-timer")  # with --ep: on-demand lockstep vs the fixed-rate baseline
BASELINES = ("forward-greedy",)  # forward without the fair share (policies/forward.py)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (no usage block), exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def number(lo: float, *, allow_lo: bool, kind: type = float) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"not {'an integer' if kind is int else 'a number'}: {text!r}"
            ) from None
        if not math.isfinite(value) or value < lo or (value == lo and not allow_lo):
            raise argparse.ArgumentTypeError(
                f"must be {'>=' if allow_lo else '>'} {lo:g}, got {text}"
            )
        return value

    return parse


def rates(text: str) -> list[RateSpec]:
    try:
        return parse_rates(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def lengths(text: str) -> LengthSpec:
    try:
        return LengthSpec.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def policies(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",")]
    for name in names:
        if name not in (*POLICIES, *EP_POLICIES, *BASELINES):
            raise argparse.ArgumentTypeError(
                f"unknown policy {name!r}; choose from {', '.join((*POLICIES, *BASELINES))} (or "
                f"with --ep: {', '.join(EP_POLICIES)})"
            )
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"a policy is listed twice in {text!r}")
    return names


def cache_budgets(text: str) -> list[CacheBudget]:
    try:
        out = [CacheBudget.parse(item) for item in text.split(",")]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if len({c.label for c in out}) != len(out):
        raise argparse.ArgumentTypeError(f"a budget is listed twice in {text!r}")
    return out
