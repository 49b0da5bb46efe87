"""SIGTERM and SIGINT for the whole life of ``python -m streams``, from its first line on.

Until a handler is installed a SIGTERM kills the process (exit -15): ``laneway up`` and an
operator may send one at any time, the first second included, while Faust and its
dependencies are still being imported (about a second) or the topics checked. So the
handler comes first, before those imports, and only notes the signal; the app, once its
event loop runs, is woken by ``StopSignals.wake`` and stops cleanly (exit 0) wherever it was.
Only the standard library here: importing this module must cost nothing.
"""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # asyncio itself takes 50 ms to import: the handler comes before it
    import asyncio
    from types import FrameType

__all__ = ["StopSignals"]

_STOPPING = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """The stop signals of the process: noted at once, and told to the event loop once it
    asks (``wake``)."""

    def __init__(self) -> None:
        self.received: signal.Signals | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None

    @classmethod
    def install(cls) -> StopSignals:
        """Handle SIGTERM and SIGINT from now on (in place of dying by them)."""
        stops = cls()
        for sig in _STOPPING:
            signal.signal(sig, stops._on_signal)
        return stops

    def wake(self, loop: asyncio.AbstractEventLoop, event: asyncio.Event) -> None:
        """Set ``event`` in ``loop`` at a stop signal; at once when one came before (during
        the imports, say)."""
        self._event, self._loop = event, loop
        # After both are kept: a signal from here on sets it through the loop.
        if self.received is not None:
            event.set()

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        # Python runs this in the main thread between two bytecodes, maybe inside the loop's
        # own code: the event is set by the loop, as asyncio.Runner does for its Ctrl-C.
        self.received = self.received or signal.Signals(signum)
        if self._loop is not None and self._event is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._event.set)
