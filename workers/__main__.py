"""``python -m workers [--pool completion|chat|batch]``: run one worker until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Callable

from aiokafka.errors import KafkaError
from redis.exceptions import RedisError

from laneway.errors import ConfigError
from laneway.logs import setup_logging, tune_gc
from laneway.metrics import serve_metrics
from laneway.settings import load_settings
from laneway.watchdog import AliveFile
from workers.factory import create_worker
from workers.select import choose_engine
from workers.settings import WorkerSettings

log = logging.getLogger("workers")


async def _serve(settings: WorkerSettings) -> int:
    # First: a start that blocks the loop is as hung as a run that does.
    async with AliveFile(settings.watchdog_file):
        return await _serve_worker(settings)


async def _serve_worker(settings: WorkerSettings) -> int:
    engine, reason = choose_engine(settings)
    log.info("pool %s: engine %s chosen because %s", settings.pool, engine.name, reason)
    worker = create_worker(settings, engine)
    serve_metrics(settings.metrics_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await worker.start()
    except BaseException:
        # Whatever did start is closed (a broker that is down fails the start midway).
        with contextlib.suppress(Exception):
            async with asyncio.timeout(10):
                await worker.stop(grace_s=0)
        raise
    tune_gc()
    stopped = asyncio.create_task(worker.wait_stopped())
    signalled = asyncio.create_task(stop.wait())
    await asyncio.wait({stopped, signalled}, return_when=asyncio.FIRST_COMPLETED)
    log.info("stopping: no new fetches, draining for up to %.1fs", settings.drain_grace_s)
    await worker.stop()
    for task in (stopped, signalled):
        task.cancel()
    return 1 if worker.failed else 0


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop when installed: fewer syscalls and less Python per socket event."""
    try:
        import uvloop  # noqa: PLC0415 - optional accelerator
    except ImportError:
        return None
    return uvloop.new_event_loop


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers", description=__doc__)
    parser.add_argument("--pool", choices=["completion", "chat", "batch"], help="LANEWAY_POOL")
    args = parser.parse_args(argv)
    try:
        overrides = {"pool": args.pool} if args.pool else {}
        settings = load_settings(WorkerSettings, **overrides)
    except ConfigError as exc:
        print(f"laneway worker: {exc}", file=sys.stderr)  # noqa: T201
        return 2
    setup_logging(settings.log_level, settings.log_format)
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            return runner.run(_serve(settings))
    except ConfigError as exc:
        log.error("%s", exc)  # noqa: TRY400 - a config error needs no traceback
        return 2
    except KafkaError as exc:
        log.error("Kafka at %s did not answer: %r", settings.kafka_bootstrap, exc)  # noqa: TRY400
        return 1
    except RedisError as exc:
        log.error("Redis (LANEWAY_REDIS_URL) did not answer: %s", exc)  # noqa: TRY400
        return 1


if __name__ == "__main__":
    sys.exit(main())
