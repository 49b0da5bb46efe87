"""Rolling usage variance → the dynamic quota factor of a team.

The rule itself (utilisation = tokens in an hour / the team's hourly interactive budget, the
factor ``1 + min(0.5·σ, 0.3)``) lives in quota/model.py, where the ingress reads budgets from;
this module only picks the window: the 24 complete hours before the current one. Hours without
usage count as utilisation 0: an idle hour is part of the team's variability, and without it a
team that works in bursts would look steady.
"""

from __future__ import annotations

from collections.abc import Mapping

from quota.model import Utilisation, utilisation

__all__ = ["HOUR_S", "WINDOW_HOURS", "hour_of", "utilisation_stats"]

HOUR_S = 3600
WINDOW_HOURS = 24


def hour_of(ts: float) -> int:
    """Epoch hour (hours since 1970) that ``ts`` falls in."""
    return int(ts // HOUR_S)


def utilisation_stats(
    tokens_by_hour: Mapping[int, float], budget: float, current_hour: int
) -> Utilisation:
    """Mean, population σ and factor of the 24 complete hours before ``current_hour``."""
    hours = range(current_hour - WINDOW_HOURS, current_hour)
    return utilisation([tokens_by_hour.get(hour, 0.0) for hour in hours], budget)
