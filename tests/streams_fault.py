"""``python -m tests.streams_fault``: ``python -m streams`` with a bug planted for a test.

Folding a record of team ``team-fault`` raises, as a bug in the processor would:
``STREAMS_FAULT=once`` the first time only (the file ``STREAMS_FAULT_MARKER`` names then
exists, and the restart folds it), ``always`` every time. ``STREAMS_FAULT=recovery:<step>``:
the step of table recovery that Faust bounds by ``broker_request_timeout`` and runs the
coroutine ``<step>`` (``flush``: the producer's, first of all; ``perform_seek``: the seek to
the committed offsets, inside the hand-over) does not finish in time (1 s here), once (the
marker again), as a broker that stops answering for 90 s would have it.
``STREAMS_FAULT=clock-ahead:<seconds>``: the app's clock, and the broker's times of the records
it reads, are that far ahead of Redis's, as if that much time had gone by (hours close without
a test waiting for them). Everything else
is the real entry point.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import runpy
from pathlib import Path
from typing import Any

from faust.tables.recovery import Recovery

from laneway.clock import RedisClock
from streams.processor import UsageProcessor

FAULT_TEAM = b'"team-fault"'

_fault = os.environ["STREAMS_FAULT"]
_always = _fault == "always"
_marker = Path(os.environ["STREAMS_FAULT_MARKER"])
_handle = UsageProcessor.handle


def _faulty(
    self: UsageProcessor,
    raw: bytes | None,
    partition: int,
    offset: int,
    stored_at: float | None = None,
) -> None:
    if raw is not None and FAULT_TEAM in raw and (_always or not _marker.exists()):
        _marker.touch()
        raise RuntimeError("a planted bug")
    _handle(self, raw, partition, offset, stored_at)


_wait = Recovery._wait


def _met() -> bool:
    """Whether the fault was met before (the first call says no, and notes it)."""
    met = _marker.exists()
    _marker.touch()
    return met


async def _stalled(self: Recovery, coro: Any, timeout: Any = None) -> None:  # noqa: ASYNC109
    step = getattr(getattr(coro, "cr_code", None), "co_name", None)
    if timeout is not None and step == _step and not _met():
        if inspect.iscoroutine(coro):
            coro.close()
        await _wait(self, asyncio.sleep(3600), timeout=1.0)  # never done: times out
    await _wait(self, coro, timeout=timeout)


def _ahead_of_redis(self: RedisClock) -> float:
    return self.local() + self.offset + float(_step)


def _stored_later(
    self: UsageProcessor,
    raw: bytes | None,
    partition: int,
    offset: int,
    stored_at: float | None = None,
) -> None:
    # The broker's clock goes by with the app's: an event of the hour ahead is stored then.
    _handle(self, raw, partition, offset, None if stored_at is None else stored_at + float(_step))


_step = _fault.partition(":")[2]
if _fault.startswith("recovery:"):
    Recovery._wait = _stalled  # type: ignore[method-assign]
elif _fault.startswith("clock-ahead:"):
    RedisClock.now = _ahead_of_redis  # type: ignore[method-assign]
    UsageProcessor.handle = _stored_later  # type: ignore[method-assign]
else:
    UsageProcessor.handle = _faulty  # type: ignore[method-assign]
runpy.run_module("streams", run_name="__main__", alter_sys=True)
