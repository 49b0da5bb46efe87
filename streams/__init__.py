"""Streams app (Faust): usage rollups, rolling variance → quota factors, error rates → breaker."""

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
