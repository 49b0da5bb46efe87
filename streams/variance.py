"""Rolling usage variance → the dynamic quota factor of a team.

The factor is ``1 + min(0.5·σ, 0.3)`` where σ is the standard deviation of the team's hourly
utilisation over the last 24 complete hours (utilisation = tokens in the hour / the team's
hourly budget). Hours without usage count as utilisation 0: an idle hour is part of the
team's variability, and without it a team that works in bursts would look steady.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from quota.teams import Team

__all__ = [
    "HOUR_S",
    "MAX_FACTOR_BONUS",
    "WINDOW_HOURS",
    "UtilisationStats",
    "hour_of",
    "hourly_budget",
    "quota_factor",
    "utilisation_stats",
]

HOUR_S = 3600
WINDOW_HOURS = 24
BUDGET_UNITS_PER_MEMBER = 50
SIGMA_WEIGHT = 0.5
MAX_FACTOR_BONUS = 0.3


def hour_of(ts: float) -> int:
    """Epoch hour (hours since 1970) that ``ts`` falls in."""
    return int(ts // HOUR_S)


def hourly_budget(team: Team, unit_tokens: int) -> float:
    """Tokens per hour: team size × 50 × complexity budget units."""
    return team.size * BUDGET_UNITS_PER_MEMBER * team.complexity * unit_tokens


@dataclass(frozen=True, slots=True)
class UtilisationStats:
    mean: float
    sigma: float
    hours: int
    factor: float


def quota_factor(sigma: float) -> float:
    return 1.0 + min(SIGMA_WEIGHT * sigma, MAX_FACTOR_BONUS)


def utilisation_stats(
    tokens_by_hour: Mapping[int, float], budget: float, current_hour: int
) -> UtilisationStats:
    """Mean and population σ of the 24 complete hours before ``current_hour``."""
    hours = range(current_hour - WINDOW_HOURS, current_hour)
    values = [tokens_by_hour.get(hour, 0.0) / budget for hour in hours]
    mean = sum(values) / len(values)
    sigma = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
    return UtilisationStats(mean=mean, sigma=sigma, hours=len(values), factor=quota_factor(sigma))
