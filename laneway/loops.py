"""Background loops that never die quietly: a failure is logged and the loop starts again."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from laneway.retry import Backoff

__all__ = ["keep_running"]

log = logging.getLogger(__name__)


async def keep_running(
    name: str,
    body: Callable[[], Awaitable[None]],
    *,
    first_backoff_s: float = 0.2,
    max_backoff_s: float = 10.0,
    on_failure: Callable[[BaseException], None] | None = None,
) -> None:
    """Run ``body`` until it returns; when it raises, log it (with ``on_failure`` told) and
    run it again after a jittered, doubling wait. Cancellation stops it."""
    backoff = Backoff(first_backoff_s, max_backoff_s)
    while True:
        try:
            await body()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if on_failure is not None:
                on_failure(exc)
            wait = backoff.next_wait()
            log.exception("%s failed; starting it again in %.1fs", name, wait)
            await asyncio.sleep(wait)
        else:
            return
