"""The hang watch of ``laneway up``: a process that gives signs of life (its watchdog file,
``laneway.watchdog``) and gives none for ``hang_timeout_s`` is killed, for its supervisor to
restart it as if it had crashed."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ops.supervised import Supervised
    from ops.supervisor import Supervisor

__all__ = ["HangWatch"]

log = logging.getLogger(__name__)

# How often signs of life are looked at (more often under a timeout shorter than 8 s).
_HANG_CHECK_S = 2.0
# A run's first sign of life comes after its interpreter started and imported its packages,
# which on a loaded machine (a broker's JVM starting beside it) takes far longer than a
# blocked loop is allowed: until its first beat it has at least this long.
_FIRST_BEAT_S = 120.0


def _beat_of(path: Path | None) -> int | None:
    """The watchdog file's mtime (ns), None while there is none."""
    if path is None:
        return None
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None


class HangWatch:
    """Kills a process of ``supervisor`` whose watchdog file stood still for its
    ``hang_timeout_s``, and remembers for how long, to say so when its exit is seen."""

    def __init__(self, supervisor: Supervisor) -> None:
        self._supervisor = supervisor
        # Per process: the watchdog file's mtime last seen, and when (monotonic) it was seen
        # to change or the run started.
        self._last_sign: dict[str, tuple[int | None, float]] = {}
        self._hung: dict[str, float] = {}  # killed as hung: seconds without a sign of life
        self._beating: set[str] = set()  # processes whose current run gave a sign of life

    def started(self, process: Supervised) -> None:
        """A new run of ``process``: its time to give a sign of life begins now."""
        self._last_sign[process.name] = (_beat_of(process.alive_file), time.monotonic())
        self._beating.discard(process.name)

    def killed_as_hung(self, name: str) -> float | None:
        """The seconds without a sign of life if the run of ``name`` that exited was killed
        as hung (said once per kill), else None."""
        return self._hung.pop(name, None)

    async def run(self) -> None:
        """Judge every process every few seconds, until cancelled."""
        every = min(_HANG_CHECK_S, self._supervisor.hang_timeout_s / 4)
        last_look = time.monotonic()
        while True:
            await asyncio.sleep(every)
            now = time.monotonic()
            if now - last_look > 2 * every:
                # This loop did not run for a while (the supervisor was stopped or starved),
                # and its children may have waited for it (on a full output pipe): that time
                # is held against none of them.
                self._last_sign = {n: (beat, now) for n, (beat, _) in self._last_sign.items()}
            last_look = now
            for process in self._supervisor.processes:
                self._judge(process, now)

    def _judge(self, process: Supervised, now: float) -> None:
        """Kill ``process`` if its watchdog file stood still for ``hang_timeout_s``; a process
        parked, down, stopping or already killed is not judged."""
        name = process.name
        timeout_s = self._supervisor.hang_timeout_s
        if (
            process.alive_file is None
            or self._supervisor.stopping
            or self._supervisor.is_parked(name)
            or name in self._hung
            or not self._supervisor.is_up(name)
        ):
            return
        beat = _beat_of(process.alive_file)
        seen, since = self._last_sign[name]  # set by every start
        if beat != seen:
            self._last_sign[name] = (beat, now)
            self._beating.add(name)
            return
        silent = now - since
        started = name in self._beating
        if silent < (timeout_s if started else max(timeout_s, _FIRST_BEAT_S)):
            return
        log.error(
            "%s (pid %s) gave no sign of life for %.0fs (%s); killing it to restart it",
            name,
            process.pid,
            silent,
            "its event loop is blocked or the process is stopped"
            if started
            else "it never started beating",
        )
        self._hung[name] = silent
        process.kill()
