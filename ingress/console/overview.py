"""What the console's pages show, gathered from Redis (teams, budgets, breaker levels, worker
heartbeats), from this replica's prober and from the console's Kafka feed."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from ingress.admin import team_budget
from ingress.console.feed import ConsoleFeed, ControlRecord, Rollup
from ingress.console.plots import Series, hourly_chart
from ingress.state import IngressState
from laneway.constants import HEARTBEAT_TTL_S, POOLS

__all__ = [
    "PoolView",
    "Rollup",
    "UsageRow",
    "breaker_levels",
    "pools",
    "probes",
    "recent_changes",
    "team_charts",
    "teams",
    "usage_rows",
]

log = logging.getLogger(__name__)

HOUR_S = 3600
_DROPPED = ("cancelled", "superseded", "expired", "aborted", "rejected", "unsupported")


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


async def teams(state: IngressState) -> list[dict[str, Any]]:
    """Every known team with its budget snapshot (the admin API's ``GET /admin/teams/T``)."""
    names = sorted(_text(n) for n in await state.redis.smembers(state.keys.teams()))
    return [await team_budget(state, name) for name in names]


async def breaker_levels(state: IngressState) -> list[dict[str, Any]]:
    """Breaker states the streams app stored, per route and per (route, team), highest first."""
    levels: list[dict[str, Any]] = []
    pattern = state.keys.breaker("*").replace(":route:*", ":*")
    async for name in state.redis.scan_iter(pattern, count=500):
        raw = await state.redis.get(name)
        try:
            data = orjson.loads(raw) if raw is not None else None
        except orjson.JSONDecodeError:
            log.warning("console: unreadable breaker state under %s", _text(name))
            continue
        if isinstance(data, dict) and isinstance(data.get("level"), int):
            levels.append(data)
    return sorted(levels, key=lambda d: (-d["level"], str(d.get("route")), str(d.get("team"))))


@dataclass
class PoolView:
    pool: str
    workers: list[dict[str, Any]] = field(default_factory=list)

    @property
    def live(self) -> int:
        return len(self.workers)

    @property
    def backlog(self) -> int:
        return sum(int(w.get("backlog") or 0) for w in self.workers)

    @property
    def engines(self) -> str:
        names = {
            f"{w.get('engine')} (a simulation)" if w.get("simulation") else str(w.get("engine"))
            for w in self.workers
        }
        return ", ".join(sorted(names)) or "-"

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        queries = sum(int(w.get("prefix_cache_queries") or 0) for w in self.workers)
        hits = sum(int(w.get("prefix_cache_hits") or 0) for w in self.workers)
        return hits / queries if queries else None


async def pools(state: IngressState) -> list[PoolView]:
    """Live workers per pool from their heartbeats (as ``/readyz`` counts them)."""
    now = state.clock.now()  # workers stamp their beats on Redis's clock
    views: list[PoolView] = []
    for pool in POOLS:
        view = PoolView(pool)
        raw_ids = await state.redis.zrangebyscore(
            state.keys.workers(pool), now - HEARTBEAT_TTL_S, "+inf"
        )
        ids = [i.decode() if isinstance(i, bytes) else str(i) for i in raw_ids]
        infos = await state.redis.mget([state.keys.worker_info(i) for i in ids]) if ids else []
        for worker_id, raw in zip(ids, infos, strict=True):
            try:
                beat = orjson.loads(raw) if raw is not None else {}
            except orjson.JSONDecodeError:
                beat = {}
            view.workers.append({"id": worker_id, **(beat if isinstance(beat, dict) else {})})
        views.append(view)
    return views


@dataclass(frozen=True, slots=True)
class UsageRow:
    team: str
    cls: str
    model: str
    requests: int
    tokens: int
    cost: float
    p50: float | None
    p99: float | None
    drops: dict[str, int]
    errors: int
    final: bool
    revision: int
    age_s: float


def usage_rows(feed: ConsoleFeed, hour_start: int, team: str | None = None) -> list[UsageRow]:
    """The open hour's rollups (provisional records), per team, class and model."""
    now = time.time()
    rows: list[UsageRow] = []
    for r in feed.hour(hour_start):
        if team is not None and r["team"] != team:
            continue
        statuses = r.get("statuses") or {}
        latency = r.get("latency_ms") or {}
        rows.append(
            UsageRow(
                team=r["team"],
                cls=r["class"],
                model=r["model"],
                requests=int(r.get("requests") or 0),
                tokens=int(r.get("prompt_tokens") or 0) + int(r.get("completion_tokens") or 0),
                cost=float(r.get("cost") or 0.0),
                p50=latency.get("p50"),
                p99=latency.get("p99"),
                drops={s: int(statuses[s]) for s in _DROPPED if statuses.get(s)},
                errors=int(r.get("errors") or 0),
                final=bool(r.get("final", True)),
                revision=int(r["revision"]),
                age_s=max(0.0, now - float(r.get("ts") or now)),
            )
        )
    return rows


def team_charts(feed: ConsoleFeed, team: str, current_hour: int) -> dict[str, Any]:
    """Tokens per hour and P50/P99 latency per class over the last 24 hours and the open one."""
    hours = [current_hour - HOUR_S * i for i in range(24, -1, -1)]
    index = {h: i for i, h in enumerate(hours)}
    prompt: list[float | None] = [None] * len(hours)
    completion: list[float | None] = [None] * len(hours)
    latency: dict[str, list[float | None]] = {}
    requests_by: dict[tuple[str, int], int] = {}
    for r in feed.team_hours(team):
        i = index.get(r["hour_start"])
        if i is None:
            continue
        prompt[i] = (prompt[i] or 0) + int(r.get("prompt_tokens") or 0)
        completion[i] = (completion[i] or 0) + int(r.get("completion_tokens") or 0)
        # Percentiles do not add up: per class, the busiest model's line is shown.
        ok = int(r.get("ok") or 0)
        if ok <= requests_by.get((r["class"], i), -1):
            continue
        requests_by[(r["class"], i)] = ok
        lat = r.get("latency_ms") or {}
        for q in ("p50", "p99"):
            line = latency.setdefault(f"{r['class']} {q}", [None] * len(hours))
            line[i] = lat.get(q)
    usage = hourly_chart(
        f"{team}: tokens per hour, last 24 h",
        hours,
        [Series("prompt", prompt), Series("completion", completion)],
        unit="tokens",
        bars=True,
    )
    lines = [
        Series(name, values, dashed=name.endswith("p50"))
        for name, values in sorted(latency.items())
    ]
    latency_chart = hourly_chart(
        f"{team}: latency per hour, last 24 h", hours, lines, unit="ms", bars=False
    )
    has_data = any(v is not None for v in prompt)
    return {"usage": usage, "latency": latency_chart, "has_data": has_data}


def recent_changes(feed: ConsoleFeed, limit: int = 20) -> list[ControlRecord]:
    """The newest breaker transitions on ``laneway.control``, newest first."""
    return list(reversed(feed.changes))[:limit]


def probes(state: IngressState, feed: ConsoleFeed) -> list[dict[str, Any]]:
    """The latest probe of each pool by each replica (``laneway.control``), and this
    replica's own results that the feed has not brought back yet."""
    found = [{**record.data, "pool": pool} for (pool, _), record in sorted(feed.probes.items())]
    seen = {p["pool"] for p in found if p.get("ingress") == state.settings.instance_id}
    for pool, result in sorted(state.prober.results.items()):
        if pool not in seen:
            found.append(
                {
                    "pool": pool,
                    "ok": result.ok,
                    "latency_ms": result.latency_s * 1000,
                    "ts": result.ts,
                    "ingress": state.settings.instance_id,
                    "error": result.error,
                }
            )
    return found
