"""Types of the command line's numbers: argparse answers a value outside them with a usage
error that names the option (exit 2), as it does for one that is not a number at all."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

__all__ = ["finite_float", "int_from", "positive_float"]


def finite_float(text: str) -> float:
    """A float that is a number: ``nan`` and ``inf`` parse as floats, and then pass every
    ``<= 0`` check (nan) or never end (a drill of inf seconds)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"not a finite number: {text!r}")
    return value


def int_from(low: int, high: int) -> Callable[[str], int]:
    """An int from ``low`` to ``high``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is not from {low} to {high}")
        return value

    parse.__name__ = f"int from {low} to {high}"
    return parse


def positive_float(text: str) -> float:
    """A finite number above 0 (a time to wait: 0 or less gives up before it begins)."""
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value:g} is not above 0")
    return value
