"""What the streams app writes: hourly rollups and control events (see docs/streams.md)."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from laneway.constants import RequestClass

__all__ = [
    "BreakerTransition",
    "HourlyRollup",
    "LatencySummary",
    "QuotaFactorUpdate",
]


class _Record(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True, frozen=True)

    def to_json(self) -> bytes:
        return self.model_dump_json(by_alias=True).encode()


class LatencySummary(_Record):
    p50: float | None = None
    p99: float | None = None
    p999: float | None = None


class HourlyRollup(_Record):
    """One (team, class, model, hour) on ``laneway.usage.hourly``, keyed by team.

    ``revision`` counts the events folded in, plus one once the hour has closed: of two
    records for the same key, the one with the higher revision is the more complete.
    ``final`` is false while the hour is still open (a provisional record).
    """

    v: Literal[1] = 1
    team: str
    cls: RequestClass = Field(alias="class")
    model: str
    hour: str = Field(description="start of the hour, ISO 8601 UTC")
    hour_start: int = Field(description="start of the hour, epoch seconds")
    requests: int
    ok: int
    errors: int
    dropped: int
    statuses: dict[str, int]
    routes: dict[str, int]
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    engine_ms: float
    latency_ms: LatencySummary
    cost: float
    revision: int
    # Records written before provisional rollups existed were all final.
    final: bool = True
    ts: float = Field(default_factory=time.time)


class BreakerTransition(_Record):
    """A breaker level change on ``laneway.control``, keyed by ``subject``."""

    v: Literal[1] = 1
    kind: Literal["breaker"] = "breaker"
    subject: str
    route: str
    team: str | None = None
    level: int = Field(ge=0, le=3)
    previous: int = Field(ge=0, le=3)
    rate: float
    requests: int
    since: float
    ts: float = Field(default_factory=time.time)

    def summary(self) -> str:
        who = self.route + (f" (team {self.team})" if self.team else "")
        return (
            f"laneway breaker: {who} at level {self.level} "
            f"(error rate {self.rate:.1%} over {self.requests} requests)"
        )


class RouteStats(_Record):
    """One route's traffic in a canary step: requests, errors and P99 of the successful."""

    requests: int
    errors: int
    error_rate: float
    p99_ms: float | None = None


class CanaryChange(_Record):
    """A canary that moved (next step, promoted, rolled back) on ``laneway.control``."""

    v: Literal[1] = 1
    kind: Literal["canary"] = "canary"
    subject: str
    model: str
    target: str
    status: str
    weight: float
    previous_weight: float
    reason: str = ""
    canary: RouteStats | None = None
    stable: RouteStats | None = None
    ts: float = Field(default_factory=time.time)

    def summary(self) -> str:
        if self.status == "rolled_back":
            return f"laneway canary: {self.model} → {self.target} rolled back ({self.reason})"
        return f"laneway canary: {self.model} → {self.target} at {self.weight:g} % ({self.status})"


class QuotaFactorUpdate(_Record):
    """A team's new dynamic quota factor on ``laneway.control``, keyed by ``subject``."""

    v: Literal[1] = 1
    kind: Literal["quota_factor"] = "quota_factor"
    subject: str
    team: str
    factor: float
    sigma: float
    mean: float
    hours: int
    ts: float = Field(default_factory=time.time)
