"""Background tasks of a service: the one way to stop one."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

__all__ = ["stop_task"]


async def stop_task(task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` (if any) and wait until it has ended; safe on a task that is done."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
