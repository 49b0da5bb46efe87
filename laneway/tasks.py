"""Background tasks of a service: the one way to stop one."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection
from typing import Any

from laneway.loops import keep_running

__all__ = ["cancel_all", "kept", "stop_task"]

log = logging.getLogger(__name__)


async def stop_task(task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` (if any) and wait until it has ended, asking again while it goes on
    (``cancel_all``); safe on a task that is done. A failure it ended with is logged: the
    stop itself goes on."""
    if task is None:
        return
    await cancel_all([task])
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("%s had failed before it was stopped", task.get_name(), exc_info=exc)


def kept(name: str, loop: Callable[[], Awaitable[None]]) -> asyncio.Task[None]:
    """A loop of a service as a task that starts it again when it fails (``keep_running``):
    a dead one would stop its work quietly while the service looks alive."""
    return asyncio.create_task(keep_running(f"the {name} loop", loop), name=name)


async def cancel_all(tasks: Collection[asyncio.Task[Any]], ask_again_s: float = 2.0) -> None:
    """Cancel ``tasks`` and wait until they are done, asking again every ``ask_again_s``.

    A library may swallow a cancellation. redis-py sends each command through
    ``asyncio.wait_for``, which on Python 3.11 returns the send's result when the cancel
    lands just as the send completes (fixed in 3.12); it has also turned a cancel that
    landed as its read timeout expired into a timeout error. A loop goes on to its next
    read either way, and a single cancel would leave a service's stop (and its SIGTERM)
    waiting for good.
    """
    pending = {task for task in tasks if not task.done()}
    for task in pending:
        task.cancel()
    while pending:
        _, pending = await asyncio.wait(pending, timeout=ask_again_s)
        for task in pending:
            log.warning("%s went on after it was cancelled; cancelling it again", task.get_name())
            task.cancel()
    for task in tasks:
        if not task.cancelled():
            task.exception()  # retrieved (each loop logs its own failure)
