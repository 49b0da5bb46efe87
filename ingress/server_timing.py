"""The Server-Timing header of a completion: how long the ingress took, stage by stage."""

from __future__ import annotations

import time

from laneway.clock import RedisClock
from laneway.schema import RequestEnvelope

__all__ = ["ServerTiming"]


class ServerTiming:
    """Where a request's time went inside the ingress, for the Server-Timing header."""

    def __init__(self, wall: RedisClock) -> None:
        self.wall = wall  # the clock accepted_ts was stamped on
        self._last = time.perf_counter()
        self.spent: dict[str, float] = {}

    def stage(self, name: str) -> None:
        now = time.perf_counter()
        self.spent[name] = self.spent.get(name, 0.0) + (now - self._last) * 1000
        self._last = now

    def header(self, env: RequestEnvelope) -> str:
        """``laneway`` is acceptance to now; its parts are admit (breaker and quota), enqueue
        (until Kafka stored the envelope) and worker (until the reply came back)."""
        total = (self.wall.now() - env.accepted_ts) * 1000
        parts = [f"laneway;dur={total:.2f}"]
        parts += [f"{name};dur={ms:.2f}" for name, ms in self.spent.items()]
        return ", ".join(parts)
