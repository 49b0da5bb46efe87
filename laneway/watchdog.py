"""A process's sign of life for its supervisor: a file touched every second from the event
loop (``LANEWAY_WATCHDOG_FILE``).

The file's modification time moves only while the event loop runs: a loop blocked by a
synchronous call, a deadlock or a stopped process leaves it still, and ``laneway up``'s
supervisor kills a process whose file stood still too long (``LANEWAY_HANG_TIMEOUT_S``) to
restart it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

__all__ = ["BEAT_INTERVAL_S", "AliveFile"]

log = logging.getLogger(__name__)

BEAT_INTERVAL_S = 1.0


class AliveFile:
    """Touches ``path`` every ``interval_s`` from the running loop between ``start`` and
    ``stop`` (or inside ``async with``); a ``path`` of '' turns it off."""

    def __init__(self, path: str, interval_s: float = BEAT_INTERVAL_S) -> None:
        self.path = Path(path) if path else None
        self.interval_s = interval_s
        self._task: asyncio.Task[None] | None = None
        self._failing = False

    def start(self) -> None:
        if self.path is None or self._task is not None:
            return
        self._beat()  # the start is the first sign of life
        self._task = asyncio.get_running_loop().create_task(self._beat_on(), name="watchdog")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def __aenter__(self) -> AliveFile:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _beat_on(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self._beat()

    def _beat(self) -> None:
        if self.path is None:
            return
        try:
            self.path.touch()
        except OSError as exc:
            if not self._failing:  # once per spell, not every second
                log.warning(
                    "cannot touch the watchdog file %s (%s): a supervisor may take this "
                    "process for hung (LANEWAY_WATCHDOG_FILE)",
                    self.path,
                    exc.strerror,
                )
            self._failing = True
        else:
            self._failing = False
