"""Where the streams app's decisions go: Redis (read by the ingress and the quota code) and
``laneway.control`` (read by anyone), plus the on-call webhook for serious breaker levels."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import orjson
import redis.asyncio as aioredis

from laneway.constants import RedisKeys
from laneway.metrics import BREAKER_LEVEL, team_label
from quota.model import Utilisation
from streams.breaker import BreakerState
from streams.metrics import BREAKER_TEAM_LEVEL, QUOTA_FACTOR
from streams.oncall import OnCallWebhook
from streams.records import BreakerTransition, QuotaFactorUpdate
from streams.types import SendRecord

__all__ = ["BREAKER_STATE_TTL_S", "Announcer", "BreakerSubject", "StoredLevel"]

log = logging.getLogger(__name__)

# A breaker level outlives a dead streams app by at most this long, then the ingress fails
# open (level 0); a live app rewrites every raised level well within it.
BREAKER_STATE_TTL_S = 600
ONCALL_LEVEL = 2

BreakerSubject = tuple[str, str | None]  # (route, team or None for the whole route)


class StoredLevel:
    """A breaker state read back from Redis at start-up."""

    def __init__(self, subject: BreakerSubject, state: BreakerState) -> None:
        self.subject = subject
        self.state = state


def subject_name(subject: BreakerSubject) -> str:
    route, team = subject
    return f"breaker:{route}" if team is None else f"breaker:{route}:{team}"


class Announcer:
    def __init__(
        self,
        redis: aioredis.Redis,
        keys: RedisKeys,
        control_topic: str,
        send: SendRecord,
        webhook: OnCallWebhook,
        *,
        cooldown_s: float,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.control_topic = control_topic
        self.send = send
        self.webhook = webhook
        self.cooldown_s = cooldown_s
        # Raised levels of teams past the label bound, by route: their shared series' value.
        self._unlabelled: dict[str, dict[str, int]] = {}

    async def breaker_changed(
        self, subject: BreakerSubject, old: BreakerState, new: BreakerState
    ) -> BreakerTransition:
        route, team = subject
        transition = BreakerTransition(
            subject=subject_name(subject),
            route=route,
            team=team,
            level=new.level,
            previous=old.level,
            rate=round(new.rate, 6),
            requests=new.requests,
            since=new.since,
        )
        log.warning(
            "breaker %s: level %d → %d (error rate %.1f%% over %d requests)",
            transition.subject,
            old.level,
            new.level,
            new.rate * 100,
            new.requests,
        )
        await self.store_level(subject, new)
        await self.send(self.control_topic, transition.subject.encode(), transition.to_json())
        if new.level >= ONCALL_LEVEL and new.level > old.level:
            self.webhook.notify(transition)
        return transition

    async def store_level(self, subject: BreakerSubject, state: BreakerState) -> None:
        route, team = subject
        if team is None:
            BREAKER_LEVEL.labels(route).set(state.level)
        else:
            self._team_level(route, team, state.level)
        payload = {
            "level": state.level,
            "rate": round(state.rate, 6),
            "since": state.since,
            "requests": state.requests,
            "route": route,
            "team": team,
            "cooldown_s": self.cooldown_s,
        }
        await self.redis.set(
            self.keys.breaker(route, team), orjson.dumps(payload), ex=BREAKER_STATE_TTL_S
        )

    def _team_level(self, route: str, team: str, level: int) -> None:
        """A team's raised level as a series of its own (an alert's and a dashboard's: a
        team shut out with 503s while its route is fine shows nowhere else); gone at level
        0. Teams past the label bound share the series ``other``: it shows the highest of
        theirs."""
        label = team_label(team)
        if label != team:
            levels = self._unlabelled.setdefault(route, {})
            levels[team] = level
            if level == 0:
                del levels[team]
            level = max(levels.values(), default=0)
        if level > 0:
            BREAKER_TEAM_LEVEL.labels(route, label).set(level)
        else:
            with contextlib.suppress(KeyError):
                BREAKER_TEAM_LEVEL.remove(route, label)

    async def stored_levels(self) -> list[StoredLevel]:
        """Raised levels a previous run left in Redis: a restart must not reset them to 0."""
        found: list[StoredLevel] = []
        pattern = f"{self.keys.prefix}:breaker:*"
        keys = [key async for key in self.redis.scan_iter(match=pattern, count=500)]
        for key, raw in zip(keys, await self.redis.mget(keys) if keys else [], strict=True):
            for stored in _parse_level(key, raw):
                found.append(stored)
        return found

    async def quota_factor(self, team: str, stats: Utilisation) -> None:
        await self.redis.set(self.keys.quota_factor(team), _factor_text(stats.factor))
        QUOTA_FACTOR.labels(team_label(team)).set(stats.factor)
        update = QuotaFactorUpdate(
            subject=f"quota:{team}",
            team=team,
            factor=round(stats.factor, 6),
            sigma=round(stats.sigma, 6),
            mean=round(stats.mean, 6),
            hours=stats.hours,
        )
        await self.send(self.control_topic, update.subject.encode(), update.to_json())
        log.info(
            "quota factor of %s: %.3f (σ %.3f, mean utilisation %.3f)",
            team,
            stats.factor,
            stats.sigma,
            stats.mean,
        )

    async def restore_factors(self, factors: dict[str, float]) -> None:
        """Write again the factors Redis no longer holds as announced (a failover to a replica
        the write had not reached, an AOF that lost its last second, a hand's DEL): the
        ingress would read a missing factor as 1 and hold a bursty team to its plain budget
        until the factor next moved."""
        teams = sorted(factors)
        if not teams:
            return
        stored = await self.redis.mget([self.keys.quota_factor(team) for team in teams])
        for team, raw in zip(teams, stored, strict=True):
            text = _factor_text(factors[team])
            found = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
            if found != text:
                await self.redis.set(self.keys.quota_factor(team), text)
                log.warning(
                    "quota factor of %s was %s in Redis, not %s as announced; written again",
                    team,
                    "missing" if found is None else repr(found),
                    text,
                )


def _factor_text(factor: float) -> str:
    return f"{factor:.6f}"


def _parse_level(key: bytes | str, raw: bytes | str | None) -> Iterator[StoredLevel]:
    if raw is None:
        return
    try:
        data = orjson.loads(raw)
        subject: BreakerSubject = (str(data["route"]), data.get("team"))
        state = BreakerState(
            level=int(data["level"]),
            since=float(data["since"]),
            rate=float(data.get("rate", 0.0)),
            requests=int(data.get("requests", 0)),
        )
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        log.warning("ignoring unreadable breaker state %r: %s", key, exc)
        return
    if state.level > 0:
        yield StoredLevel(subject, state)
