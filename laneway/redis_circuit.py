"""One circuit per Redis client: the request path waits tens of milliseconds on Redis at most,
and not at all once Redis has stopped answering.

A Redis that refuses connections fails every call at once; one that *hangs* (a fork for a
snapshot, a paused VM, a partition) lets each call wait out its socket timeout, seconds on
the request path. Every component of a process shares the circuit of the process's client
(``circuit_of``), so what one of them learns spares all the others the wait:

- ``hot`` calls (request path) give up after ``hot_timeout_s``; ``background`` calls get the
  timeout they ask for. Both raise ``RedisUnavailable``, a redis-py ``ConnectionError``, which
  every caller already answers with its fallback. A call is given up only when Redis was
  silent: if other calls got answers meanwhile, or the caller woke up late (its process is
  busy, and the answer may sit unread behind that work), it gets another timeout, up to
  ``_BUSY_LOOP_MAX_S`` in all. A busy process must not take itself for a hung Redis.
- The circuit **opens** after ``failures`` failed calls in a row (refused connections), or
  at once when a call was given up for silence: a hung server answers nothing, a busy one
  answers the others meanwhile. While open, every call raises at once.
- While open, a background task sends ``PING`` every ``probe_interval_s``; the first answer
  within the hot timeout **closes** it, and listeners settle what they owe (``listen``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis.asyncio as aioredis
from prometheus_client import Counter, Gauge
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

__all__ = [
    "DEFAULT_FAILURES",
    "DEFAULT_HOT_TIMEOUT_MS",
    "DEFAULT_PROBE_INTERVAL_MS",
    "RedisCircuit",
    "RedisUnavailable",
    "attach_circuit",
    "circuit_of",
]

log = logging.getLogger(__name__)

# Redis answers a loopback or same-zone call in well under a millisecond; 50 ms is a
# hundred times that, and what a completion (P99 target well under 200 ms) can spare once.
DEFAULT_HOT_TIMEOUT_MS = 50
DEFAULT_FAILURES = 3
DEFAULT_PROBE_INTERVAL_MS = 200
# The longest a call waits for Redis on an event loop too busy to read the answer: the
# client's socket timeout, what every call waited before this circuit existed.
_BUSY_LOOP_MAX_S = 5.0

T = TypeVar("T")
# Told True when the circuit opens and False when it closes; runs in the event loop.
Listener = Callable[[bool], None]

CIRCUIT_OPEN = Gauge(
    "laneway_redis_circuit_open",
    "1 while this process has stopped waiting on Redis (its request path on its fallbacks)",
)
CIRCUIT_OPENS = Counter(
    "laneway_redis_circuit_opens_total", "Times this process stopped waiting on Redis"
)


class RedisUnavailable(RedisConnectionError):
    """Redis did not answer in time, or the circuit is open: use the fallback.

    A redis-py error, not one of laneway's tree: every caller already answers Redis's
    connection errors with its fallback, and this is one more of them."""


class RedisCircuit:
    """Times Redis calls and stops making them while Redis does not answer (module doc)."""

    def __init__(
        self,
        redis: aioredis.Redis,
        *,
        hot_timeout_s: float = DEFAULT_HOT_TIMEOUT_MS / 1000,
        failures: int = DEFAULT_FAILURES,
        probe_interval_s: float = DEFAULT_PROBE_INTERVAL_MS / 1000,
    ) -> None:
        # Weak: the registry below maps the client to its circuit, which must not keep it.
        self._redis = weakref.ref(redis)
        self.hot_timeout_s = hot_timeout_s
        self.failures = failures
        self.probe_interval_s = probe_interval_s
        self._open = False
        self._failed = 0  # failed calls in a row
        self._answered = time.monotonic()  # when Redis last answered anything
        self._opened = 0.0
        self._closed = asyncio.Event()
        self._closed.set()
        self._listeners: list[Listener] = []
        self._probe: asyncio.Task[None] | None = None
        self.closings = 0  # times it closed again: a subscription made before is suspect

    @property
    def open(self) -> bool:
        """Whether calls are refused at once (Redis is being probed)."""
        return self._open

    def listen(self, listener: Listener) -> None:
        """Call ``listener(True)`` when the circuit opens and ``listener(False)`` when it
        closes again."""
        self._listeners.append(listener)

    async def wait_closed(self) -> None:
        """Return once Redis answers (at once when it does now)."""
        await self._closed.wait()

    async def hot(self, call: Callable[[], Awaitable[T]]) -> T:
        """``call()`` within the hot timeout (request path)."""
        return await self._run(call, self.hot_timeout_s)

    async def background(self, call: Callable[[], Awaitable[T]], *, timeout_s: float | None) -> T:
        """``call()`` within ``timeout_s`` (None: the client's socket timeout only)."""
        return await self._run(call, timeout_s)

    async def _run(self, call: Callable[[], Awaitable[T]], timeout_s: float | None) -> T:
        if self._open:
            raise RedisUnavailable("Redis is not answering (circuit open); using the fallback")
        sent = time.monotonic()
        try:
            if timeout_s is None:
                result = await call()
            else:
                result = await self._within(call, timeout_s)
        except TimeoutError as exc:  # ours (_within): Redis was silent for the last timeout_s
            self._failure(exc, silent=True)
            within = "its timeout" if timeout_s is None else f"{timeout_s * 1000:.0f} ms"
            raise RedisUnavailable(f"Redis did not answer within {within}") from exc
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            # A socket timeout: silent if nothing else was answered since this call was sent.
            self._failure(exc, silent=isinstance(exc, RedisTimeoutError) and self._answered < sent)
            raise
        except RedisError:
            self._answer()  # an error reply is an answer: Redis is there
            raise
        self._answer()
        return result

    async def _within(self, call: Callable[[], Awaitable[T]], timeout_s: float) -> T:
        """``call()``, or ``TimeoutError`` once it has waited ``timeout_s`` with Redis silent
        (module doc); the call is cancelled then (redis-py drops its connection)."""
        task = asyncio.ensure_future(call())
        started = time.monotonic()
        deadline = started + timeout_s
        try:
            while True:
                await asyncio.wait({task}, timeout=max(0.0, deadline - time.monotonic()))
                if task.done():
                    return task.result()
                now = time.monotonic()
                # The timer fired well after its time: the loop was busy, and the answer
                # may be sitting unread behind that work.
                woke_late = now - deadline > timeout_s / 2
                heard = self._answered > deadline - timeout_s  # another call, this window
                if not (woke_late or heard) or now - started >= _BUSY_LOOP_MAX_S:
                    raise TimeoutError
                deadline = now + timeout_s
        finally:
            if not task.done():
                task.cancel()
                await asyncio.wait({task})
            if not task.cancelled():
                task.exception()  # retrieved: the caller has (or no longer wants) the outcome

    def _answer(self) -> None:
        self._answered = time.monotonic()
        self._failed = 0

    def _failure(self, exc: BaseException, *, silent: bool) -> None:
        self._failed += 1
        if not self._open and (silent or self._failed >= self.failures):
            self._trip(exc)

    def _trip(self, exc: BaseException) -> None:
        self._open = True
        self._opened = time.monotonic()
        self._closed.clear()
        CIRCUIT_OPEN.set(1)
        CIRCUIT_OPENS.inc()
        log.warning(
            "Redis does not answer (%s): the request path uses its fallbacks; probing it "
            "every %.0f ms",
            str(exc) or type(exc).__name__,
            self.probe_interval_s * 1000,
        )
        self._tell(True)
        if self._probe is None or self._probe.done():
            self._probe = asyncio.get_running_loop().create_task(
                self._probe_until_answered(), name="redis-probe"
            )

    async def _probe_until_answered(self) -> None:
        while self._open:
            await asyncio.sleep(self.probe_interval_s)
            redis = self._redis()
            if redis is None:
                return  # the client is gone: nobody is left to tell
            try:
                await self._within(redis.ping, self.hot_timeout_s)
            except (RedisError, OSError):  # TimeoutError is an OSError
                continue
            self._reset()

    def _reset(self) -> None:
        self._open = False
        self._answer()
        self.closings += 1
        self._closed.set()
        CIRCUIT_OPEN.set(0)
        log.warning("Redis answers again after %.1f s: back to it", time.monotonic() - self._opened)
        self._tell(False)

    def _tell(self, opened: bool) -> None:
        for listener in self._listeners:
            try:
                listener(opened)
            except Exception:
                log.exception("a Redis circuit listener failed")

    async def stop(self) -> None:
        """Stop probing (the client is being closed); safe twice."""
        task, self._probe = self._probe, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


# One circuit per client, so every component of a process that shares the client (the
# ingress's, the worker's) shares what it learns. Weak keys: a closed client's circuit goes.
_CIRCUITS: weakref.WeakKeyDictionary[aioredis.Redis, RedisCircuit] = weakref.WeakKeyDictionary()


def circuit_of(redis: aioredis.Redis) -> RedisCircuit:
    """The circuit of ``redis``; a client that was given none gets one with the defaults."""
    circuit = _CIRCUITS.get(redis)
    if circuit is None:
        circuit = _CIRCUITS[redis] = RedisCircuit(redis)
    return circuit


def attach_circuit(
    redis: aioredis.Redis, *, hot_timeout_ms: int, failures: int, probe_interval_ms: int
) -> RedisCircuit:
    """Give ``redis`` a circuit with these settings (``make_redis`` does, from the settings)."""
    circuit = _CIRCUITS[redis] = RedisCircuit(
        redis,
        hot_timeout_s=hot_timeout_ms / 1000,
        failures=failures,
        probe_interval_s=probe_interval_ms / 1000,
    )
    return circuit
