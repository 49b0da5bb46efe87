"""``python -m ingress``: serve the OpenAI-compatible API with uvicorn."""

from __future__ import annotations

import sys

import uvicorn

from ingress.app import create_app
from ingress.settings import IngressSettings
from laneway.errors import ConfigError
from laneway.logs import setup_logging, tune_gc
from laneway.settings import load_settings


def main() -> int:
    try:
        settings = load_settings(IngressSettings)
    except ConfigError as exc:
        print(f"laneway ingress: {exc}", file=sys.stderr)  # noqa: T201
        return 2
    setup_logging(settings.log_level, settings.log_format)
    tune_gc()
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        access_log=False,
        timeout_graceful_shutdown=10,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
