"""``python -m ingress``: serve the OpenAI-compatible API with uvicorn."""

from __future__ import annotations

import asyncio
import sys

import uvicorn
from aiokafka.errors import KafkaError

from ingress.app import create_app
from ingress.connections import server_config
from ingress.settings import IngressSettings
from laneway.clients import make_admin
from laneway.errors import ConfigError
from laneway.logs import setup_logging, tune_gc
from laneway.settings import load_settings, settings_only


async def _kafka_answers(settings: IngressSettings) -> str | None:
    """Why Kafka cannot be used, or None. The ingress cannot start without it (Redis it can:
    its fallbacks answer); asked first so that a broker that is down is one line, not the
    traceback uvicorn prints for a failed start."""
    admin = make_admin(settings)
    try:
        await admin.start()
    except KafkaError as exc:
        return f"Kafka at {settings.kafka_bootstrap} did not answer: {exc!r}"
    finally:
        await admin.close()
    return None


def main(argv: list[str] | None = None) -> int:
    settings_only("python -m ingress", __doc__, argv)
    try:
        settings = load_settings(IngressSettings)
    except ConfigError as exc:
        print(f"laneway ingress: {exc}", file=sys.stderr)  # noqa: T201
        return 2
    setup_logging(settings.log_level, settings.log_format)
    problem = asyncio.run(_kafka_answers(settings))
    if problem is not None:
        print(f"laneway ingress: {problem}", file=sys.stderr)  # noqa: T201
        return 1
    tune_gc()
    server = uvicorn.Server(server_config(create_app(settings), settings))
    server.run()
    if not server.started:  # as uvicorn.run says a start that failed (a port in use, say)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
