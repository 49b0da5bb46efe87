"""The canary's judge: each step is compared with the stable route over the same time, then
the canary moves one step on, is promoted, or is rolled back.

Usage events of a model with a running canary are kept per route (the stable route is the
model's own name; the canary's is its target) from the moment the step began (at most
``_MAX_EVENTS`` a route), and both sides are judged over the same span. An event is a run
*answered* (``ok``, ``error``) or *abandoned*: left after it reached its engine
(``cancelled``, ``superseded``, ``aborted``) or ``expired``. Once a step has run
``LANEWAY_CANARY_WINDOW_S`` and the canary has ``LANEWAY_CANARY_MIN_REQUESTS`` runs:

- a canary that answers far fewer of its runs than the stable route, past chance (an engine
  that hangs: the next keystroke supersedes each of its runs before the upstream's timeout
  would make it an error), is rolled back; with fewer stable runs than that to compare with
  (a 100 % step), this is not judged;
- with ``LANEWAY_CANARY_MIN_REQUESTS`` answered: its error rate above ``max(stable ×
  LANEWAY_CANARY_MAX_ERROR_RATIO, stable + LANEWAY_CANARY_ERROR_SLACK)``, or its P99
  (successful requests, worker-side) above the stable P99 × ``LANEWAY_CANARY_MAX_P99_RATIO``:
  rolled back; otherwise the next step, or promoted after the last;
- otherwise the step waits for more traffic, however long: a quiet step has few sessions.

A rollback is announced on ``laneway.control`` and to the on-call webhook. Every change is
written to Redis only if the canary is still the one judged (a person may have aborted or
restarted it meanwhile).
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

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

__all__ = ["CanaryWatch", "StepTraffic", "Verdict", "judge", "judge_abandoned"]

log = logging.getLogger(__name__)

_LEFT = ("cancelled", "superseded", "aborted")
# A run dropped before it reached its engine is reported as it is dropped: its total_ms is
# its queue_ms to within the microseconds between two readings of the clock. Such a drop
# tells of the client's typing and the shared queue, not of the route, and is not judged.
_STARTED_MS = 1.0
# Events kept per route at most (some 25 MB): a step longer than that on a busy route (200,000
# events is 33 min at 100 a second) is judged on the trailing span both sides still hold.
_MAX_EVENTS = 200_000
# Abandoned runs: the canary is rolled back when its share of them is twice the stable
# route's and 10 points above it (small shares: editors supersede few runs mid-way), or when
# it answers less than half the share of its runs that the stable route answers (large
# shares: where typing supersedes most runs, twice as many abandoned is more than all)...
_ABANDONED_RATIO = 2.0
_ABANDONED_SLACK = 0.10
_MIN_ANSWERED_RATIO = 0.5
# ...and only when so few answered are that identical routes give as few once in 10,000
# (a one-sided Fisher test of the two sides' counts). The share alone, looked at every second
# over a step, rolls healthy steps back by chance at 90 % superseded on a 50-run sample;
# with the test, under 1 % of them (tests/test_canary_logic.py simulates it). A hung canary
# still goes: at 90 % superseded on the stable route, within 120 runs at a 1 % step.
_ABANDONED_P = 1e-4

_Kind = Literal["ok", "error", "abandoned"]


def _kind(event: UsageEvent) -> _Kind | None:
    """How a step counts this outcome; None: not at all (a drop before its run began)."""
    if event.status == "ok":
        return "ok"
    if event.status in ("error", "unsupported"):
        # A parameter the canary's engine refuses (an IDE's suffix) fails its users as an
        # error does; a stable route that refuses it as well sees the same rate.
        return "error"
    if event.status == "expired":
        return "abandoned"
    if event.status in _LEFT and event.total_ms - event.queue_ms >= _STARTED_MS:
        return "abandoned"
    return None


@dataclass(frozen=True, slots=True)
class StepTraffic:
    """One side of a step over the judged span: its answered requests (ok or error) and its
    runs abandoned after they started, or expired."""

    answered: RouteStats | None
    abandoned: int = 0

    @property
    def runs(self) -> int:
        return self.abandoned + (self.answered.requests if self.answered is not None else 0)

    @property
    def abandoned_share(self) -> float:
        return self.abandoned / self.runs if self.runs else 0.0


@dataclass(slots=True)
class _Traffic:
    """One route's judged events, oldest first: (event time, kind, latency ms)."""

    events: deque[tuple[float, _Kind, float]] = field(
        default_factory=lambda: deque(maxlen=_MAX_EVENTS)
    )

    @property
    def oldest_kept(self) -> float | None:
        """The time of the oldest event once the side is full (older ones were let go)."""
        return self.events[0][0] if len(self.events) == _MAX_EVENTS else None

    def since(self, start: float, *, p99: bool = True) -> StepTraffic:
        """The side's traffic from ``start``; ``p99=False``: the counts alone (no sort of a
        busy stable route's latencies each second while a step waits for answers)."""
        picked = [(kind, ms) for ts, kind, ms in self.events if ts >= start]
        answered = [(kind == "error", ms) for kind, ms in picked if kind != "abandoned"]
        abandoned = len(picked) - len(answered)
        if not answered:
            return StepTraffic(None, abandoned)
        errors = sum(1 for error, _ in answered if error)
        latencies = sorted(ms for error, ms in answered if not error) if p99 else []
        rank = max(0, math.ceil(0.99 * len(latencies)) - 1)
        stats = RouteStats(
            requests=len(answered),
            errors=errors,
            error_rate=round(errors / len(answered), 6),
            p99_ms=latencies[rank] if latencies else None,
        )
        return StepTraffic(stats, abandoned)

    def forget_before(self, start: float) -> None:
        # Workers' events interleave a little: a straggler behind a newer one waits its turn
        # (``since`` leaves it out meanwhile).
        while self.events and self.events[0][0] < start:
            self.events.popleft()


@dataclass(frozen=True, slots=True)
class Verdict:
    passed: bool
    reason: str


def judge(canary: RouteStats, stable: RouteStats | None, settings: StreamsSettings) -> Verdict:
    """Whether a step's answered canary requests held up against the stable route's."""
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


def _log_comb(n: int, k: int) -> float:
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


def _chance_of_so_few_answered(canary: StepTraffic, stable: StepTraffic) -> float:
    """How often identical routes leave the canary this few of both sides' answered runs, or
    fewer: a one-sided Fisher test (exact however few runs the stable side has)."""
    runs = canary.runs + stable.runs
    answered = runs - canary.abandoned - stable.abandoned
    got = canary.runs - canary.abandoned
    whole = _log_comb(runs, canary.runs)
    chance = 0.0
    # Below the mean (where the share check leaves it), the terms shrink as k falls: the sum
    # stops once they no longer count, a few dozen terms however many runs a busy step has.
    for k in range(got, max(0, canary.runs - (runs - answered)) - 1, -1):
        term = math.exp(
            _log_comb(answered, k) + _log_comb(runs - answered, canary.runs - k) - whole
        )
        chance += term
        if term <= chance * 1e-12:
            break
    return min(1.0, chance)


def judge_abandoned(
    canary: StepTraffic, stable: StepTraffic | None, settings: StreamsSettings
) -> Verdict:
    """Whether the canary answered about as many of its runs as the stable route did."""
    if stable is None or stable.runs < settings.canary_min_requests:
        return Verdict(True, "")  # nothing to hold its share to: most runs may be abandoned
    base = stable.abandoned_share
    limit = min(
        max(base * _ABANDONED_RATIO, base + _ABANDONED_SLACK),
        1 - (1 - base) * _MIN_ANSWERED_RATIO,
    )
    if canary.abandoned_share <= limit:
        return Verdict(True, "")
    chance = _chance_of_so_few_answered(canary, stable)
    if chance >= _ABANDONED_P:
        return Verdict(True, "")
    return Verdict(
        False,
        f"{canary.abandoned_share:.1%} of {canary.runs} runs abandoned after they started or "
        f"expired ({canary.runs - canary.abandoned} answered), above {limit:.1%} (stable "
        f"{base:.1%} of {stable.runs}; as few answered by chance: p = {chance:.1g})",
    )


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
        if state is None or event.cls == "batch" or event.ts < state.since:
            # Batch never takes a canary route, and its times include hours in Kafka: on
            # the stable side alone it would make the stable route look slow.
            return
        if event.route not in (state.model, state.target):
            return  # a breaker fallback: neither side of the comparison
        kind = _kind(event)
        if kind is None:
            return
        traffic = self._traffic.setdefault((event.model, event.route), _Traffic())
        traffic.events.append((event.ts, kind, event.total_ms))

    def held(self, model: str) -> int:
        """Events kept for the judgement of ``model``'s canary, both sides."""
        return sum(len(t.events) for (m, _), t in self._traffic.items() if m == model)

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
        self._forget()
        return changes

    async def _judge(self, state: CanaryState, now: float) -> CanaryChange | None:
        # No rollback for time alone: a step with little canary traffic has few sessions on
        # it, and a hung canary is caught by its abandoned runs. (A bound on the step, taken
        # from its start in Redis, rolled back healthy canaries on completion traffic, and
        # every one at the first look of a streams app restarted late in a step.)
        if now - state.since < self.settings.canary_window_s:
            return None
        start = self._span_start(state)
        canary = self._side(state, state.target, start)
        enough = self.settings.canary_min_requests
        if canary.runs < enough:
            return None  # too little traffic to tell yet: the step goes on
        verdict = judge_abandoned(
            canary, self._side(state, state.model, start, p99=False), self.settings
        )
        answered = canary.answered
        if verdict.passed:
            if answered is None or answered.requests < enough:
                return None  # too few answered to tell yet: the step goes on
            stable = self._side(state, state.model, start)
            verdict = judge(answered, stable.answered, self.settings)
        else:
            stable = self._side(state, state.model, start)  # the record's, with its P99
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
            canary=canary.answered,
            stable=stable.answered,
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

    def _span_start(self, state: CanaryState) -> float:
        """Where both sides of the step are judged from: its start, and no earlier than the
        oldest event a full side still holds."""
        start = state.since
        for route in (state.model, state.target):
            traffic = self._traffic.get((state.model, route))
            oldest = traffic.oldest_kept if traffic is not None else None
            if oldest is not None:
                start = max(start, oldest)
        return start

    def _side(
        self, state: CanaryState, route: str, start: float, *, p99: bool = True
    ) -> StepTraffic:
        traffic = self._traffic.get((state.model, route))
        return traffic.since(start, p99=p99) if traffic is not None else StepTraffic(None)

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

    def _forget(self) -> None:
        """Events from before a running step are of no more use."""
        for (model, route), traffic in list(self._traffic.items()):
            state = self.running.get(model)
            if state is None:
                del self._traffic[(model, route)]
                continue
            traffic.forget_before(state.since)
