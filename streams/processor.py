"""Folds each usage event into the tables, and turns the tables into decisions on timers.

One ``UsageProcessor`` per streams process. ``handle`` runs inside the Faust agent (one event
at a time, in offset order per partition); the ``evaluate_breakers``, ``publish_rollups`` and
``update_quota_factors`` coroutines run on timers. Tables hold everything that must survive a
restart; the processor's own attributes are caches rebuilt from the tables (and, for breaker
levels, from Redis) when the process starts. The time each event counts at, and the clocks
that close hours, are decided in ``streams.event_time``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import orjson
import redis.asyncio as aioredis

from laneway.constants import RedisKeys
from laneway.errors import LanewayError, MalformedMessage
from laneway.schema import UsageEvent, decode
from quota.model import QuotaPolicy, pool_of
from quota.teams import get_team
from streams.announce import BREAKER_STATE_TTL_S, Announcer, BreakerSubject
from streams.breaker import (
    BreakerPolicy,
    BreakerState,
    add_outcome,
    next_state,
    route_counts,
    window_counts,
)
from streams.canary import CanaryWatch
from streams.dedupe import UsageIds
from streams.event_time import RETENTION_HOURS, EventTimes, as_live
from streams.metrics import EVENTS
from streams.records import BreakerTransition, HourlyRollup
from streams.rollups import add_event, new_rollup, to_record
from streams.settings import StreamsSettings
from streams.shadow import ShadowWatch
from streams.tables import (
    already_applied,
    delete_outside_stream,
    mark_applied,
    put_outside_stream,
)
from streams.types import ChangelogTable, SendRecord
from streams.variance import HOUR_S, hour_of, utilisation_stats

__all__ = ["ProcessorCounters", "UsageProcessor"]

log = logging.getLogger(__name__)

# What the breaker counts: served, failed in the engine, refused by the engine for what the
# request asked (its team's doing); drops (cancelled, superseded, expired), and refusals of
# what the route's engine has not (unsupported: an IDE's suffix on the vllm engine), say
# nothing.
_COUNTED_STATUSES = ("ok", "error", "rejected")
# ...and of which classes: the ingress gates completions and chats by the breaker levels, and
# batch never (its lines go to their own pool's engines). A failing batch engine, or a team's
# over-long batch lines, must not send everyone's IDE traffic to the fallback.
_GATED_CLASSES = ("completion", "chat")


def _billable(event: UsageEvent) -> UsageEvent:
    """``event`` if it can be billed as it says: its ``ts`` written (a default would be the
    time it is read, another hour on a re-read after a restart: counted twice), and no more
    cached tokens than prompt tokens."""
    if "ts" not in event.model_fields_set:
        raise MalformedMessage("bad UsageEvent record: ts: missing")
    if event.cached_tokens > event.prompt_tokens:
        raise MalformedMessage(
            f"bad UsageEvent record: cached_tokens: {event.cached_tokens} is more than "
            f"prompt_tokens ({event.prompt_tokens})"
        )
    return event


@dataclass
class ProcessorCounters:
    events: int = 0
    malformed: int = 0
    replayed: int = 0
    repeated: int = 0  # a request's second usage event (a worker's re-run)
    too_old: int = 0  # stored before the hours kept: not counted
    restamped: int = 0  # counted when the broker stored it, its own time unusable
    published: int = 0


def rollup_key(team: str, cls: str, model: str, hour: int) -> str:
    return orjson.dumps([team, cls, model, hour]).decode()


def outcome_key(route: str, team: str) -> str:
    return orjson.dumps([route, team]).decode()


class UsageProcessor:
    def __init__(
        self,
        settings: StreamsSettings,
        *,
        rollups: ChangelogTable,
        outcomes: ChangelogTable,
        announcer: Announcer,
        redis: aioredis.Redis,
        keys: RedisKeys,
        send: SendRecord,
        ids: UsageIds | None = None,
        canary: CanaryWatch | None = None,
        shadow: ShadowWatch | None = None,
        clock: Callable[[], float] = time.time,
        owned: Callable[[], Collection[int] | None] = lambda: None,
    ) -> None:
        self.settings = settings
        # The usage partitions this instance holds now (None: all of them, as in a test).
        self.owned = owned
        self.policy = BreakerPolicy.from_settings(settings)
        self.quota = QuotaPolicy.from_settings(settings)
        self.rollups = rollups
        self.outcomes = outcomes
        self.announcer = announcer
        self.redis = redis
        self.keys = keys
        self.send = send
        self.ids = ids
        self.canary = canary
        self.shadow = shadow
        self.clock = clock
        self.hourly_topic = settings.topics.usage_hourly
        self.counters = ProcessorCounters()
        self.states: dict[BreakerSubject, BreakerState] = {}
        # team → (factor, σ, mean) last announced, to six places
        self.factors: dict[str, tuple[float, float, float]] = {}
        # Rollups with events not yet published; rebuilt from the table on the first flush.
        self._pending: set[str] = set()
        self._indexed = False
        self._provisional_at: dict[str, float] = {}  # rollup key → its last provisional record
        # Both start on their first tick, not here: the app's clock is synced to Redis's only
        # once it starts, and a machine's clock ahead of Redis's would hold back the first
        # refresh of the raised levels by as much as it is ahead, past their TTL.
        self.times = EventTimes()
        self._refreshed = float("-inf")  # levels a restart read back are rewritten at once

    # -- in the agent ------------------------------------------------------------------------

    def handle(
        self, raw: bytes | None, partition: int, offset: int, stored_at: float | None = None
    ) -> None:
        """Fold one ``laneway.usage`` record; a malformed one is logged, counted and skipped.
        ``stored_at``: when the broker stored it (its topics keep the broker's time)."""
        now = self.clock()
        try:
            event = _billable(decode(UsageEvent, raw, strict=True))
        except MalformedMessage as exc:
            self.counters.malformed += 1
            EVENTS.labels("malformed").inc()
            log.warning("skipping usage record at %d/%d: %s", partition, offset, exc)
            return
        self.times.read(partition, event.ts, stored_at, now)
        at = self.times.restamped_at(event, partition, offset, stored_at, now)
        if at is not None:
            self.counters.restamped += 1
            event = event.model_copy(update={"ts": at})
        if self.times.too_old(event, partition, offset, now):
            self.counters.too_old += 1
            EVENTS.labels("too_old").inc()
            return
        if self.ids is not None and self.ids.repeat(event, partition, offset, now):
            # A worker's re-run sent it again: the request is counted once.
            self.counters.repeated += 1
            EVENTS.labels("repeated").inc()
            return
        # The sliding windows and the partition's clock take it no later than the app's
        # clock shows, give or take the clocks' error; its rollup hour is its own.
        live = as_live(event, now)
        if event.shadow:
            # A shadow route's mirror: not billed, and no quota, budget, breaker or canary
            # counts it (a bad shadow must not raise the breaker of the team it mirrors).
            EVENTS.labels("shadow").inc()
            if self.shadow is not None:
                self.shadow.fold(live)
            return
        self.times.advance(partition, live.ts, now)
        self._fold_rollup(event, partition, offset, now)
        if live.status in _COUNTED_STATUSES and live.cls in _GATED_CLASSES:
            self._fold_outcome(live, partition, offset, now)
        if self.canary is not None:
            self.canary.fold(live)
        if self.shadow is not None:
            self.shadow.fold(live)
        self.counters.events += 1  # once folded: a fold that raises is not counted here
        EVENTS.labels("folded").inc()

    def _fold_rollup(self, event: UsageEvent, partition: int, offset: int, now: float) -> None:
        hour = hour_of(event.ts)
        key = rollup_key(event.team, event.cls, event.model, hour)
        value: dict[str, Any] = self.rollups.get(key) or new_rollup(
            event.team, event.cls, event.model, hour, partition
        )
        if already_applied(value, partition, offset):
            self.counters.replayed += 1
            return
        add_event(value, event, self.settings.price_of(event.route))
        mark_applied(value, partition, offset)
        self.rollups[key] = value
        self._pending.add(key)

    def _fold_outcome(self, event: UsageEvent, partition: int, offset: int, now: float) -> None:
        key = outcome_key(event.route, event.team)
        value: dict[str, Any] = self.outcomes.get(key) or {"b": {}}
        if already_applied(value, partition, offset):
            return
        counted = add_outcome(
            value["b"],
            event.ts,
            error=event.status == "error",
            rejected=event.status == "rejected",
            now=now,
            policy=self.policy,
        )
        if counted:
            mark_applied(value, partition, offset)
            self.outcomes[key] = value

    # -- on timers ---------------------------------------------------------------------------

    async def restore_levels(self) -> None:
        """Take over the raised levels a previous run stored, so a restart keeps them."""
        for stored in await self.announcer.stored_levels():
            self.states[stored.subject] = stored.state
            log.info("breaker %s: level %d restored", stored.subject, stored.state.level)

    async def forget_ids(self) -> int:
        """Request ids past the de-duplication window leave its table."""
        return await self.ids.expire(self.clock()) if self.ids is not None else 0

    async def evaluate_breakers(self) -> list[BreakerTransition]:
        now = self.clock()
        totals: dict[BreakerSubject, tuple[int, float]] = {}
        by_route: dict[str, list[tuple[int, int]]] = {}
        for key, value in list(self.outcomes.items()):
            requests, errors, rejected = window_counts(value["b"], now, self.policy)
            if requests == 0:
                # Its window has passed: gone from the table, and from its changelog (any
                # writer of usage can name a route; its key must not stay for ever). Not
                # from the changelog of a partition another instance holds now: its owner
                # may have written the key since, and a delete after that would lose it.
                self.outcomes.data.pop(key, None)
                owned = self.owned()
                for partition in map(int, value.get("o", {})):
                    if owned is None or partition in owned:
                        delete_outside_stream(self.outcomes, key, partition)
                continue
            route, team = orjson.loads(key)
            # The team's own level: every failure of its requests, refusals included.
            totals[(route, team)] = (requests, errors + rejected)
            # The route's: engine errors of requests the engine took, across teams.
            by_route.setdefault(route, []).append((requests - rejected, errors))
        for route, per_team in by_route.items():
            totals[(route, None)] = route_counts(per_team, self.policy.min_requests)
        raised = {subject for subject, state in self.states.items() if state.level > 0}
        blind = self.times.reading_backlog(now, self.policy.window_s, levels_raised=bool(raised))
        transitions: list[BreakerTransition] = []
        for subject in set(totals) | raised:
            requests, failures = totals.get(subject, (0, 0.0))
            old = self.states.get(subject, BreakerState())
            new = next_state(old, requests, failures, now, self.policy, blind=blind)
            if new.level != old.level:
                transitions.append(await self.announcer.breaker_changed(subject, old, new))
            if new.level == 0 and requests == 0:
                self.states.pop(subject, None)
            else:
                self.states[subject] = new
        if not 0 <= now - self._refreshed < BREAKER_STATE_TTL_S / 4:  # or the clock went back
            self._refreshed = now
            for subject, state in self.states.items():
                if state.level > 0:
                    await self.announcer.store_level(subject, state)
        return transitions

    @staticmethod
    def _closed(value: dict[str, Any]) -> bool:
        """Whether the hour's final record went out (values written before provisional
        rollups existed say so by having published every event)."""
        return bool(value.get("closed", value["rev"] > 0 and value["emitted"] >= value["rev"]))

    def _due(self, value: dict[str, Any], now: float) -> bool:
        """An hour is published once its partition's events passed its end plus the grace,
        or once that partition has been idle and the wall clock passed it."""
        if self._closed(value):
            return True  # a late event: its hour goes out again, final
        closes = (int(value["hour"]) + 1) * HOUR_S + self.settings.rollup_grace_s
        return self.times.passed(int(value["p"]), closes, now, self.settings.rollup_idle_s)

    def _provisional_due(self, key: str, value: dict[str, Any], now: float) -> bool:
        """An open hour goes out every ``LANEWAY_ROLLUP_PROVISIONAL_S`` while it changes."""
        every = self.settings.rollup_provisional_s
        if every <= 0 or value["rev"] <= value["emitted"]:
            return False
        return now - self._provisional_at.get(key, float("-inf")) >= every

    def reindex(self) -> None:
        """Partitions were assigned: the hours their changelogs bring (folded by their
        previous owner, maybe not published in full) are looked at by the next publish,
        which comes only once they are recovered. Only the hours this process folds itself
        were, after its first publish: a handed-over hour that got no later event was never
        published final, and the cost report counts final hours only."""
        self._indexed = False

    async def publish_rollups(self) -> int:
        """Publish the closed hours with unpublished events (final) and the open hours that
        changed since their last provisional record; returns how many records went out."""
        now = self.clock()
        self.times.begin(now)
        if not self._indexed:
            self._indexed = True
            self._pending.update(
                key
                for key, value in self.rollups.items()
                if value["emitted"] < value["rev"] or not self._closed(value)
            )
        due: list[tuple[str, HourlyRollup]] = []
        for key in sorted(self._pending):
            value = self.rollups.data.get(key)
            if value is None:
                self._pending.discard(key)
                self._provisional_at.pop(key, None)
            elif self._due(value, now):
                due.append((key, to_record(value, now=now, final=True)))
            elif self._provisional_due(key, value, now):
                due.append((key, to_record(value, now=now, final=False)))
        # The agent keeps folding while the records are on their way, so each hour is marked
        # with the events its record carries, not the table's, and stays pending if it grew.
        # Marked only once delivered: a crash in between publishes the hour again, never loses it.
        await asyncio.gather(
            *(self.send(self.hourly_topic, r.team.encode(), r.to_json()) for _, r in due)
        )
        for key, record in due:
            value = self.rollups.data.get(key)
            if value is None:
                continue
            value["emitted"] = max(value["emitted"], record.requests)
            value["closed"] = record.final  # a provisional record goes out for open hours only
            if not record.final:
                self._provisional_at[key] = now
            put_outside_stream(self.rollups, key, value, int(value["p"]))
            if self._closed(value) and value["emitted"] >= value["rev"]:
                self._pending.discard(key)
                self._provisional_at.pop(key, None)
        published = len(due)
        oldest = hour_of(now) - RETENTION_HOURS
        for key, value in list(self.rollups.items()):
            if value["hour"] < oldest and key not in self._pending:
                delete_outside_stream(self.rollups, key, int(value["p"]))
        self.counters.published += published
        return published

    async def update_quota_factors(self) -> int:
        """Recompute every team's factor; write and announce the ones whose factor, σ or mean
        changed. σ and mean count too: a capped factor (1.3) stays put while σ moves, and an
        announcement must not keep the σ of part of the history (a first tick while the agent
        still folds a backlog sees only part of it). In steady traffic the 24 h window moves once
        an hour, so a capped team gets about one more announcement an hour; while a backlog or
        late usage is folded, each tick that moves σ or the mean sends one. A factor Redis
        lost since it was announced is written again (not announced: nothing changed)."""
        now = self.clock()
        tokens: dict[str, dict[int, float]] = {}
        for value in list(self.rollups.data.values()):
            by_hour = tokens.setdefault(value["team"], {})
            if pool_of(value["class"]) != "interactive":
                # Measured against the interactive budget, the factor counts interactive use
                # alone: a nightly batch (its own pool) would make steady typing look bursty.
                continue
            hour = int(value["hour"])
            by_hour[hour] = by_hour.get(hour, 0.0) + value["prompt_tokens"]
            by_hour[hour] += value["completion_tokens"]
        changed = 0
        unchanged: dict[str, float] = {}
        for team, by_hour in sorted(tokens.items()):
            try:
                record = await get_team(self.redis, self.keys, team)
            except LanewayError as exc:
                log.warning("team %s has an unusable record, factor left as is: %s", team, exc)
                continue
            budget = self.quota.base_tokens(record, "interactive")
            stats = utilisation_stats(by_hour, budget, hour_of(now))
            announced = (round(stats.factor, 6), round(stats.sigma, 6), round(stats.mean, 6))
            if self.factors.get(team) == announced:
                unchanged[team] = stats.factor
                continue
            await self.announcer.quota_factor(team, stats)
            self.factors[team] = announced
            changed += 1
        # Announced once, a factor lives in Redis with no expiry: one lost there (a failover,
        # a lost AOF second) would read as 1 until the factor moved, hours later.
        await self.announcer.restore_factors(unchanged)
        return changed
