"""When ``laneway up`` restarts a process that exited, and when it gives up on one: the wait
doubles per exit (with jitter), and too many exits in a window are a crash loop that stops the
stack."""

from __future__ import annotations

import random
from dataclasses import dataclass

from laneway.errors import ServiceError
from ops.settings import StackSettings, backoff_ceiling

__all__ = ["CrashLoop", "RestartPolicy"]


class CrashLoop(ServiceError):
    """A process exited too often in too short a time; the stack was stopped."""

    retriable = False

    def __init__(self, message: str, *, process: str, exits: int) -> None:
        super().__init__(message)
        self.process = process
        self.exits = exits


@dataclass(frozen=True)
class RestartPolicy:
    """When to restart a process that exited, and when to give up on it."""

    backoff_s: float = 0.5
    backoff_max_s: float = 30.0
    crash_limit: int = 5
    crash_window_s: float = 60.0

    @classmethod
    def from_settings(cls, settings: StackSettings) -> RestartPolicy:
        return cls(
            backoff_s=settings.restart_backoff_s,
            backoff_max_s=settings.restart_backoff_max_s,
            crash_limit=settings.crash_limit,
            crash_window_s=settings.crash_window_s,
        )

    def delay(self, exits_in_window: int) -> float:
        """Wait before the restart after the n-th exit in the window: the first backoff,
        doubled per exit up to the maximum, then jittered down by up to half (so processes
        that died together do not all come back in the same instant)."""
        ceiling = backoff_ceiling(self.backoff_s, self.backoff_max_s, exits_in_window)
        return ceiling * random.uniform(0.5, 1.0)
