"""The streams app as a process (``python -m streams``): the topics checked, the changelogs
made, then Faust run until a stop signal (0) or a failure (1)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
from collections.abc import Awaitable
from typing import TypeVar

from laneway.errors import ConfigError, ServiceError
from laneway.logs import setup_logging
from laneway.metrics import serve_metrics
from laneway.settings import load_settings, settings_only
from laneway.watchdog import AliveFile
from streams.app import StreamsApp
from streams.changelogs import ensure_changelogs, usage_partitions
from streams.settings import StreamsSettings
from streams.stop_signals import StopSignals

__all__ = ["run", "serve"]

log = logging.getLogger("streams")

T = TypeVar("T")


async def serve(settings: StreamsSettings, stops: StopSignals) -> int:
    """Run the app until SIGTERM or SIGINT (0) or until it fails (1)."""
    # First: a start that blocks the loop is as hung as a run that does.
    async with AliveFile(settings.watchdog_file):
        stop = asyncio.Event()
        stops.wake(asyncio.get_running_loop(), stop)
        partitions = await _prepared(settings, stop)
        if partitions is None:
            log.info("stopping before the app started: nothing to commit")
            return 0
        return await _serve_app(settings, partitions, stop)


async def _prepared(settings: StreamsSettings, stop: asyncio.Event) -> int | None:
    """The usage topic's partitions, once the changelogs are made for as many; None when a
    stop signal came first."""
    # Only read: a stop meanwhile ends it.
    partitions = await _unless_stopped(usage_partitions(settings), stop)
    if partitions is None:
        return None
    if settings.streams_partitions not in (0, partitions):
        # Each table partition folds the usage partition of its number: fewer would leave
        # usage unfolded, more would never be written, and the changelogs would not be
        # listed as Faust expects (a start that only timed out, naming no setting).
        raise ConfigError(
            f"LANEWAY_STREAMS_PARTITIONS={settings.streams_partitions}, but "
            f"{settings.topics.usage} has {partitions} partitions: the tables are partitioned "
            "as the topic they fold; set it to that or 0 (the topic's own)"
        )
    # Made whole even when a stop comes meanwhile (seconds at most): the changelogs are left
    # listed with their partitions and settings, not created and not yet configured.
    await ensure_changelogs(settings, partitions)
    return None if stop.is_set() else partitions


async def _unless_stopped(step: Awaitable[T], stop: asyncio.Event) -> T | None:
    """``step``'s result; None when ``stop`` is set first (``step`` is then cancelled)."""
    doing = asyncio.ensure_future(step)
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({doing, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if doing.done():
        return doing.result()
    doing.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await doing
    return None


async def _serve_app(settings: StreamsSettings, partitions: int, stop: asyncio.Event) -> int:
    streams = StreamsApp(settings, partitions=partitions)
    serve_metrics(settings.metrics_port)
    # Faust's start returns once the tables are recovered: a failure, or a signal, may come
    # before that (a recovery lost at the first start would hold it for ever).
    starting = asyncio.ensure_future(streams.start())
    stopping = asyncio.ensure_future(stop.wait())
    crashed = asyncio.ensure_future(streams.wait_crashed())
    await asyncio.wait({starting, stopping, crashed}, return_when=asyncio.FIRST_COMPLETED)
    if starting.done():
        starting.result()  # a start that failed says why
        await asyncio.wait({stopping, crashed}, return_when=asyncio.FIRST_COMPLETED)
    for waiter in (stopping, crashed):
        waiter.cancel()
    if streams.failure is not None:
        # Gone at once, as a killed process is: a graceful stop could commit past the record
        # (Faust acks an event as its agent lets go of it). The committed offsets and the
        # tables' changelogs are a state a restart continues from; what it reads again is
        # counted once (each table records the offsets it applied).
        log.error("%s; exiting to be restarted", streams.failure)
        logging.shutdown()
        os._exit(1)
    log.info("stopping: committing offsets and flushing table changelogs")
    await streams.stop()
    if not starting.done():  # the stop ended a start still waiting for recovery
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await starting
    if not stop.is_set():
        log.error("the streams app stopped by itself: %r", streams.app.crash_reason)
        return 1
    return 0


def run(argv: list[str] | None, stops: StopSignals, *, usage: str | None) -> int:
    """``python -m streams`` with ``stops`` handled since its start; its exit code."""
    settings_only("python -m streams", usage, argv)
    try:
        settings = load_settings(StreamsSettings)
    except ConfigError as exc:
        print(f"laneway streams: {exc}", file=sys.stderr)  # noqa: T201
        return 2
    setup_logging(settings.log_level, settings.log_format)
    # Faust and mode narrate every service start and stop at INFO; keep their warnings.
    for name in ("faust", "mode"):
        logging.getLogger(name).setLevel(
            max(logging.WARNING, logging.getLevelName(settings.log_level))
        )
    # Except table recovery's few lines a rebalance: where a recovery stopped, if one does.
    logging.getLogger("faust.tables.recovery").setLevel(settings.log_level)
    try:
        return asyncio.run(serve(settings, stops))
    except (ConfigError, ServiceError) as exc:
        log.error("%s", exc)  # noqa: TRY400 - the message says what to do; no traceback
        return 2
