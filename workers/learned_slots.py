"""How many requests an upstream server runs at once, learned from what it does with ours.

An OpenAI-compatible server queues what it cannot start, out of the shield's reach. The
worker must hand it no more than it can start, and few servers say how many that is. This
learns it, as TCP learns a path's capacity:

- A request that waits far longer for its first byte than recent ones did (a *stall*) sat
  in the upstream's queue: the upstream was full with the requests streaming then. The limit
  becomes that number, and nothing more is sent while a request stalls.
- A request the upstream starts before an earlier one of ours (it *overtakes* it) shows
  that the earlier one does not wait in a queue: servers start waiting requests in the
  order they came, so it is a long prefill or a request stuck on its own. It is no stall:
  it holds nothing back, and a cut its wait already made is undone. After a stall has held
  the rest back for ``probe_s``, one more request goes out to see whether the upstream
  starts it, so a request the upstream never answers holds the pool that long; until one
  starts, each next such probe waits twice as long (a long queue gets few).
- Until a first stall shows the capacity, the limit grows by one with each quick first byte
  that came while the limit was in use (slow start). After that it probes one more only
  every ``probe_s``, so a server that grew is found, at the price of one short wait.
- A 429 or 503 (``no_room``) says the upstream is full now with what of ours it took (all
  ours on it but the refused one): the limit becomes that. With none of ours on it (a server
  still loading, a rate limit of its own), the limit stays; the pause the refusal asks for
  is the answer.
- Where the upstream publishes its queue (vLLM's ``vllm:num_requests_waiting``), a waiting
  count above zero is a stall too, seen by everyone who shares the server. And while its
  count is fresh, it is the only word on the queue: a first byte that is late while the
  server says nothing waits is a slow prefill or a request stuck on its own, not a full
  server, and neither cuts the limit nor holds back the rest.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["LearnedSlots"]

# First bytes remembered to judge what "far longer" is.
_SAMPLES = 64
# Before any first byte was seen, a stall is a wait of the floor times _COLD_FACTOR: a
# cold server's first prefill is slow, and no stall may be read into it.
_COLD_FACTOR = 10
# Fewer first bytes than this: the fastest stands for an unqueued one.
_MIN_SAMPLES = 8
# Prefill is taken as a fixed cost plus one growing with the prompt, the fixed part worth
# this many prompt tokens: first-byte times are compared per such unit.
_PROMPT_UNIT = 1024
# A request overtakes an earlier one only if it was sent this much later: requests sent
# together may reach the server in either order.
_OVERTAKE_MARGIN_S = 0.02
# The longest wait between hold probes (from probe_s, doubling while each still waits).
_LONGEST_HOLD_PROBE_S = 80.0


@dataclass(slots=True)
class _InFlight:
    sent: float
    prompt_tokens: int
    peak: int  # most requests seen streaming at once while this one waited for its first byte
    first_byte: float | None = None
    stalled: bool = False
    overtaken: bool = False  # a later one started first: this one waits in no queue


class LearnedSlots:
    """The limit of requests to have on one upstream at once (see the module docstring)."""

    def __init__(
        self,
        *,
        initial: int = 4,
        maximum: int = 256,
        probe_s: float = 10.0,
        stall_floor_ms: float = 50.0,
        stall_factor: float = 3.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limit = max(1, min(initial, maximum))
        self.maximum = maximum
        self.probe_s = probe_s
        self.stall_floor_ms = stall_floor_ms
        self.stall_factor = stall_factor
        self.learned = False  # a stall has shown the capacity
        self.stalls = 0
        self.streaming = 0  # requests of ours past their first byte
        self._clock = clock
        self._inflight: dict[str, _InFlight] = {}
        self._samples: deque[float] = deque(maxlen=_SAMPLES)  # first-byte ms per unit
        self._base_ms: float | None = None  # an unqueued first byte, per unit
        self._next_probe = 0.0
        self._queue_known_until = float("-inf")  # the upstream's own count is fresh till then
        # Each word of a full upstream, latest last: the request whose stall it was (None:
        # a refusal, the server's own count) and the limit before it.
        self._judged: deque[tuple[_InFlight | None, int]] = deque(maxlen=_SAMPLES)
        self._probe_run: _InFlight | None = None  # the last hold probe, till it starts or ends
        self._probe_pending = False  # a hold probe's room, till a request takes it
        self._hold_probe_s = probe_s  # till the next hold probe: doubles till one starts

    @property
    def in_flight(self) -> int:
        return len(self._inflight)

    # --- what the engine reports ----------------------------------------------------------

    def sent(self, request_id: str, prompt_tokens: int) -> None:
        run = self._inflight[request_id] = _InFlight(self._clock(), prompt_tokens, self.streaming)
        if self._probe_pending:
            self._probe_pending, self._probe_run = False, run

    def resent(self, request_id: str) -> None:
        """``request_id`` sent again before its first byte (after a refusal the server
        answered at once): its wait for the first byte counts from now."""
        run = self._inflight.get(request_id)
        if run is not None and run.first_byte is None:
            run.sent = self._clock()

    def first_byte(self, request_id: str) -> None:
        run = self._inflight.get(request_id)
        if run is None or run.first_byte is not None:
            return
        now = self._clock()
        run.first_byte = now
        self.streaming += 1
        quick = not run.stalled and (now - run.sent) * 1000 <= self._threshold_ms(run.prompt_tokens)
        if run is self._probe_run:
            self._probe_run, self._hold_probe_s = None, self.probe_s
        for other in self._inflight.values():
            if other.first_byte is None:
                other.peak = max(other.peak, self.streaming)
                if quick and not other.overtaken and other.sent < run.sent - _OVERTAKE_MARGIN_S:
                    self._overtaken(other)
        if run.overtaken:
            return  # a long prefill or a request stuck on its own: no measure of a queue
        waited_ms = (now - run.sent) * 1000
        if self._queue_known(now) and not run.stalled:
            if waited_ms <= self._threshold_ms(run.prompt_tokens):
                self._sample(waited_ms, run.prompt_tokens)
            return  # late with no queue upstream: the server's own matter, not a full one
        if run.stalled or waited_ms > self._threshold_ms(run.prompt_tokens):
            if not run.stalled:
                # It started when a slot freed: the upstream was full with as many as it
                # found streaming, itself included.
                self._judge(run, max(run.peak, self.streaming))
            return
        self._sample(waited_ms, run.prompt_tokens)

    def no_room(self) -> None:
        """The upstream refused a request of ours for want of room (a 429 or 503)."""
        taken = len(self._inflight) - 1  # the refused one is still counted in flight
        if taken > 0:
            self._stalled(taken)

    def _overtaken(self, run: _InFlight) -> None:
        run.overtaken = True
        # The latest words of a full upstream, while each was a stall of a request now seen
        # to wait in no queue, are undone: the limit goes back to what it was before them.
        before = None
        while self._judged and (by := self._judged[-1][0]) is not None and by.overtaken:
            before = self._judged.pop()[1]
        if before is not None:
            self.limit = max(self.limit, before)

    def _sample(self, waited_ms: float, prompt_tokens: int) -> None:
        """A quick first byte: what an unqueued one takes, and room to grow (slow start)."""
        self._samples.append(waited_ms / _units(prompt_tokens))
        # A low quantile: first bytes that waited in the upstream's queue are all slower, so
        # it stays the unqueued time while most samples queued. The fastest one until there
        # are enough for a quantile.
        ordered = sorted(self._samples)
        self._base_ms = ordered[len(ordered) // 5 if len(ordered) >= _MIN_SAMPLES else 0]
        if not self.learned and len(self._inflight) >= self.limit:
            self.limit = min(self.maximum, self.limit + 1)

    def done(self, request_id: str) -> None:
        run = self._inflight.pop(request_id, None)
        if run is not None and run is self._probe_run:
            self._probe_run = None
        if run is not None and run.first_byte is not None:
            self.streaming -= 1

    def upstream_load(self, waiting: int, fresh_s: float = 3.0) -> None:
        """The upstream's own queue (from its metrics): ours beyond what it runs must go.
        For ``fresh_s`` it is the only word on the queue (the module docstring)."""
        self._queue_known_until = self._clock() + fresh_s
        if waiting > 0 and self._inflight:
            self._stalled(max(1, len(self._inflight) - waiting))

    # --- what the worker asks -------------------------------------------------------------

    def capacity(self) -> int:
        """Requests to have on the upstream now: no more than are there while one stalls."""
        now = self._clock()
        if self._stalling(now):
            if self._probe_pending:
                return len(self._inflight) + 1  # until a request goes out as the probe
            if now < self._next_probe:
                return len(self._inflight)
            # Held back for probe_s: one more, which the upstream starts at once if the
            # stalled one is stuck on its own rather than queued (it overtakes it then).
            # Until one starts, each comes twice as long after the one before (a probe that
            # waits shows a queue, or is stuck too): a long queue gets few, and two stuck
            # requests do not hold the pool for good.
            self._hold_probe_s = min(self._hold_probe_s * 2, _LONGEST_HOLD_PROBE_S)
            self._probe_pending = True
            self._next_probe = now + self._hold_probe_s
            return len(self._inflight) + 1
        self._probe_pending, self._hold_probe_s = False, self.probe_s
        if self.learned and now >= self._next_probe and len(self._inflight) >= self.limit:
            # Asked with work waiting and the limit in use: try one more.
            self.limit = min(self.maximum, self.limit + 1)
            self._next_probe = now + self.probe_s
        return self.limit

    # --- judgement ------------------------------------------------------------------------

    def _threshold_ms(self, prompt_tokens: int) -> float:
        """How long a first byte may take before it counts as a stall: a multiple of an
        unqueued first byte, scaled to this prompt (a long chat prompt's prefill is no
        stall)."""
        if self._base_ms is None:
            return self.stall_floor_ms * _COLD_FACTOR
        return max(self.stall_floor_ms, self.stall_factor * self._base_ms * _units(prompt_tokens))

    def _queue_known(self, now: float) -> bool:
        return now < self._queue_known_until

    def _stalling(self, now: float) -> bool:
        """Whether a request waits for its first byte past its threshold (judged once);
        never while the upstream's own queue count is fresh."""
        if self._queue_known(now):
            return False
        stalling = False
        for run in self._inflight.values():
            if run.first_byte is not None or run.overtaken:
                continue
            if not run.stalled and (now - run.sent) * 1000 > self._threshold_ms(run.prompt_tokens):
                self._judge(run, max(run.peak, self.streaming))
            stalling = stalling or run.stalled
        return stalling

    def _judge(self, run: _InFlight, capacity: int) -> None:
        """``run`` stalls: the limit is cut, and the cut remembered in case a later request
        overtakes it (it was no queue then)."""
        run.stalled = True
        self._stalled(capacity, run)

    def _stalled(self, capacity: int, run: _InFlight | None = None) -> None:
        """The upstream was full with ``capacity`` requests of ours. Once learned, a stall
        halves the limit at most: one slow first byte (a cold prefix, a neighbour's burst)
        must not cut it to the few requests streaming just then, to climb back one probe
        at a time."""
        self._judged.append((run, self.limit))
        capacity = max(1, min(capacity, self.maximum))
        if self.learned:
            capacity = max(capacity, self.limit // 2)
        if not self.learned or capacity < self.limit:
            self.stalls += 1
            self.limit = capacity
        self.learned = True
        # No probe for probe_s, nor before a hold probe already due later.
        self._next_probe = max(self._next_probe, self._clock() + self.probe_s)


def _units(prompt_tokens: int) -> float:
    return 1.0 + max(0, prompt_tokens) / _PROMPT_UNIT
