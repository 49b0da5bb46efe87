"""How many requests an upstream server runs at once, learned from what it does with ours.

An OpenAI-compatible server queues what it cannot start, out of the shield's reach. The
worker must hand it no more than it can start, and few servers say how many that is. This
learns it, as TCP learns a path's capacity:

- A request that waits far longer for its first byte than an unqueued one does (it is
  *late*) may have sat in the upstream's queue, or not: a cold prefix among warm ones, a
  cold server's first prefill, a request the upstream never answers are late too. It is a
  *vote* that the upstream is full only when all of these hold: it was sent at the limit
  (sending it used the limit's last place); it started as a queue of ours would start it,
  within a first byte's time of one of ours ending (a request that waited on its own starts
  long after the requests ahead of it freed their slots); and ours ahead of it were still
  there. Two votes since the limit last moved cut it to what ran with the second one (ours
  sent before it and still there, itself included), never below what was streaming when it
  was sent. A late request that is not a vote holds nothing back: it takes its one place
  in the limit, and the rest go out.
- Until a first cut shows the capacity, the limit grows by one with each quick first byte
  that came while the limit was in use (slow start). After that it probes one more only
  every ``probe_s``, so a server that grew is found, at the price of two short waits.
- A 429 or 503 (``no_room``) says the upstream is full now: the limit becomes what of ours
  streams.
- Where the upstream publishes its queue (vLLM's ``vllm:num_requests_waiting``), a waiting
  count above zero cuts the limit too, seen by everyone who shares the server. And while
  its count is fresh, it is the only word on the queue: no late first byte votes.
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
# Votes that the upstream is full (late first bytes of a queue of ours) that cut the limit:
# one alone is too easily a cold prefill that happened to start as a slot freed.
_VOTES_TO_CUT = 2


@dataclass(slots=True)
class _InFlight:
    sent: float
    order: int  # sends before it
    prompt_tokens: int
    streaming: int  # ours past their first byte when it was sent: the upstream runs these
    at_limit: bool  # sending it used the limit's last place: only then may its wait vote
    first_end: float | None = None  # when one of ours first ended after it was sent
    first_byte: float | None = None


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
        self.learned = False  # a cut has shown the capacity
        self.stalls = 0  # cuts of the limit
        self.streaming = 0  # requests of ours past their first byte
        self._clock = clock
        self._sends = 0
        self._inflight: dict[str, _InFlight] = {}
        self._samples: deque[float] = deque(maxlen=_SAMPLES)  # first-byte ms per unit
        self._base_ms: float | None = None  # an unqueued first byte, per unit
        self._votes: list[int] = []  # since the limit last moved: what ran with each vote
        self._next_probe = 0.0
        self._queue_known_until = float("-inf")  # the upstream's own count is fresh till then

    @property
    def in_flight(self) -> int:
        return len(self._inflight)

    # --- what the engine reports ----------------------------------------------------------

    def sent(self, request_id: str, prompt_tokens: int) -> None:
        at_limit = len(self._inflight) + 1 >= self.limit
        self._inflight[request_id] = _InFlight(
            self._clock(), self._sends, prompt_tokens, self.streaming, at_limit
        )
        self._sends += 1

    def first_byte(self, request_id: str) -> None:
        run = self._inflight.get(request_id)
        if run is None or run.first_byte is not None:
            return
        now = self._clock()
        run.first_byte = now
        self.streaming += 1
        waited_ms = (now - run.sent) * 1000
        threshold_ms = self._threshold_ms(run.prompt_tokens)
        if waited_ms <= threshold_ms:
            self._sample(waited_ms, run.prompt_tokens)
            return
        if self._queue_known(now) or not run.at_limit or run.first_end is None:
            # Late while the upstream's fresh count says nothing waits, or sent below the
            # limit, or with none of ours ending meanwhile: not behind ours in a queue.
            return
        if (now - run.first_end) * 1000 > threshold_ms:
            return  # a slot of ours freed long before it started: it waited on its own
        ran = 1 + sum(1 for other in self._inflight.values() if other.order < run.order)
        if ran <= 1:
            return
        self._votes.append(max(ran, run.streaming))
        if len(self._votes) >= _VOTES_TO_CUT:
            self._cut(self._votes[-1])

    def no_room(self) -> None:
        """The upstream refused a request for want of room (a 429 or 503): it is full with
        what of ours streams now, and the limit becomes that (not below 1)."""
        self._cut(self.streaming, halve_at_most=False)

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
        if run is None:
            return
        if run.first_byte is not None:
            self.streaming -= 1
            now = self._clock()
            for other in self._inflight.values():
                if other.first_end is None and other.first_byte is None:
                    other.first_end = now

    def upstream_load(self, waiting: int, fresh_s: float = 3.0) -> None:
        """The upstream's own queue (from its metrics): ours beyond what it runs must go.
        For ``fresh_s`` it is the only word on the queue (the module docstring)."""
        self._queue_known_until = self._clock() + fresh_s
        if waiting > 0 and self._inflight:
            self._cut(len(self._inflight) - waiting)

    # --- what the worker asks -------------------------------------------------------------

    def capacity(self) -> int:
        """Requests to have on the upstream now."""
        now = self._clock()
        if self.learned and now >= self._next_probe and len(self._inflight) >= self.limit:
            # Asked with work waiting and the limit in use: try one more.
            self.limit = min(self.maximum, self.limit + 1)
            self._next_probe = now + self.probe_s
            self._votes.clear()
        return self.limit

    # --- judgement ------------------------------------------------------------------------

    def _threshold_ms(self, prompt_tokens: int) -> float:
        """How long a first byte may take before it is late: a multiple of an unqueued first
        byte, scaled to this prompt (a long chat prompt's prefill is not late)."""
        if self._base_ms is None:
            return self.stall_floor_ms * _COLD_FACTOR
        return max(self.stall_floor_ms, self.stall_factor * self._base_ms * _units(prompt_tokens))

    def _queue_known(self, now: float) -> bool:
        return now < self._queue_known_until

    def _cut(self, capacity: int, *, halve_at_most: bool = True) -> None:
        """The upstream runs ``capacity`` of ours. Once learned, late first bytes halve the
        limit at most: a burst of slow prefills must not cut it to the few requests
        streaming just then, to climb back one probe at a time."""
        capacity = max(1, min(capacity, self.maximum))
        if self.learned and halve_at_most:
            capacity = max(capacity, self.limit // 2)
        if not self.learned or capacity < self.limit:
            self.stalls += 1
            self.limit = capacity
        self.learned = True
        self._votes.clear()
        self._next_probe = self._clock() + self.probe_s


def _units(prompt_tokens: int) -> float:
    return 1.0 + max(0, prompt_tokens) / _PROMPT_UNIT
