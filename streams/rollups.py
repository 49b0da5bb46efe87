"""Hourly rollups per team / class / model: counts, tokens, latency percentiles and cost.

A rollup is a plain JSON-friendly dict (it is a Faust table value). Latencies go into a
log-scale histogram (buckets 2 % wide), so percentiles are mergeable, exact to within one
bucket, and identical however the events were split across restarts.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from laneway.schema import UsageEvent
from streams.records import HourlyRollup, LatencySummary
from streams.settings import Price
from streams.variance import HOUR_S

__all__ = [
    "DROPPED_STATUSES",
    "Rollup",
    "add_event",
    "new_rollup",
    "percentile",
    "to_record",
]

log = logging.getLogger(__name__)

Rollup = dict[str, Any]

DROPPED_STATUSES = ("cancelled", "superseded", "expired", "aborted", "rejected", "unsupported")
_GROWTH = 1.02
_LOG_GROWTH = math.log(_GROWTH)
_TOKENS_PER_PRICE_UNIT = 1000


def _latency_bucket(ms: float) -> int:
    return math.ceil(math.log1p(max(ms, 0.0)) / _LOG_GROWTH)


def _bucket_upper_ms(bucket: int) -> float:
    return math.expm1(bucket * _LOG_GROWTH)


def _sum(rollup: Rollup, field: str) -> float:
    """A float sum of ``rollup`` as a finite number. Usage records once could bring a NaN or
    an infinity into it (the schema refuses them now): JSON has no NaN, so its changelog
    gives it back as None. What it held is lost; it starts again from 0, said so."""
    value = rollup.get(field)
    if isinstance(value, int | float) and math.isfinite(value):
        return float(value)
    log.warning(
        "rollup %s/%s/%s hour %s had %s=%r; counted again from 0",
        rollup["team"],
        rollup["class"],
        rollup["model"],
        rollup["hour"],
        field,
        value,
    )
    rollup[field] = 0.0
    return 0.0


def new_rollup(team: str, cls: str, model: str, hour: int, partition: int) -> Rollup:
    return {
        "team": team,
        "class": cls,
        "model": model,
        "hour": hour,
        "p": partition,
        "requests": 0,
        "statuses": {},
        "prompt_tokens": 0,
        "cached_tokens": 0,
        "completion_tokens": 0,
        "engine_ms": 0.0,
        "cost": 0.0,
        "latency": {},
        "routes": {},
        "rev": 0,
        "emitted": 0,
        "closed": False,
    }


def add_event(rollup: Rollup, event: UsageEvent, price: Price) -> None:
    """Fold one usage event into its hour's rollup."""
    rollup["requests"] += 1
    statuses: dict[str, int] = rollup["statuses"]
    statuses[event.status] = statuses.get(event.status, 0) + 1
    routes: dict[str, int] = rollup["routes"]
    routes[event.route] = routes.get(event.route, 0) + 1
    rollup["prompt_tokens"] += event.prompt_tokens
    rollup["cached_tokens"] += event.cached_tokens
    rollup["completion_tokens"] += event.completion_tokens
    if math.isfinite(event.engine_ms):
        rollup["engine_ms"] = _sum(rollup, "engine_ms") + event.engine_ms
    fresh_prompt = max(event.prompt_tokens - event.cached_tokens, 0)
    charge = (
        fresh_prompt * price.prompt
        + event.cached_tokens * price.cached
        + event.completion_tokens * price.completion
    ) / _TOKENS_PER_PRICE_UNIT
    rollup["cost"] = _sum(rollup, "cost") + charge
    if event.status == "ok" and math.isfinite(event.total_ms):
        latency: dict[str, int] = rollup["latency"]
        bucket = str(_latency_bucket(event.total_ms))
        latency[bucket] = latency.get(bucket, 0) + 1
    rollup["rev"] += 1


def percentile(histogram: Mapping[str, int], q: float) -> float | None:
    """The ``q`` quantile (0–1) of a latency histogram; None when it is empty."""
    total = sum(histogram.values())
    if total == 0:
        return None
    rank = max(1, math.ceil(q * total))
    seen = 0
    for bucket in sorted(histogram, key=int):
        seen += histogram[bucket]
        if seen >= rank:
            return round(_bucket_upper_ms(int(bucket)), 3)
    return round(_bucket_upper_ms(max(int(b) for b in histogram)), 3)  # pragma: no cover


def to_record(rollup: Rollup, *, now: float, final: bool = True) -> HourlyRollup:
    """The rollup as published: ``final`` once its hour has closed. Its revision is twice its
    events, plus one when final: a final record outranks a provisional one of the same
    events, one of more events outranks both, and two records of one revision say the same.
    (Events plus one, as before, let a provisional record tie with a final one of an event
    fewer: the app killed before its changelog kept that it had closed the hour, a late
    event re-opened it.)"""
    statuses: dict[str, int] = rollup["statuses"]
    latency: dict[str, int] = rollup["latency"]
    start = int(rollup["hour"]) * HOUR_S
    return HourlyRollup(
        team=rollup["team"],
        cls=rollup["class"],
        model=rollup["model"],
        hour=datetime.fromtimestamp(start, UTC).strftime("%Y-%m-%dT%H:00:00Z"),
        hour_start=start,
        requests=rollup["requests"],
        ok=statuses.get("ok", 0),
        errors=statuses.get("error", 0),
        dropped=sum(statuses.get(s, 0) for s in DROPPED_STATUSES),
        statuses=dict(sorted(statuses.items())),
        routes=dict(sorted(rollup["routes"].items())),
        prompt_tokens=rollup["prompt_tokens"],
        cached_tokens=rollup["cached_tokens"],
        completion_tokens=rollup["completion_tokens"],
        engine_ms=round(_sum(rollup, "engine_ms"), 3),
        latency_ms=LatencySummary(
            p50=percentile(latency, 0.50),
            p99=percentile(latency, 0.99),
            p999=percentile(latency, 0.999),
        ),
        cost=round(_sum(rollup, "cost"), 6),
        revision=2 * rollup["rev"] + (1 if final else 0),
        final=final,
        ts=now,
    )
