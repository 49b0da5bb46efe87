"""The shadow comparison: a model's shadow route against its primary traffic, over a sliding
window, written to Redis for ``GET /admin/shadow`` and ``laneway shadow status``.

It is computed here rather than in the ingress: the usage topic is the one place that sees
both sides' outcomes from every ingress replica and every worker (an ingress never hears of
a mirror again once it is stored, and sees only its own share of the primaries).

Usage events (``ok`` and ``error``) of a model with a running shadow are kept for
``LANEWAY_SHADOW_WINDOW_S``: the mirrors (``shadow: true``) on one side, every other request
of the model on the other, whichever route served it. Latency is the engine's start to the
end (``total_ms - queue_ms``) of the successful ones: a mirror waits in the ``lo`` band on
purpose, and that wait says nothing of the route.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable

import redis.asyncio as aioredis

from laneway.constants import SHADOW_COMPARISON_TTL_S, RedisKeys
from laneway.schema import UsageEvent
from laneway.shadow import ShadowComparison, ShadowState, ShadowStats, list_shadows
from streams.settings import StreamsSettings

__all__ = ["ShadowWatch", "shadow_stats"]

log = logging.getLogger(__name__)

_COMPARED = ("ok", "error")
# Events kept per model and side at most: a window of a busy model stays a bounded sample.
_MAX_EVENTS = 200_000


def _rank(ordered: list[float], q: float) -> float:
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def shadow_stats(events: list[tuple[float, bool, float]]) -> ShadowStats | None:
    """Requests, errors and P50/P99 of the successful, of (event time, error?, latency ms)."""
    if not events:
        return None
    errors = sum(1 for _, error, _ in events if error)
    latencies = sorted(ms for _, error, ms in events if not error)
    return ShadowStats(
        requests=len(events),
        errors=errors,
        error_rate=round(errors / len(events), 6),
        p50_ms=round(_rank(latencies, 0.5), 3) if latencies else None,
        p99_ms=round(_rank(latencies, 0.99), 3) if latencies else None,
    )


class ShadowWatch:
    def __init__(
        self,
        settings: StreamsSettings,
        redis: aioredis.Redis,
        keys: RedisKeys,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.window_s = settings.shadow_window_s
        self.redis = redis
        self.keys = keys
        self.clock = clock
        self.running: dict[str, ShadowState] = {}  # model → its running shadow
        # (model, shadow?) → (event time, error?, latency ms), oldest first
        self._events: dict[tuple[str, bool], deque[tuple[float, bool, float]]] = {}

    def fold(self, event: UsageEvent) -> None:
        """Keep an event of a model under a running shadow (the others cost nothing)."""
        if event.model not in self.running or event.status not in _COMPARED:
            return
        side = self._events.setdefault((event.model, event.shadow), deque(maxlen=_MAX_EVENTS))
        side.append((event.ts, event.status == "error", max(0.0, event.total_ms - event.queue_ms)))

    async def evaluate(self) -> list[ShadowComparison]:
        """Write each running shadow's comparison over the last window; returns them."""
        states = await list_shadows(self.redis, self.keys)
        self.running = {s.model: s for s in states if s.status == "running"}
        since = self.clock() - self.window_s
        compared = []
        for state in self.running.values():
            comparison = ShadowComparison(
                model=state.model,
                target=state.target,
                window_s=self.window_s,
                primary=shadow_stats(self._window(state.model, False, since)),
                shadow=shadow_stats(self._window(state.model, True, since)),
            )
            await self.redis.set(
                self.keys.shadow_comparison(state.model),
                comparison.to_json(),
                ex=SHADOW_COMPARISON_TTL_S,
            )
            compared.append(comparison)
        for model, shadow in list(self._events):
            if model not in self.running:
                del self._events[(model, shadow)]
        return compared

    def _window(self, model: str, shadow: bool, since: float) -> list[tuple[float, bool, float]]:
        """The side's events since ``since``; older ones are dropped for good."""
        events = self._events.get((model, shadow))
        if events is None:
            return []
        while events and events[0][0] < since:
            events.popleft()
        return [e for e in events if e[0] >= since]  # workers' events interleave a little
