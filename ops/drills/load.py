"""An open-loop load generator: requests leave at a set rate whatever the answers take, as
typing users do not wait for the last completion before the next keystroke."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import httpx

__all__ = ["OpenLoop", "OpenLoopLoad", "Outcome"]

# The answer a request never got: shed by the client (too many open) or timed out.
NO_ANSWER = 0


@dataclass(frozen=True)
class Outcome:
    """One request: when it left (seconds since the drill began), how long it took, status,
    and the id the ingress gave it (its usage event's)."""

    sent_at: float
    latency_s: float
    status: int
    request_id: str = ""


class OpenLoop:
    """Starts ``send(n, sent_at)`` at a rate, keeping at most ``max_open`` unfinished; a
    request due while that many are open is shed (``shed(sent_at)``), never delayed."""

    def __init__(
        self,
        send: Callable[[int, float], Coroutine[Any, Any, None]],
        *,
        started: float,
        max_open: int = 256,
        shed: Callable[[float], None] | None = None,
    ) -> None:
        self.started = started
        self.sent = 0
        self._send = send
        self._shed = shed
        self._open: set[asyncio.Task[None]] = set()
        self._max_open = max_open

    async def run(self, rate: float, duration_s: float) -> None:
        """Send at ``rate`` per second for ``duration_s`` (the answers may come later)."""
        begin = time.monotonic()
        n = 0
        while (due := begin + n / rate) < begin + duration_s:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            n += 1
            sent_at = time.monotonic() - self.started
            if len(self._open) >= self._max_open:
                if self._shed is not None:
                    self._shed(sent_at)
                continue
            task = asyncio.create_task(self._send(self.sent, sent_at))
            self.sent += 1
            self._open.add(task)
            task.add_done_callback(self._open.discard)

    async def drain(self, within_s: float) -> None:
        """Wait for the answers still out, up to ``within_s``; cancel the rest."""
        if self._open:
            await asyncio.wait(set(self._open), timeout=within_s)
        for task in list(self._open):
            task.cancel()


class OpenLoopLoad:
    """POSTs ``body(n)`` (with ``headers``) to ``path`` at a rate, keeping at most
    ``max_open`` unanswered."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        path: str,
        body: Callable[[int], dict[str, Any]],
        *,
        started: float,
        max_open: int = 256,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.http = http
        self.headers = headers or {}
        self.path = path
        self.body = body
        self.started = started
        self.outcomes: list[Outcome] = []
        self._loop = OpenLoop(self._one, started=started, max_open=max_open, shed=self._shed)

    async def run(self, rate: float, duration_s: float) -> None:
        """Send at ``rate`` per second for ``duration_s`` (the answers may come later)."""
        await self._loop.run(rate, duration_s)

    async def drain(self, within_s: float) -> None:
        """Wait for the answers still out, up to ``within_s``."""
        await self._loop.drain(within_s)

    def _shed(self, sent_at: float) -> None:
        self.outcomes.append(Outcome(sent_at, 0.0, NO_ANSWER))

    async def _one(self, n: int, sent_at: float) -> None:
        begin = time.monotonic()
        request_id = ""
        try:
            response = await self.http.post(self.path, json=self.body(n), headers=self.headers)
            status = response.status_code
            request_id = response.headers.get("x-laneway-request-id", "")
        except httpx.HTTPError:
            status = NO_ANSWER
        self.outcomes.append(Outcome(sent_at, time.monotonic() - begin, status, request_id))
