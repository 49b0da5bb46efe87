"""Background loops restart after a failure instead of dying quietly."""

from __future__ import annotations

import asyncio

import pytest

from laneway.loops import keep_running


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
