"""The canary's judge: each step is compared with the stable route over the same time, then
the canary moves one step on, is promoted, or is rolled back.

Usage events of a model with a running canary are kept per route (the stable route is the
model's own name; the canary's is its target) from the moment the step began. Once a step
has run ``LANEWAY_CANARY_WINDOW_S`` and the canary has served ``LANEWAY_CANARY_MIN_REQUESTS``:

- its error rate above ``max(stable × LANEWAY_CANARY_MAX_ERROR_RATIO, stable +
  LANEWAY_CANARY_ERROR_SLACK)``, or its P99 (successful requests, worker-side) above the
  stable P99 × ``LANEWAY_CANARY_MAX_P99_RATIO``: rolled back (weight 0), announced on
  ``laneway.control`` and to the on-call webhook;
- otherwise: the next step, or promoted after the last.

A step with too little traffic waits for more. Every change is written to Redis only if the
canary is still the one judged (a person may have aborted or restarted it meanwhile).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.exceptions import WatchError

from laneway.canary import CanaryState, list_canaries
from laneway.constants import RedisKeys
from laneway.schema import UsageEvent
from streams.metrics import CANARY_WEIGHT
from streams.oncall import OnCallWebhook
from streams.records import CanaryChange, RouteStats
from streams.settings import StreamsSettings
from streams.types import SendRecord

__all__ = ["CanaryWatch", "Verdict", "judge"]

log = logging.getLogger(__name__)

_JUDGED = ("ok", "error")


@dataclass(slots=True)
class _Traffic:
    """One route's judged events since a moment: (event time, error?, latency ms)."""

    events: list[tuple[float, bool, float]] = field(default_factory=list)

    def since(self, start: float) -> RouteStats | None:
        picked = [(error, ms) for ts, error, ms in self.events if ts >= start]
        if not picked:
            return None
        errors = sum(1 for error, _ in picked if error)
        latencies = sorted(ms for error, ms in picked if not error)
        p99 = latencies[max(0, math.ceil(0.99 * len(latencies)) - 1)] if latencies else None
        return RouteStats(
            requests=len(picked),
            errors=errors,
            error_rate=round(errors / len(picked), 6),
            p99_ms=p99,
        )


@dataclass(frozen=True, slots=True)
class Verdict:
    passed: bool
    reason: str


def judge(canary: RouteStats, stable: RouteStats | None, settings: StreamsSettings) -> Verdict:
    """Whether a step's canary traffic held up against the stable route's."""
    stable_rate = stable.error_rate if stable is not None else 0.0
    allowed = max(
        stable_rate * settings.canary_max_error_ratio, stable_rate + settings.canary_error_slack
    )
    if canary.error_rate > allowed:
        return Verdict(
            False,
            f"error rate {canary.error_rate:.1%} over {canary.requests} requests, above "
            f"{allowed:.1%} (stable {stable_rate:.1%})",
        )
    if stable is not None and stable.p99_ms and canary.p99_ms is not None:
        limit = stable.p99_ms * settings.canary_max_p99_ratio
        if canary.p99_ms > limit:
            return Verdict(
                False,
                f"P99 {canary.p99_ms:.0f} ms above {limit:.0f} ms "
                f"({settings.canary_max_p99_ratio:g}× stable {stable.p99_ms:.0f} ms)",
            )
    return Verdict(True, "")


class CanaryWatch:
    def __init__(
        self,
        settings: StreamsSettings,
        redis: aioredis.Redis,
        keys: RedisKeys,
        send: SendRecord,
        webhook: OnCallWebhook,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.redis = redis
        self.keys = keys
        self.send = send
        self.webhook = webhook
        self.clock = clock
        self.running: dict[str, CanaryState] = {}  # model → its running canary
        self._traffic: dict[tuple[str, str], _Traffic] = {}  # (model, route) → events

    def fold(self, event: UsageEvent) -> None:
        """Keep an event of a model under a running canary (the others cost nothing)."""
        state = self.running.get(event.model)
        if state is None or event.status not in _JUDGED or event.cls == "batch":
            # Batch never takes a canary route, and its times include hours in Kafka: on
            # the stable side alone it would make the stable route look slow.
            return
        if event.route not in (state.model, state.target):
            return  # a breaker fallback: neither side of the comparison
        traffic = self._traffic.setdefault((event.model, event.route), _Traffic())
        traffic.events.append((event.ts, event.status == "error", event.total_ms))

    async def evaluate(self) -> list[CanaryChange]:
        """Judge each running canary whose step has run its window; returns the changes."""
        states = await list_canaries(self.redis, self.keys)
        self.running = {s.model: s for s in states if s.status == "running"}
        for state in states:
            CANARY_WEIGHT.labels(state.model).set(state.weight)
        now = self.clock()
        changes = []
        for state in list(self.running.values()):
            change = await self._judge(state, now)
            if change is not None:
                changes.append(change)
        self._forget(now)
        return changes

    async def _judge(self, state: CanaryState, now: float) -> CanaryChange | None:
        if now - state.since < self.settings.canary_window_s:
            return None
        canary = self._stats(state.model, state.target, state.since)
        if canary is None or canary.requests < self.settings.canary_min_requests:
            return None  # too little traffic to tell yet: the step goes on
        stable = self._stats(state.model, state.model, state.since)
        verdict = judge(canary, stable, self.settings)
        new = (
            state.advanced(now)
            if verdict.passed
            else state.ended("rolled_back", verdict.reason, now)
        )
        if not await self._replace(state, new):
            return None
        change = CanaryChange(
            subject=f"canary:{state.model}",
            model=state.model,
            target=state.target,
            status=new.status,
            weight=new.weight,
            previous_weight=state.weight,
            reason=verdict.reason,
            canary=canary,
            stable=stable,
        )
        log.warning("%s", change.summary())
        CANARY_WEIGHT.labels(state.model).set(new.weight)
        await self.send(self.settings.topics.control, change.subject.encode(), change.to_json())
        if new.status == "rolled_back":
            self.webhook.notify(change)
        if new.status == "running":
            self.running[state.model] = new
        else:
            self.running.pop(state.model, None)
        return change

    def _stats(self, model: str, route: str, since: float) -> RouteStats | None:
        traffic = self._traffic.get((model, route))
        return traffic.since(since) if traffic is not None else None

    async def _replace(self, old: CanaryState, new: CanaryState) -> bool:
        """Write ``new`` only if Redis still holds ``old`` (no one aborted or restarted it)."""
        key = self.keys.canary(old.model)
        async with self.redis.pipeline(transaction=True) as pipe:
            try:
                await pipe.watch(key)
                raw = await pipe.get(key)
                if raw is None or CanaryState.model_validate_json(raw) != old:
                    return False
                pipe.multi()  # type: ignore[no-untyped-call]
                pipe.set(key, new.to_json())
                await pipe.execute()
            except WatchError:
                return False
        return True

    def _forget(self, now: float) -> None:
        """Events from before the oldest running step are of no more use."""
        for (model, route), traffic in list(self._traffic.items()):
            state = self.running.get(model)
            if state is None:
                del self._traffic[(model, route)]
                continue
            traffic.events = [e for e in traffic.events if e[0] >= state.since]
