"""Streams app (Faust): usage rollups, rolling variance → quota factors, error rates → breaker.

The names below are imported when first used: ``python -m streams`` imports this package
before its first line runs, and handles SIGTERM from that line on (``streams.stop_signals``),
so the package itself imports nothing heavy (pydantic's settings took about half a second)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from streams.breaker import BreakerPolicy, BreakerState, next_state
    from streams.records import BreakerTransition, HourlyRollup, QuotaFactorUpdate
    from streams.settings import StreamsSettings
    from streams.variance import utilisation_stats

__all__ = [
    "BreakerPolicy",
    "BreakerState",
    "BreakerTransition",
    "HourlyRollup",
    "QuotaFactorUpdate",
    "StreamsSettings",
    "next_state",
    "utilisation_stats",
]

_HOMES = {
    "BreakerPolicy": "streams.breaker",
    "BreakerState": "streams.breaker",
    "next_state": "streams.breaker",
    "BreakerTransition": "streams.records",
    "HourlyRollup": "streams.records",
    "QuotaFactorUpdate": "streams.records",
    "StreamsSettings": "streams.settings",
    "utilisation_stats": "streams.variance",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'streams' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
