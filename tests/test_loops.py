"""Background loops restart after a failure instead of dying quietly."""

from __future__ import annotations

import asyncio
import logging

import pytest

from laneway.loops import keep_running
from laneway.tasks import stop_task


async def test_a_loop_that_fails_runs_again_and_the_failure_is_told() -> None:
    runs: list[int] = []
    failures: list[BaseException] = []

    async def body() -> None:
        runs.append(len(runs))
        if len(runs) < 3:
            raise RuntimeError(f"run {len(runs)} broke")

    await asyncio.wait_for(
        keep_running("a test loop", body, first_backoff_s=0.001, on_failure=failures.append), 5
    )
    assert runs == [0, 1, 2]
    assert [str(f) for f in failures] == ["run 1 broke", "run 2 broke"]


async def test_cancelling_stops_it() -> None:
    started = asyncio.Event()

    async def forever() -> None:
        started.set()
        await asyncio.Event().wait()

    task = asyncio.create_task(keep_running("a test loop", forever))
    await asyncio.wait_for(started.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_stopping_a_loop_that_swallowed_its_cancel_asks_again() -> None:
    """A cancel that lands as redis-py's send completes is lost (Python 3.11's wait_for
    returns the send's result) and the read loop goes on: the ingress's reply router did,
    and its shutdown waited for good (issue 24's ten-runs hunt)."""
    reads: list[int] = []
    started = asyncio.Event()

    async def read_loop() -> None:
        while True:
            reads.append(len(reads))
            started.set()
            try:
                await asyncio.sleep(3600)  # a blocking read
            except asyncio.CancelledError:
                if len(reads) > 1:
                    raise
                continue  # what a lost cancel looks like to the loop: its next read

    task = asyncio.create_task(read_loop(), name="a read loop")
    await asyncio.wait_for(started.wait(), 5)
    stopping = asyncio.create_task(stop_task(task))
    # Not wait_for: its own cancel on timeout would reach the loop as the second ask.
    done, _ = await asyncio.wait({stopping}, timeout=10)
    assert stopping in done, "the stop waited on a loop that went on"
    assert task.cancelled()
    assert reads == [0, 1]


async def test_stopping_a_task_that_had_failed_logs_the_failure_and_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def broken() -> None:
        raise RuntimeError("the loop broke")

    task = asyncio.create_task(broken(), name="a broken loop")
    await asyncio.wait({task})
    with caplog.at_level(logging.ERROR, logger="laneway.tasks"):
        await stop_task(task)
    assert [r.getMessage() for r in caplog.records] == [
        "a broken loop had failed before it was stopped"
    ]
    assert "the loop broke" in caplog.text
