"""Faust's producer buffer, made safe to commit behind.

A table write (``table[key] = value``) does not reach Kafka's producer at once: Faust queues
its changelog record in a ``ProducerBuffer`` that a background task hands over to aiokafka,
one record at a time. Before committing input offsets Faust flushes the producer, and the
buffer's part of that flush (``ProducerBuffer.flush_atmost`` in faust-streaming 0.15.3)
returns as soon as 0.1 s pass without a hand-over, and does not see the record the task has
taken off the queue but not handed over yet. A commit can then cover events whose changelog
records are still in the buffer; a process killed at that moment loses those events, and the
buffer cannot be flushed any more once the producer stops. This is the likely cause of one
event missing from an hourly total after a SIGKILL restart in CI, and
``tests/test_streams_buffer.py`` shows the gap with hand-overs that stall for 0.15 s: without
this module, a commit covered 12 events while the changelog held the change of the first.

``drain_before_commit`` replaces the flush of one app's buffer with one that returns only
when the buffer is empty and no record is between the buffer and aiokafka (whose own flush,
next in Faust's commit, then waits for delivery).
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["drain_before_commit"]

# How often the flush looks again while a record is being handed over (a few microseconds
# normally; this only matters when the hand-over stalls).
_POLL_S = 0.002


class _DrainingFlush:
    def __init__(self, buffer: Any) -> None:
        self.buffer = buffer
        self.handing_over = 0
        self._hand_over = buffer._send_pending
        # Both set before the buffer starts: its task reads ``_send_pending`` once, at start.
        buffer._send_pending = self._counted_hand_over
        buffer.flush = self.flush

    async def _counted_hand_over(self, fut: Any) -> None:
        self.handing_over += 1
        try:
            await self._hand_over(fut)
        finally:
            self.handing_over -= 1

    async def flush(self) -> None:
        """Return once every record put in the buffer is with aiokafka's producer."""
        buffer = self.buffer
        while buffer.size or self.handing_over:
            if buffer.size:
                # Faust's own step: waits for hand-overs, gives up after 0.1 s without one;
                # it raises if the buffer is no longer running (nothing would drain it).
                await buffer.flush_atmost(None)
            else:
                await asyncio.sleep(_POLL_S)


def drain_before_commit(app: Any) -> None:
    """Make ``app``'s pre-commit flush wait for its whole producer buffer (call before start)."""
    _DrainingFlush(app.producer.buffer)
