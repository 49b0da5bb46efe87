"""The tiered breaker: error counts over a sliding window and levels 0–3 with hysteresis.

A level is entered as soon as the windowed error rate is above its entry threshold; it is
left one level at a time, and only after the rate stayed below the (lower) exit threshold of
the current level for a whole cool-down. A window with fewer than the minimum request count
has no rate: it can never raise a level, and it counts as calm (no traffic is no evidence of
failure, and a route nobody is sent to must be able to recover and be probed again).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

from streams.settings import StreamsSettings

__all__ = [
    "MAX_LEVEL",
    "BreakerPolicy",
    "BreakerState",
    "add_outcome",
    "next_state",
    "window_counts",
]

MAX_LEVEL = 3
# Bucket of the sliding window → [requests, errors]; JSON-friendly (string keys).
Buckets = MutableMapping[str, list[int]]


@dataclass(frozen=True, slots=True)
class BreakerPolicy:
    enter: tuple[float, ...]
    exit: tuple[float, ...]
    cooldown_s: float
    min_requests: int
    window_s: float
    bucket_s: float

    @classmethod
    def from_settings(cls, settings: StreamsSettings) -> BreakerPolicy:
        return cls(
            enter=tuple(settings.breaker_enter),
            exit=tuple(settings.breaker_exit),
            cooldown_s=settings.breaker_cooldown_s,
            min_requests=settings.breaker_min_requests,
            window_s=settings.breaker_window_s,
            bucket_s=settings.breaker_bucket_s,
        )


@dataclass(frozen=True, slots=True)
class BreakerState:
    """Level of one subject (a route, or a team on a route) and how long it has been calm."""

    level: int = 0
    since: float = 0.0
    calm_since: float | None = None
    rate: float = 0.0
    requests: int = 0


def _bucket(ts: float, policy: BreakerPolicy) -> int:
    return int(ts // policy.bucket_s)


def _live(bucket: int, now: float, policy: BreakerPolicy) -> bool:
    return (bucket + 1) * policy.bucket_s > now - policy.window_s


def add_outcome(
    buckets: Buckets, ts: float, *, error: bool, now: float, policy: BreakerPolicy
) -> bool:
    """Count one ok/error outcome; drop buckets that left the window. False if ``ts`` is stale."""
    for key in [k for k in buckets if not _live(int(k), now, policy)]:
        del buckets[key]
    bucket = _bucket(ts, policy)
    if not _live(bucket, now, policy):
        return False
    counts = buckets.setdefault(str(bucket), [0, 0])
    counts[0] += 1
    counts[1] += int(error)
    return True


def window_counts(
    buckets: Mapping[str, list[int]], now: float, policy: BreakerPolicy
) -> tuple[int, int]:
    """(requests, errors) inside the window ending at ``now``."""
    requests = errors = 0
    for key, (n, err) in buckets.items():
        if _live(int(key), now, policy):
            requests += n
            errors += err
    return requests, errors


def next_state(
    state: BreakerState, requests: int, errors: int, now: float, policy: BreakerPolicy
) -> BreakerState:
    """The state after one evaluation; ``level`` changes at most once per call."""
    rate = errors / requests if requests else 0.0
    counted = requests >= policy.min_requests
    target = sum(1 for threshold in policy.enter if rate > threshold) if counted else 0
    if target > state.level:
        return BreakerState(level=target, since=now, rate=rate, requests=requests)
    if state.level == 0:
        return dataclasses.replace(state, calm_since=None, rate=rate, requests=requests)
    calm = not counted or rate < policy.exit[state.level - 1]
    if not calm:
        return dataclasses.replace(state, calm_since=None, rate=rate, requests=requests)
    calm_since = now if state.calm_since is None else state.calm_since
    if now - calm_since >= policy.cooldown_s:
        # One level per cool-down; the next step needs a cool-down of its own.
        return BreakerState(
            level=state.level - 1, since=now, calm_since=now, rate=rate, requests=requests
        )
    return dataclasses.replace(state, calm_since=calm_since, rate=rate, requests=requests)
