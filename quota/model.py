"""The quota model: hourly budgets per team and pool, and the dynamic factor.

``base = team_size * units_per_member * complexity`` units per hour (a unit is
``unit_tokens`` tokens), times the dynamic factor ``1 + min(0.5 * sigma, 0.3)`` where sigma is the
standard deviation of the team's hourly interactive utilisation (completion and chat tokens
against the interactive budget) over the last 24 h. Interactive
(completion + chat) and batch are separate pools, so batch can never drain interactive.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

from laneway.constants import RequestClass
from laneway.settings import CommonSettings
from quota.teams import Team

__all__ = [
    "FACTOR_CAP",
    "Pool",
    "QuotaPolicy",
    "Utilisation",
    "dynamic_factor",
    "pool_of",
    "utilisation",
    "utilisation_sigma",
]

Pool = Literal["interactive", "batch"]
FACTOR_CAP = 0.3


def pool_of(cls: RequestClass) -> Pool:
    return "batch" if cls == "batch" else "interactive"


def dynamic_factor(sigma: float) -> float:
    """``1 + min(0.5 * sigma, 0.3)``: bursty teams get headroom, capped at +30 %."""
    if sigma < 0 or math.isnan(sigma):
        return 1.0
    return 1.0 + min(0.5 * sigma, FACTOR_CAP)


@dataclass(frozen=True, slots=True)
class Utilisation:
    """Mean and population σ of a team's hourly utilisation, and the factor σ gives."""

    mean: float
    sigma: float
    hours: int
    factor: float


def utilisation(hourly_tokens: Sequence[float], hourly_budget: float) -> Utilisation:
    """Utilisation (tokens / budget) of each hour, its mean, σ and the dynamic factor."""
    if not hourly_tokens or hourly_budget <= 0:
        return Utilisation(mean=0.0, sigma=0.0, hours=len(hourly_tokens), factor=1.0)
    values = [t / hourly_budget for t in hourly_tokens]
    mean = sum(values) / len(values)
    sigma = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
    return Utilisation(mean=mean, sigma=sigma, hours=len(values), factor=dynamic_factor(sigma))


def utilisation_sigma(hourly_tokens: Sequence[float], hourly_budget: float) -> float:
    """Population standard deviation of hourly utilisation (tokens / budget)."""
    return utilisation(hourly_tokens, hourly_budget).sigma


@dataclass(frozen=True, slots=True)
class QuotaPolicy:
    unit_tokens: int = 1000
    units_per_member: float = 50.0
    batch_ratio: float = 1.0
    offpeak: str = "22:00-06:00"
    borrow_reserve: float = 0.3
    min_charge_tokens: int = 16
    max_excess: float = 1.0

    @classmethod
    def from_settings(cls, settings: CommonSettings) -> QuotaPolicy:
        return cls(
            unit_tokens=settings.quota_unit_tokens,
            units_per_member=settings.quota_units_per_member,
            batch_ratio=settings.quota_batch_ratio,
            offpeak=settings.quota_offpeak,
            borrow_reserve=settings.quota_borrow_reserve,
            min_charge_tokens=settings.quota_min_charge_tokens,
            max_excess=settings.quota_max_excess,
        )

    def base_tokens(self, team: Team, pool: Pool) -> float:
        """Hourly budget in tokens before the dynamic factor (the interactive budget is also
        what the streams app measures a team's utilisation against)."""
        base = team.size * self.units_per_member * team.complexity * self.unit_tokens
        return base * self.batch_ratio if pool == "batch" else base

    def budget_tokens(self, team: Team, pool: Pool, factor: float = 1.0) -> float:
        return self.base_tokens(team, pool) * factor

    def in_offpeak(self, when: datetime | None = None) -> bool:
        if not self.offpeak:
            return False
        when = when or datetime.now(UTC)
        start_s, end_s = self.offpeak.split("-")
        start = int(start_s[:2]) * 60 + int(start_s[3:])
        end = int(end_s[:2]) * 60 + int(end_s[3:])
        minute = when.hour * 60 + when.minute
        if start <= end:
            return start <= minute < end
        return minute >= start or minute < end
